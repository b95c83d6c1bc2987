"""Regenerate the results page (``docs/results.md``) from the latest JSON files of full runs, or
of quick runs with ``--quick`` (how the stored page is made: ``tests/project/test_benchmarks_readme.py``
holds the page and the README's table to what that writes from ``benchmarks/results``).

    python -m benchmarks.readme [--print] [--results DIR] [--quick]

Replaces everything between ``<!-- results:begin -->`` and ``<!-- results:end -->`` there.  Every
figure in that section, in the tables and in the sentences around them, is computed here from
the stored results (``benchmarks/results/*.json``); none is typed.  A sentence whose figure
needs a field that an older result file lacks is written without that figure.
"""

from __future__ import annotations

import json
import math
import statistics
from functools import reduce
from pathlib import Path
from typing import Any

from benchmarks import readme_sections
from benchmarks.common import RESULTS
from benchmarks.readme_sections import table

#: the page the results section lives in (its links are relative to it)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "results.md"
#: the README, whose one results table (:func:`headline`) sits between its headline markers
README = PAGE.parents[1] / "README.md"
HEAD_BEGIN, HEAD_END = "<!-- headline:begin -->", "<!-- headline:end -->"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def _files(name: str, folder: Path, quick: bool | None = False) -> list[Path]:
    """A suite's result files, oldest first (quick=None: full and quick runs)."""
    return sorted(p for p in Path(folder).glob(f"{name}-*.json")
                  if quick is None or ("-quick-" in p.name) == quick)


def _latest(name: str, folder: Path = RESULTS, quick: bool = False) -> dict | None:
    files = _files(name, folder, quick)
    return json.loads(files[-1].read_text()) if files else None


# ---- wording helpers --------------------------------------------------------------------------
def _x(v: float) -> str:
    return f"{v:.2f}x"


def _speeds(speeds: list[float]) -> str:
    return "/".join(f"{s:g}" for s in speeds)


def _join(items: list[str]) -> str:
    items = [i for i in items if i]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


def _model_words(name: str, config: dict | None) -> str:
    """``llama-tiny (4 layers, hidden 256)``; ``mixtral-tiny (4 experts, top-2)``.  The shape
    comes from the result (new files) or from the preset the result names."""
    if config is None:
        from fxpar.demo import model_summary
        from fxpar.models import PRESETS

        config = model_summary(name) if name in PRESETS else None
    if not config:
        return name
    parts = [f"{config['layers']} layers" if config.get("layers") else "",
             f"hidden {config['hidden']}" if config.get("hidden") else ""]
    if config.get("experts"):
        parts.append(f"{config['experts']} experts, top-{config['top_k']}")
    return f"{name} ({', '.join(p for p in parts if p)})"


def _models(runs: list[dict]) -> str:
    seen: dict[str, dict | None] = {}
    for r in runs:
        seen.setdefault(r["model"], r.get("model_config"))
    return _join([_model_words(m, c) for m, c in seen.items()])


def _one(values: list[Any]) -> Any:
    """The value every run shares, else None."""
    distinct = {json.dumps(v, sort_keys=True) for v in values}
    return values[0] if values and len(distinct) == 1 else None


def _fairness(data: dict) -> list[str]:
    """The stored fairness checks as a sentence (nothing for results without them)."""
    checks = data.get("fairness") or []
    done = [c for c in checks if c["ok"] is not None]
    if not done:
        return []
    slack = _one([c["slack"] for c in done])
    items = [f"{c['arm']} at {_speeds(c['speeds'])} ({', '.join(map(str, c['key']))}): {_x(c['ratio'])} "
             f"(bound {_x(c['bound'])}{'' if c['ok'] else ', over it'})" for c in done]
    bad = [c for c in done if not c["ok"]]
    verdict = (f"Over the bound: {_join(sorted({c['arm'] for c in bad}))}; ratios against {'it' if len(bad) == 1 else 'them'} "
               "in the rows concerned overstate fxpar's gain." if bad else "Every baseline is within its bound.")
    bound = f"1/s_min + {slack:.0%}" if slack is not None else "1/s_min plus a noise slack"
    return ["", "Fairness of the emulation (how much slowing the ranks slowed each baseline: its step at "
            f"the slow speeds over its step at equal speeds, which emulation bounds by {bound}): "
            + "; ".join(items) + ". " + verdict]


