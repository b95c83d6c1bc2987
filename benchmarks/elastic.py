"""A 4 → 3 node loss (and a 3 → 4 join) under elastic torchrun (gloo CPU ranks, emulated): time to
resume, steps lost.

Four torchrun agents (one per emulated node, one worker each, c10d rendezvous on 127.0.0.1,
``--nnodes 3:4 --max-restarts 3``) run ``examples/train_elastic.py``.  Once step ``kill_after`` is
logged, one node that does not host the rendezvous store (the first agent hosts it, set by
``is_host``) is lost: its agent and its worker get SIGKILL.  The survivors' collectives fail,
their agents restart them as a 3-node job, which re-plans for 3 ranks and resumes from the newest
complete background checkpoint.  Measured: the steps lost (last step done before the loss − the
step resumed from), the time from the kill to the first step of the new job, and every step's loss
against one process on the same batches.  With ``grow`` a fourth node joins a running 3-node job
instead: torchrun's agents see it waiting, stop their workers and restart all four, which re-plan
for 4 ranks and resume from the newest checkpoint.  Used by ``tests/multirank/test_elastic.py`` and by the
``adapt`` benchmark suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fxpar.models import PRESETS
from fxpar.tracing.hf import build_model, example_inputs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_elastic.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(tmp: Path, node: int, port: int, script_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "3:4", "--nproc-per-node", "1",
           "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "fxpar-elastic",
           # the first agent hosts the store, by configuration: left to the bind race on 127.0.0.1
           # (every agent matches the endpoint's host), the node lost could be the store's host
           "--rdzv-conf", f"last_call_timeout=2,join_timeout=120,is_host={int(node == 0)}",
           "--monitor-interval", "0.5", str(SCRIPT), *script_args]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "FXPAR_EMULATED_SPEED": "1.0"}
    log = open(tmp / f"agent{node}.log", "w")  # noqa: SIM115 - the agent writes it until it exits
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)


def _records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.is_file() else []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _lose_a_node(tmp: Path, agents: list[subprocess.Popen]) -> float:
    """SIGKILL one node (agent + worker) other than the store's host (the first agent)."""
    pids = tmp / "ckpt" / "pids"
    for rank in (3, 2, 1):
        worker = int((pids / f"rank{rank}").read_text())
        agent = _parent(worker)
        if agent != agents[0].pid:
            os.kill(agent, signal.SIGKILL)
            os.kill(worker, signal.SIGKILL)
            return time.time()
    raise RuntimeError("every worker runs under the store's agent")


def reference_losses(steps: int, batch: int, seq: int) -> list[float]:
    """One process, AdamW lr 1e-3, the example's batches: the loss of every step."""
    torch.manual_seed(0)
    model = build_model(PRESETS["llama-tiny"], device="cpu", seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for s in range(steps):
        loss = model(**example_inputs(model, batch, seq, seed=100 + s)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss))
    return out


def run_elastic(tmp: Path, *, steps: int = 14, every: int = 2, kill_after: int = 6,
                step_delay: float = 0.3, timeout_s: float = 400, grow: bool = False) -> dict[str, Any]:
    """The scenario of the module docstring (``grow``: the other way, a 3-node job that a fourth
    node joins after step ``kill_after``); the measurements and the step records."""
    port, log = _free_port(), tmp / "steps.jsonl"
    args = ["--steps", str(steps), "--every", str(every), "--checkpoint-dir", str(tmp / "ckpt"),
            "--loss-log", str(log), "--step-delay", str(step_delay), "--timeout", "20"]
    agents = [_agent(tmp, i, port, args) for i in range(3 if grow else 4)]
    deadline = time.time() + timeout_s
    try:
        while not any(r.get("step", -1) >= kill_after for r in _records(log)):
            if time.time() > deadline or any(a.poll() not in (None, 0) for a in agents):
                raise RuntimeError(f"the job never reached step {kill_after}: {_tails(tmp)}")
            time.sleep(0.1)
        if grow:
            killed_at = time.time()
            agents.append(_agent(tmp, 3, port, args))
        else:
            killed_at = _lose_a_node(tmp, agents)
        survivors = [a for a in agents if a.poll() is None]
        for a in survivors:
            a.wait(timeout=max(deadline - time.time(), 1))
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    codes = [a.returncode for a in agents]
    records = _records(log)
    return {"records": records, "killed_at": killed_at, "return_codes": codes, "agent_logs": _tails(tmp),
            **_measure(records, killed_at)}


def _measure(records: list[dict[str, Any]], changed_at: float) -> dict[str, Any]:
    """From the step records: the worlds of each start, the step the new job resumed from, the
    steps the old job finished (its world's records), the steps lost (finished − resumed), the
    time from the loss (or join) to the new job's first step, and its checkpoint load time."""
    starts = [r for r in records if r.get("event") == "start"]
    steps = [r for r in records if "step" in r and "event" not in r]
    resumed = starts[-1] if len(starts) > 1 else None
    old_world = starts[0]["world"] if starts else None
    done = max((r["step"] for r in steps if r["world"] == old_world), default=-1) + 1
    new = [r for r in steps if resumed and r["world"] == resumed["world"] and r["time"] > changed_at]
    return {"worlds": [s["world"] for s in starts], "resumed_step": resumed["step"] if resumed else None,
            "steps_done_before_change": done,
            "steps_lost": done - resumed["step"] if resumed else None,
            "resume_s": new[0]["time"] - changed_at if new else None,
            "load_s": resumed["resume_s"] if resumed else None}


def _tails(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-1500:] for p in sorted(tmp.glob("agent*.log")))
