"""Two "nodes" on one machine: network namespaces joined by a veth pair (10.77.0.1/24 and
10.77.0.2/24), each with its own host name (a UTS namespace), each running
``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.77.0.1:29400``
on tests/multirank/netns_node.py.  ``fxpar.Cluster.detect()`` must see 2 nodes; after a few fxpar
data-parallel steps node B's torchrun (and its worker) is killed, and node A must exit with a
clear error (not hang) within a bound.  A second case freezes node B (SIGSTOP: alive, silent,
its sockets open), which only the collective timeout of ``init_distributed`` can end.

Needs root, iproute2's ``ip netns`` and util-linux's ``unshare``; without them the test skips
and says which command failed.  Namespaces and links are removed in a ``finally``.

Where the freeze lands decides which collective node A waits in; the last test freezes a peer
at the one that used to outlast the timeout (a sharded step's reduce-scatter, on a second group
torch had given its 30-minute default), deterministically and without namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ADDR_A, ADDR_B, PORT = "10.77.0.1", "10.77.0.2", 29400
READY_S = 150.0        # both nodes started, rendezvous, detect, 3 steps (2 shared cores)
# The collective timeout also bounds fxpar.auto's plan broadcast, which waits while rank 0
# traces and solves: 10 s ran out there on a loaded 2-core machine (torch 2.15, 3 jobs at once).
COLLECTIVE_TIMEOUT_S = 30.0
SURVIVOR_EXIT_S = COLLECTIVE_TIMEOUT_S + 45.0  # node A's error and torchrun's exit after node B is lost
pytestmark = [pytest.mark.multirank, pytest.mark.full]  # subprocess jobs: the full suite


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


def _names() -> dict[str, str]:
    tag = f"{os.getpid() % 100000}"
    return {"ns_a": f"fxpa{tag}", "ns_b": f"fxpb{tag}", "if_a": f"fxva{tag}", "if_b": f"fxvb{tag}"}


def _setup(n: dict[str, str]) -> None:
    """Two namespaces and a veth pair between them; skip (saying what failed) if not possible."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"network namespaces unavailable: `{tool}` is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces unavailable: `ip netns add` needs root")
    steps = [
        ["ip", "netns", "add", n["ns_a"]], ["ip", "netns", "add", n["ns_b"]],
        ["ip", "link", "add", n["if_a"], "type", "veth", "peer", "name", n["if_b"]],
        ["ip", "link", "set", n["if_a"], "netns", n["ns_a"]],
        ["ip", "link", "set", n["if_b"], "netns", n["ns_b"]],
        ["ip", "-n", n["ns_a"], "addr", "add", f"{ADDR_A}/24", "dev", n["if_a"]],
        ["ip", "-n", n["ns_b"], "addr", "add", f"{ADDR_B}/24", "dev", n["if_b"]],
        ["ip", "-n", n["ns_a"], "link", "set", n["if_a"], "up"],
        ["ip", "-n", n["ns_b"], "link", "set", n["if_b"], "up"],
        ["ip", "-n", n["ns_a"], "link", "set", "lo", "up"],
        ["ip", "-n", n["ns_b"], "link", "set", "lo", "up"],
    ]
    for cmd in steps:
        done = _run(cmd)
        if done.returncode != 0:
            _teardown(n)
            pytest.skip(f"network namespaces unavailable: `{' '.join(cmd)}` failed: "
                        f"{(done.stderr or done.stdout).strip()}")
    probe = _run(["ip", "netns", "exec", n["ns_a"], "unshare", "--uts", "true"])
    if probe.returncode != 0:
        _teardown(n)
        pytest.skip(f"UTS namespaces unavailable: `unshare --uts` failed: {probe.stderr.strip()}")


def _teardown(n: dict[str, str]) -> None:
    for ns in (n["ns_a"], n["ns_b"]):  # deleting a namespace deletes its end of the veth pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
    subprocess.run(["ip", "link", "del", n["if_a"]], capture_output=True, timeout=30, check=False)


