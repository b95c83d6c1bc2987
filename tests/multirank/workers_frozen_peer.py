"""Process body of tests/multirank/test_two_nodes.py's frozen-peer regression test (spawned, 2 gloo ranks).

Both ranks train a tiny MLP with sharded data parallelism (the plan ``fxpar.auto`` picked for the
two namespaced nodes) through a process group made by :func:`fxpar.runtime.init_distributed`.
After one good step, rank 1 stops itself (SIGSTOP: alive, silent, sockets open, as a frozen node)
at an exact point of the next step: right before it launches a collective of ``phase``
(``"reduce_scatter"``: the gradient reduce-scatter, which runs on the module's second process
group; ``"all_gather"``: the parameter all-gather, on the job's group).  Rank 0 writes what its
step raised (type, message, seconds) to ``result_file``; the test kills rank 1.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

import fxpar
import fxpar.runtime.ragged as ragged
from fxpar.codegen.common.module import RankModule
from fxpar.forms.hand_plans import sharded_data_parallel_plan
from fxpar.runtime import init_distributed

#: phase -> the name in fxpar.runtime.ragged that launches that collective
LAUNCHERS = {"reduce_scatter": "_reduce_scatter", "all_gather": "_all_gather"}


def _freeze_before(phase: str) -> None:
    """Make this process SIGSTOP itself right before its next launch of ``phase``'s collective."""
    name = LAUNCHERS[phase]
    launch = getattr(ragged, name)

    def frozen_launch(*args: Any, **kwargs: Any) -> Any:
        setattr(ragged, name, launch)
        os.kill(os.getpid(), signal.SIGSTOP)
        return launch(*args, **kwargs)
    setattr(ragged, name, frozen_launch)


def frozen_peer_step(init_file: str, rank: int, timeout_s: float, result_file: str, phase: str) -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    init_distributed(timeout_s=timeout_s, backend="gloo", init_method=f"file://{init_file}",
                     rank=rank, world_size=2, verbose=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    plan = sharded_data_parallel_plan(fxpar.Cluster.emulated([1.0, 1.0]), batch_split=[4, 4],
                                      state_split=[1, 1], shard_stage=3)
    pm = RankModule(model, plan, rank, emulate=False, loss_fn=lambda out, batch: out.pow(2).mean())
    opt = torch.optim.SGD(pm.parameters(), lr=0.01)
    pm.step(x)  # one good step: both ranks alive
    opt.step()
    opt.zero_grad()
    if rank == 1:
        _freeze_before(phase)
    start = time.monotonic()
    try:
        pm.step(x)
        outcome: dict[str, Any] = {"type": None, "message": "no error"}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = {"type": type(exc).__name__, "fxpar": isinstance(exc, fxpar.FxparError), "message": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(outcome, f)
    os._exit(0)  # the peer is frozen: skip destroy_process_group, which may wait for it