# ---- sections ---------------------------------------------------------------------------------
def _dp(dp: dict, cores: Any, folder: Path) -> list[str]:
    runs = dp["runs"]
    seq, dtype = _one([r.get("seq_len") for r in runs]), _one([r.get("dtype") for r in runs])
    setting = ", ".join(p for p in (f"seq {seq}" if seq else "", dtype or "") if p)
    has_even = any(r.get("fxpar_even_step_s") is not None for r in runs)
    methods = ("torch DDP, torch FSDP2 (`fully_shard` per block) and 'fxpar even', fxpar's own module at "
               "torch's even split, which separates the gain of planning from the runtime's"
               if has_even else "torch DDP and torch FSDP2 (`fully_shard` per block), both with an even split")
    out = ["", f"Measured training step on {_models(runs)}{', ' + setting if setting else ''}, fxpar against "
           f"{methods} (`python -m benchmarks.dp_emulated`). Each figure is the median of warmed-up steps, "
           "with min and max in the JSON. fxpar and DDP alternate in the same worker processes; FSDP2 runs in "
           "fresh ones, because its device mesh slows whatever runs after it in a process:", "", table(dp)]
    prose = _dp_caveats(runs, cores, folder)
    return out + (["", " ".join(prose)] if prose else []) + _fairness(dp)


def _dp_caveats(runs: list[dict], cores: Any, folder: Path) -> list[str]:
    """What to read the data-parallel rows with: speedups above the ideal (a rank that sleeps frees
    a core of this machine) and the run-to-run noise of the equal-speed rows."""
    above = [r for r in runs if r["speedup"] > r["ideal_speedup"] and min(r["speeds"]) < 1]
    prose = []
    if above:
        crowded = sorted({len(r["speeds"]) for r in runs if isinstance(cores, int) and len(r["speeds"]) > cores})
        rows = _join([r["model"] + " " + _speeds(r["speeds"]) for r in above])
        prose.append(f"Ratios above the ideal ({rows}) "
                     f"come from this {cores}-core machine. A rank that sleeps (emulating a slow card) frees a "
                     "core for the busy one, which an even split, with every rank always computing, never gets"
                     + (f"; the {_join([str(n) for n in crowded])}-rank rows run "
                        f"{_join([str(n) for n in crowded])} processes on {cores} cores" if crowded else "")
                     + ". Read such rows as 'reaches the ideal', not as beating it.")
    noise = _equal_speed_noise(folder)
    if noise:
        prose.append("The equal-speed rows, where every method does the same work, show the run-to-run noise: "
                     + "; ".join(noise) + ".")
    return prose


def _equal_speed_noise(folder: Path) -> list[str]:
    """Per model, the range of fxpar's ratios to each baseline at equal speeds over every stored
    dp_emulated result (full and quick runs)."""
    ratios: dict[tuple[str, str], list[float]] = {}
    count = 0
    for path in _files("dp_emulated", folder, quick=None):
        runs = [r for r in json.loads(path.read_text()).get("runs", []) if len(set(r["speeds"])) == 1]
        count += bool(runs)
        for r in runs:
            for field, label in (("ddp_step_s", "DDP"), ("fxpar_even_step_s", "fxpar even")):
                if r.get(field) is not None:
                    ratios.setdefault((r["model"], label), []).append(r[field] / r["fxpar_step_s"])
    out = []
    for (model, label), vs in ratios.items():
        span = _x(vs[0]) if len(vs) == 1 else f"from {_x(min(vs))} to {_x(max(vs))}"
        out.append(f"{model}'s ratio to {label} measured {span}")
    if out and count > 1:
        out[0] = f"across the {count} stored runs with such rows, " + out[0]
    return out


