"""The pure parts of ``benchmarks/sharded_emulated.py``: the memory-cap verdict, the plan cell and
the table built from injected measurements (no timing, no processes, no timing assertions)."""

from __future__ import annotations

from benchmarks.sharded_emulated import ARMS, MIB, cap_verdict, capped_cluster, describe, summarize
from fxpar.forms.hand_plans import sharded_data_parallel_plan

CAPS = [512 * MIB, 100 * MIB]


def _rank(times: list[float], losses: list[float], peak_mib: float) -> dict:
    return {"times": times, "losses": losses, "peak_bytes": int(peak_mib * MIB), "base_bytes": 0, "at_peak": ""}


def test_cap_verdict_names_every_rank_over_its_cap():
    assert cap_verdict([400 * MIB, 100 * MIB], CAPS) == "fits"          # at the cap: it holds
    verdict = cap_verdict([600 * MIB, 101 * MIB], CAPS)
    assert verdict.startswith("out of memory") and "rank 0 600.0 > 512.0 MiB" in verdict
    assert "rank 1 101.0 > 100.0 MiB" in verdict


def test_table_from_injected_measurements():
    arms = {"fxpar sharded": {"plan": "ZeRO-3 ...", "source": "planner",
                              "predicted": {"peak_bytes": [300 * MIB, 90 * MIB]}},
            "torch FSDP2": {"plan": "-", "source": "fully_shard", "predicted": {"peak_bytes": [200 * MIB, 200 * MIB]}},
            "fxpar even_fsdp": {"plan": "-", "source": "even", "predicted": None},
            "fxpar best other": {"plan": None, "source": "dp / pipeline", "not_fit": "InfeasibleError: short"}}
    results = {"fxpar sharded": [_rank([1.0, 3.0, 2.0], [8.5, 8.4], 280), _rank([1.0, 3.0, 2.0], [8.5, 8.4], 95)],
               "torch FSDP2": [_rank([4.0, 4.0], [8.500004, 8.41], 150), _rank([4.0, 4.0], [8.500004, 8.41], 190)],
               "fxpar even_fsdp": [_rank([5.0], [8.5, 8.4], 120), _rank([5.0], [8.5, 8.4], 99)],
               "fxpar best other": None}
    head, rows, figures = summarize(arms, results, CAPS)
    assert [r[0] for r in rows] == list(ARMS) and len(head) == len(rows[0])
    sharded = dict(zip(head, rows[0]))
    assert sharded["median step s (emulated)"] == "2.000" and sharded["FSDP2 / arm"] == "2.00x"
    assert sharded["best other / arm"] == "-" and sharded["memory"] == "fits"
    assert sharded["tensor peak MiB r0 / r1 (measured)"] == "280.0 / 95.0"
    assert sharded["predicted MiB"] == "300.0 / 90.0" and sharded["cap MiB (emulated)"] == "512.0 / 100.0"
    fsdp2 = dict(zip(head, rows[1]))
    assert fsdp2["memory"] == "out of memory: rank 1 190.0 > 100.0 MiB" and fsdp2["FSDP2 / arm"] == "1.00x"
    assert dict(zip(head, rows[2]))["predicted MiB"] == "-"
    other = dict(zip(head, rows[3]))
    assert other["memory"] == "not run: InfeasibleError: short" and other["median step s (emulated)"] == "-"
    assert figures["fxpar sharded"]["vs_fsdp2"] == 2.0 and figures["fxpar best other"]["median_step_s"] is None
    assert abs(figures["torch FSDP2"]["step0_loss_diff_vs_sharded"] - 4e-6) < 1e-9


def test_capped_cluster_and_plan_cell():
    cluster = capped_cluster((1.0, 0.5), (0.5, 0.1), 2.0)
    assert [d.memory_bytes for d in cluster.devices] == [int(0.5 * 2 ** 30), int(0.1 * 2 ** 30)]
    assert [d.speed for d in cluster.devices] == [1.0, 0.5] and cluster.is_emulated()
    plan = sharded_data_parallel_plan(cluster, batch_split=[12, 4], state_split=[3, 1], shard_stage=3,
                                      micro_batch_size=2, activation_checkpointing=[False, True])
    assert describe(plan) == "ZeRO-3 batch 12/4 state 3:1 mb 6/2 ckpt n/y offload n/n"
    assert describe(None) == "-"