def _node(n: dict[str, str], which: str, out: Path) -> subprocess.Popen:
    """torchrun for node ``which`` ("a" hosts the rendezvous) in its namespace, own session."""
    ns, iface = n[f"ns_{which}"], n[f"if_{which}"]
    addr = ADDR_A if which == "a" else ADDR_B
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{ADDR_A}:{PORT}", "--rdzv-id", "fxpar-two-nodes",
                "--rdzv-conf", f"is_host={'true' if which == 'a' else 'false'},join_timeout=120",
                "--local-addr", addr, "--max-restarts", "0",
                str(ROOT / "tests" / "multirank" / "netns_node.py"), "--out", str(out), "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    script = f"hostname fxpar-node-{which} && exec " + " ".join(f"'{a}'" for a in torchrun)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface, "TRANSFORMERS_VERBOSITY": "error",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(out / f"node-{which}.log", "w") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", script],
                                cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _signal_node(ns: str, sig: signal.Signals) -> None:
    """Send ``sig`` to every process in namespace ``ns`` (torchrun's workers run in sessions of
    their own, so signalling the launcher's process group would miss them)."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30, check=False)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:
            pass


def _kill_node(ns: str, proc: subprocess.Popen) -> None:
    """SIGKILL the whole node (as a crash or power loss would) and reap its launcher."""
    _signal_node(ns, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.mark.parametrize("loss", ["killed", "frozen"])
def test_two_namespaced_nodes_detect_train_and_survive_a_lost_node(tmp_path: Path, loss: str) -> None:
    n = _names()
    _setup(n)
    nodes: dict[str, subprocess.Popen] = {}
    try:
        nodes["a"] = _node(n, "a", tmp_path)
        nodes["b"] = _node(n, "b", tmp_path)
        deadline = time.monotonic() + READY_S
        while not all((tmp_path / f"ready-rank{r}").is_file() for r in (0, 1)):
            for which, proc in nodes.items():
                if proc.poll() is not None:
                    pytest.fail(f"node {which} exited early ({proc.returncode}):\n"
                                + (tmp_path / f"node-{which}.log").read_text()[-4000:])
            if time.monotonic() > deadline:
                pytest.fail("the nodes did not reach step 3 in time:\n" + "\n".join(
                    (tmp_path / f"node-{w}.log").read_text()[-2000:] for w in nodes))
            time.sleep(0.2)
        for r in (0, 1):
            seen = json.loads((tmp_path / f"detect-rank{r}.json").read_text())
            assert seen["num_nodes"] == 2 and seen["world_size"] == 2, seen
            assert sorted(seen["hosts"]) == ["fxpar-node-a", "fxpar-node-b"], seen

        killed_at = time.monotonic()
        if loss == "killed":
            _kill_node(n["ns_b"], nodes["b"])  # node B's torchrun agent and its worker, at once
        else:
            _signal_node(n["ns_b"], signal.SIGSTOP)  # alive but silent: only the timeout helps
        try:
            code = nodes["a"].wait(timeout=SURVIVOR_EXIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node A still running {SURVIVOR_EXIT_S:.0f} s after node B was killed:\n"
                        + (tmp_path / "node-a.log").read_text()[-4000:])
        took = time.monotonic() - killed_at
        log = (tmp_path / "node-a.log").read_text()
        assert code != 0, log[-4000:]
        errors = [line for line in log.splitlines() if line.startswith("NODE-ERROR")]
        assert errors, log[-4000:]
        assert "RuntimeSetupError" in errors[0] and "check the other ranks' logs" in errors[0], errors[0]
        print(f"node A exited ({code}) {took:.1f} s after node B was {loss}")
        if loss == "frozen":  # the collective timeout, not a closed connection, ended the wait
            assert took >= COLLECTIVE_TIMEOUT_S - 1, took
    finally:
        for which, proc in nodes.items():
            _kill_node(n[f"ns_{which}"], proc)
        _teardown(n)


# ---- the mechanism, deterministically: a peer frozen at an exact collective -------------------
FROZEN_TIMEOUT_S = 3.0
SPAWN_BUDGET_S = 20.0  # two fresh interpreters with torch and fxpar, set-up and one good step


def test_a_peer_frozen_before_its_reduce_scatter_is_lost_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 SIGSTOPs itself right before launching the gradient reduce-scatter of a sharded
    data-parallel step (tests/multirank/workers_frozen_peer.py); rank 0's step must end in the lost-peer
    error after the collective timeout.  The reduce-scatters run on a second process group, which
    ``torch.distributed.new_group`` gives gloo's default timeout (30 min), not the job's: a node
    frozen there held the other one for half an hour (the flaky ``[frozen]`` case above, whose
    freeze landed there only sometimes).  gloo's reduce-scatter cannot be bounded at the wait
    either (its work ignores ``wait(timeout=...)``), so the group itself must carry the timeout."""
    import multiprocessing as mp

    from tests.multirank.workers_frozen_peer import frozen_peer_step

    ctx = mp.get_context("spawn")
    result, phase = tmp_path / "rank0.json", "reduce_scatter"
    procs = [ctx.Process(target=frozen_peer_step, daemon=True,
                         args=(str(tmp_path / "rdzv"), r, FROZEN_TIMEOUT_S, str(result), phase)) for r in range(2)]
    start = time.monotonic()
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=SPAWN_BUDGET_S + FROZEN_TIMEOUT_S + 10)
        assert not procs[0].is_alive(), (f"rank 0 still waiting {time.monotonic() - start:.0f} s after the "
                                         f"start, its peer frozen before its {phase}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a stopped process
            p.join(timeout=5)
    outcome = json.loads(result.read_text())
    message = outcome["message"]
    assert outcome["type"] == "RuntimeSetupError" and outcome["fxpar"], outcome
    assert "RankModule.step" in message and "check the other ranks' logs" in message, message
    cause = message.split(" failed after ", 1)[-1].lower()
    assert "timed out" in cause or "timeout" in cause, message  # the timeout, not a closed socket
    assert FROZEN_TIMEOUT_S - 1 <= outcome["seconds"], outcome  # a timeout never fires early