def _pp(pp: dict) -> list[str]:
    runs = pp["runs"]
    first = runs[0]
    shape = _model_words("a Llama", first.get("model_config")) if first.get("model_config") else "a small Llama"
    setting = ", ".join(p for p in (f"batch {first['global_batch']}" if first.get("global_batch") else "",
                                    f"seq {first['seq_len']}" if first.get("seq_len") else "") if p)
    arm = "fxpar's own pipeline module" if first.get("even_blocks") else "an even pipeline"
    out = ["", f"Measured heterogeneous pipeline against {arm} with equal blocks per stage ('fxpar even': "
           f"the same 1F1B schedule), on {shape}{', ' + setting if setting else ''}, over "
           f"{len(first['speeds'])} gloo ranks (`python -m benchmarks.pp_emulated`):", "", table(pp)]
    empty = [r for r in runs if 0 in r["fxpar_blocks"]]
    if empty:
        last = all(r["fxpar_blocks"][-1] == 0 for r in empty)
        what = "only the final norm and head" if last else "no blocks"
        out += ["", f"Where the planner gives the slow stage {what} "
                f"({_join(['/'.join(map(str, r['fxpar_blocks'])) for r in empty])} blocks), the two-stage "
                "'ideal' does not bound the speedup."]
    return out + _fairness(pp)


def _mix(s: dict) -> str:
    """``1 V100-SXM2-16GB : 3 P100-PCIE-16GB``: the device mix in lowest terms."""
    counts = s.get("devices")
    if not counts or len(counts) < 2:
        return ""
    g = reduce(math.gcd, counts.values())
    return " : ".join(f"{n // g} {t}" for t, n in counts.items())


def _plan(plan: dict) -> list[str]:
    from benchmarks.plan_scenarios import GOAL_VS_BEST_EVEN

    planned = [s for s in plan["scenarios"] if s["status"] == "planned"]
    goal = (plan.get("goals") or {}).get("vs_best_even", GOAL_VS_BEST_EVEN)
    for s in planned:
        if s.get("vs_best_even") is None:  # older results: from the stored baselines
            evens = [v for k, v in s["baselines"].items() if k in ("even_dp", "even_fsdp", "megatron_even", "even_ep") and v]
            s["vs_best_even"] = min(evens) / s["predicted_step_s"] if evens else None
    out = ["", "Predicted step time for every scenario in `../shared/scenarios` under fxpar's cost model. Every "
           "baseline is predicted by the same model and simulator (`python -m benchmarks.plan_scenarios`). "
           "`x LB` is the step over the lower bound (`fxpar/solvers/bounds.py`: the least, over the families "
           "that can run a plan, of the model's work spread over the device kinds at their own speeds, the "
           "communication none of the family's plans can hide and the optimizer; no plan fxpar could run is "
           "faster). Every baseline was a candidate, so fxpar is never slower than one. 'vs best even' compares against the best "
           "of what a user would otherwise run at an even split: DDP ('even DP'), FSDP2 ('even FSDP', every state sharded), the best even "
           "Megatron-style plan, and even expert parallelism for MoE models. 'plan s' includes tracing on the meta device.", "", table(plan)]
    ceiling_note = ("`ceiling` is Σ P_i / (n · min P_i) over the devices' peak FLOP/s: the most any plan can gain "
                    "over an even plan that is compute-bound at the slowest device's pace")
    beyond = [s for s in planned if s.get("heterogeneity_ceiling") and s["vs_best_even"]
              and s["vs_best_even"] > s["heterogeneity_ceiling"]]
    if beyond:
        why = []
        for s in beyond:
            mem = s.get("device_memory_gib")
            cards = f" on its {min(mem.values()):g} GiB cards" if mem else ""
            fits = s["baselines"].get("even_dp") is None
            why.append(f"{s['scenario']} beats it{': even data parallelism does not fit' + cards if fits else ''}"
                       f"{', so its even plans are bound by memory, not by compute' if fits else ''}")
        ceiling_note += " (" + "; ".join(why) + ")"
    out += ["", ceiling_note + "."]
    missed = [s for s in planned if s["vs_best_even"] is not None and (s.get("heterogeneity_ceiling") or 1) > 1
              and s["vs_best_even"] < goal]
    if missed:
        out += ["", "Goals not met yet:"]
        for s in missed:
            line = (f"- {s['scenario']}: {_x(s['vs_best_even'])} over the best even plan, under the "
                    f"{goal:g}x goal; its ceiling is {_x(s['heterogeneity_ceiling'])}")
            line += f" ({_mix(s)})" if _mix(s) else ""
            if s.get("predicted_comm_s") is not None and s["predicted_step_s"] > 0:
                line += f"; {s['predicted_comm_s'] / s['predicted_step_s']:.0%} of its predicted step is communication"
                if s.get("inter_node_gbps") and s.get("nodes", 2) > 1:
                    line += f" over {s['inter_node_gbps']:g} Gb/s between machines"
                if s.get("form", s.get("strategy")) == "data_parallel" and s.get("gradient_bytes"):   # "strategy": results before 2026-12-05
                    line += f" ({s['gradient_bytes'] / 1e6:.0f} MB of gradients all-reduced per step)"
            out.append(line + ".")
    far = sorted((s for s in planned if s.get("lower_bound_s")), key=lambda s: -s["predicted_step_s"] / s["lower_bound_s"])
    if far:
        items = []
        for s in far[:2]:
            link = f", {s['inter_node_gbps']:g} Gb/s between machines" if s.get("inter_node_gbps") and s.get("nodes", 2) > 1 else ""
            items.append(f"{s['scenario']} ({_x(s['predicted_step_s'] / s['lower_bound_s'])} LB{link})")
        out += ([""] if not missed else []) + [
            f"{'- ' if missed else ''}Furthest above the lower bound (its communication term is the least every "
            "applicable family exposes: where pipelines apply, one hop, so pipeline bubbles and the links a "
            "placement crosses stay outside it): "
            f"{_join(items)}."]
    return out


