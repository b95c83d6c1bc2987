"""A parallel form added as its folder plus one registry line (issue #38, item 1;
``docs/extending.md``): ``tests/toy_form``, where every rank trains the whole batch and nothing
is exchanged, is registered in spawned ranks by ``FXPAR_FORMS=tests.toy_form``
(:mod:`fxpar.forms`), and there the planner searches it and chooses it where links are slow, it
is priced, bounded and predicted, ``fxpar plan --emit`` writes it, it trains with parity, adapting
switches to it and from it with the optimizer's state, and its checkpoint loads under data
parallelism.  This process's registry never holds it.

Tolerances: ``tests/parity.py`` (the loss within ``LOSS_RTOL``, every gradient within
``GRAD_RTOL`` of its norm plus the floor, the weights' trajectory within ``TRAJECTORY_RTOL``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from fxpar.forms import NAMES, OPTIONAL_PHASES, PHASES, PLUGINS_VARIABLE
from tests.multirank.workers_toy import BATCH, TOY, parity, planning, switches
from tests.parity import check_loss, check_step, check_trajectory, expect

pytestmark = pytest.mark.multirank

TOY_DIR = Path(__file__).resolve().parents[1] / "toy_form"


@pytest.fixture(scope="module")
def toy_pool():
    """Two gloo ranks whose registry holds the toy form: the variable is in the environment
    they start with (each imports fxpar afresh), and only while they start."""
    from fxpar.runtime import WorkerPool

    before = os.environ.get(PLUGINS_VARIABLE)
    os.environ[PLUGINS_VARIABLE] = "tests.toy_form"
    try:
        pool = WorkerPool(2, env={"TRANSFORMERS_VERBOSITY": "error"})
    finally:
        if before is None:
            os.environ.pop(PLUGINS_VARIABLE)
        else:
            os.environ[PLUGINS_VARIABLE] = before
    yield pool
    pool.close()


def test_the_toy_form_is_its_folder_and_one_registry_line():
    files = sorted(p.name for p in TOY_DIR.glob("*.py"))
    assert files == sorted(["__init__.py", *(f"{phase}.py" for phase in PHASES if phase not in OPTIONAL_PHASES)])
    registry_lines = [line for line in (TOY_DIR / "__init__.py").read_text().splitlines() if "Form(" in line]
    assert len(registry_lines) == 1 and TOY not in NAMES   # this process never registered it


@pytest.mark.full   # a pool of its own: ~14 s for the three, beyond the quick tier's budget
def test_planned_priced_bounded_and_emitted(toy_pool, tmp_path):
    out = toy_pool.run(planning, str(tmp_path))[0]
    assert out["names"][-1] == TOY and TOY in out["searched"] and out["modules"] == "tests.toy_form"
    fast, slow = out["fast"], out["slow"]
    # fast links: data parallelism's exchange is cheaper than every rank training it all
    assert fast["form"] == "data_parallel" and fast["step_s"] < fast["toy_step_s"]
    # slow links: only the toy form exchanges nothing, and the planner picks it
    assert slow["form"] == TOY and slow["step_s"] == slow["toy_step_s"]
    assert any(line.startswith(f"{TOY}, every rank the whole batch") for line in slow["explain"])
    for links in (fast, slow):
        assert links["round_trip"] and links["shares"] == [BATCH, BATCH]
        assert "the ranks exchange nothing" in links["table"]
        assert math.isclose(links["predicted_s"], links["toy_step_s"], rel_tol=1e-9)   # same simulator
        assert links["lower_bound_s"] <= links["step_s"] and links["toy_bound_s"] <= links["toy_step_s"]
    assert "plan.ranks[1].batch_share = 4" in out["bad_plan"] and "whole global batch" in out["bad_plan"]
    assert out["cli"] == 0 and out["emitted"]["plan.json"]["form"] == TOY
    assert out["emitted"]["rank_1.json"]["runs"] == "the unchanged model on the whole global batch"


@pytest.mark.full   # a pool of its own: ~14 s for the three, beyond the quick tier's budget
def test_trains_with_parity(toy_pool):
    for r in toy_pool.run(parity):
        assert r["form"] == TOY and r["module"] == "RankModule" and r["pass"] == "Replicated" and r["rows"] == [0, BATCH]
        for k, step in enumerate(r["steps"]):
            expect(*check_step(step), context=(r["rank"], k))
        expect(check_trajectory(r["weights"]), context=r["rank"])


@pytest.mark.full   # a pool of its own: ~14 s for the three, beyond the quick tier's budget
def test_adapting_switches_to_and_from_it_and_its_checkpoint_loads(toy_pool, tmp_path):
    results = toy_pool.run(switches, str(tmp_path / "ckpt"))
    for r in results:
        assert r["kinds"] == ["data_parallel", TOY, "data_parallel", TOY, "data_parallel", "data_parallel"]
        assert r["events"].count("switch") == 3 and r["resumed_at"] == 4 and r["n_state"] > 0
        for k, (loss, ref) in enumerate(r["losses"]):
            expect(check_loss(loss, ref), context=f"rank {r['rank']} step {k}")
        expect(check_trajectory(r["weights"]), context=r["rank"])