def _fidelity(fid: dict, folder: Path = RESULTS) -> list[str]:
    runs = fid["runs"]
    errs = [r["step_error"] for r in runs]
    ranks = fid.get("profile_ranks")
    out = ["", "Cost-model fidelity on real runs here (`python -m benchmarks.fidelity`). Each model's ops and the "
           f"gloo collectives were profiled on {f'{ranks} ' if ranks else ''}concurrent ranks, and the profiles are "
           "kept beside the JSON. The "
           "plan used those profiles, then fxpar trained with emulated speeds. The table gives predicted against "
           "measured step time (median of rank 0) and peak memory (resident set, measured after the model is "
           "built):", "", table(fid), ""]
    text = [f"Mean |step error| is {100 * sum(errs) / len(errs):.1f}% (range {100 * min(errs):.1f}–"
            f"{100 * max(errs):.1f}%)."]
    over = sum(r["predicted_step_s"] > r["measured_step_s"] for r in runs)
    if 0 < over < len(runs):
        text.append(f"The errors go both ways ({over} of {len(runs)} runs predicted slower than measured).")
    spread = [(hi - lo) / 2 / r["measured_step_s"] for r in runs for lo, hi in [r["measured_min_max_s"]]]
    text.append(f"Within a configuration the timed steps spread by up to ±{100 * max(spread):.0f}% around "
                "their median (min and max in the JSON).")
    across = _across_runs_fidelity(folder)
    if across is not None:
        text.append(f"The same configuration measured up to {100 * across:.0f}% apart across the stored runs.")
    under = [r for r in runs if all(p < m for p, m in zip(r["predicted_memory_bytes"], r["measured_memory_bytes"]))]
    if under:
        worst = max(max(r["memory_error"]) for r in under)
        mem = (f"Peak memory is under-predicted in {len(under)} of {len(runs)} runs (by up to "
               f"{100 * worst:.0f}%)")
        acts = fid.get("activations") or []
        if acts:
            signed = [f"{100 * a['error']:+.0f}%".replace("-", "−") + f" for {a['model']}" for a in acts]
            mem += (": the saved-activation estimate is " + _join(signed)
                    + " against autograd's own saved tensors, and the allocator's retention is not modelled.")
        else:
            mem += "; the allocator's retention is not modelled."
        text.append(mem)
    return out + [" ".join(text)]


def _across_runs_fidelity(folder: Path) -> float | None:
    """The widest relative gap between stored runs of one configuration (model, speeds)."""
    seen: dict[tuple, list[float]] = {}
    for path in _files("fidelity", folder, quick=None):
        for r in json.loads(path.read_text()).get("runs", []):
            seen.setdefault((r["model"], tuple(r["speeds"])), []).append(r["measured_step_s"])
    gaps = [(max(v) - min(v)) / statistics.mean(v) for v in seen.values() if len(v) > 1]
    return max(gaps) if gaps else None


def _rebalance(reb: dict) -> list[str]:
    events = reb.get("events") or []
    ranks = len(events[0]["shares"]) if events else None
    if reb.get("planned_speeds"):
        what = (f"a {len(reb['planned_speeds'])}-rank job planned for speeds ({', '.join(map(str, reb['planned_speeds']))}); "
                f"rank {reb['slow_rank']}'s emulated speed drops to {reb['slow_speed']:g} at step {reb['slow_at']}")
    else:
        what = f"a {ranks}-rank job; one rank's emulated speed drops mid-run" if ranks else "one rank's emulated speed drops mid-run"
    after = ""
    if reb.get("rebalance_step") is not None:
        after = f" It re-balanced at step {reb['rebalance_step']}"
        if reb.get("recovery") is not None:
            after += f", recovering {reb['recovery']:.0%} of the way to the step planned for the slowed speeds"
        after += "."
    return ["", f"Online re-balancing under the HF Trainer (`python -m benchmarks.rebalance`): {what}, and "
            "`FxparCallback` re-solves the shares from the measured step times:", "", table(reb)] + (
        ["", after.strip()] if after else [])


def section(folder: Path = RESULTS, quick: bool = False) -> str:
    """The results section from the newest full (or ``quick``) result of each suite in ``folder``;
    its first paragraph dates each suite's run it shows (the tables come from runs of many days)."""
    dates: dict[str, str] = {}

    def latest(name: str, where: Path, q: bool) -> dict | None:
        data = _latest(name, where, q)
        if data is not None:
            dates[name] = str(data.get("machine", {}).get("date", "?"))
        return data

    dp, pp, plan = (latest(n, folder, quick) for n in ("dp_emulated", "pp_emulated", "plan_scenarios"))
    fid, scal = latest("fidelity", folder, quick), latest("planner_scaling", folder, quick)
    reb, ep_tp = latest("rebalance", folder, quick), latest("ep_tp_emulated", folder, quick)
    info = (dp or plan or {}).get("machine", {})
    parts = [f"The tables below are generated by `python -m benchmarks.readme` from `benchmarks/results/*.json`. "
             f"The `{'dp_emulated' if dp else 'plan_scenarios'}` run was measured on {info.get('date', '?')} on a {info.get('cores', '?')}-core CPU "
             f"machine (GPU: {info.get('gpu') or 'none'}) with torch {info.get('torch', '?')} and gloo over 127.0.0.1; "
             "each suite's newest stored run is shown, of the dates listed at the end of this paragraph. "
             "The full run is `python -m benchmarks`; the quick report is in `benchmarks/results/report-quick-*.md`. "
             "**Heterogeneity is emulated**: a rank of speed s sleeps (1/s − 1) × each compute segment before its "
             "next collective, in fxpar and in the baselines alike."]
    if dp:
        parts += _dp(dp, info.get("cores"), folder)
    if pp:
        parts += _pp(pp)
    if plan:
        parts += _plan(plan)
    if scal:
        parts += ["", "Planner solve time, tracing excluded (`python -m benchmarks.planner_scaling`):", "",
                  table(scal), "", f"![planner scaling](../benchmarks/results/{Path(scal['plot']).name})"]
    if fid:
        parts += _fidelity(fid, folder)
    if ep_tp:
        parts += ["", "Uneven expert and tensor parallelism against their even forms ('fxpar even') and DDP, "
                  "measured the same way (`python -m benchmarks.ep_tp_emulated`):", "", table(ep_tp)] + _fairness(ep_tp)
    mem, sh = latest("memory_fidelity", folder, False), latest("sharded_emulated", folder, False)
    if mem:
        parts += readme_sections.memory(mem)
    if sh:
        parts += readme_sections.sharded(sh)
    if reb:
        parts += _rebalance(reb)
    real, coll = latest("real_gpu", folder, False), latest("collective_audit", folder, False)
    if real:
        parts += ["", "Predictions against real measured GPU runs (`python -m benchmarks.real_gpu`, the runs and their "
                  "provenance in `../shared/validation/`; 'LOO' refits every calibrated constant without the run; "
                  "Sailor is the best published estimator on the same runs):", "", table(real)]
    catalog = latest("real_gpu_catalog", folder, False)
    if catalog:
        parts += ["", "The same runs predicted with the catalog's stored constants, nothing fitted "
                  "(`python -m benchmarks.real_gpu --constants catalog`; 'priced by' names each kind's calibration):",
                  "", table(catalog)]
    if coll:
        parts += ["", "Collectives each plan kind issues per training step, recorded by the collective audit "
                  "(`python -m benchmarks.collective_audit`; tiny models, two micro-batches where the plan has them; "
                  "'NCCL-valid': device tensors, no object collective in a step, equal sizes where NCCL needs "
                  "them, one order per group):", "", table(coll)]
    zoo = latest("zoo", folder, False)
    if zoo:
        parts += readme_sections.zoo(zoo)
    recorded = latest("recorded_fidelity", folder, False)
    if recorded:
        parts += readme_sections.recorded_fidelity(recorded)
    adapting = latest("adapt", folder, False)
    if adapting:
        parts += readme_sections.adapt(adapting)
    switches = latest("adapt_switches", folder, False)
    if switches:
        parts += readme_sections.adapt_switches(switches)
    parity = latest("torch_parity", folder, False)
    if parity:
        parts += readme_sections.torch_parity(parity)
    regret = latest("plan_regret", folder, False)
    if regret:
        parts += readme_sections.plan_regret(regret)
    parts += readme_sections.gpu_checks([json.loads(p.read_text()) for p in _files("gpu_check", folder, None)])
    parts[0] += " Runs shown: " + "; ".join(f"`{name}` {day}" for name, day in sorted(dates.items())) + "."
    return "\n".join(parts)


def headline(folder: Path = RESULTS) -> str:
    """The README's one results table: the newest full data-parallel run, fxpar against torch DDP
    and FSDP2 at emulated speeds (empty without one)."""
    dp = _latest("dp_emulated", folder, False)
    if dp is None:
        return ""
    m = dp["machine"]
    return "\n".join([f"Training step of {_models(dp['runs'])}: fxpar's uneven plan against torch DDP and torch "
                      f"FSDP2 at their even split, gloo ranks on a {m['cores']}-core CPU machine, torch {m['torch']}, "
                      f"{m['date']} (`python -m benchmarks.dp_emulated`). **The speeds are emulated**: a rank of speed s "
                      "sleeps (1/s − 1) times each compute segment, in every arm alike; 'ideal' is the speedup of a "
                      "perfect split over the even one, and the last column the largest gradient difference from "
                      "one process:", "", table(dp), "", " ".join(_dp_caveats(dp["runs"], m["cores"], folder))])


def between(path: Path, begin: str, end: str) -> tuple[str, str, str]:
    """``path``'s text before the marker ``begin``, the generated body between the markers (its
    framing newlines dropped), and the text after ``end``."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} markers")
    head, rest = text.split(begin, 1)
    body, tail = rest.split(end, 1)
    return head, body.removeprefix("\n").removesuffix("\n"), tail


def _splice(path: Path, begin: str, end: str, body: str) -> None:
    """Replace what lies between the markers ``begin`` and ``end`` of ``path`` by ``body``."""
    head, _, tail = between(path, begin, end)
    path.write_text(head + begin + "\n" + body + "\n" + end + tail)
    print(f"updated {path}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the section instead of writing docs/results.md")
    ap.add_argument("--results", type=Path, default=RESULTS, help="read the results from this folder")
    ap.add_argument("--quick", action="store_true", help="use the quick runs (with --print: a preview)")
    args = ap.parse_args(argv)
    if args.print:
        print(section(args.results, args.quick))
        return
    _splice(PAGE, BEGIN, END, section(args.results, args.quick))
    _splice(README, HEAD_BEGIN, HEAD_END, headline(args.results))


if __name__ == "__main__":
    main()
