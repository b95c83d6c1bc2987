"""Results-page sections of the newer suites (sharded DP under memory caps, tensor-memory fidelity, the
HF zoo): each a pure function of one stored result (``benchmarks/results/*.json``) that returns
Markdown lines; :mod:`benchmarks.readme` puts them in the results section.  Every figure is read
or computed from the JSON, none typed.
"""

from __future__ import annotations

from typing import Any

from benchmarks.gpu_check_report import HEAD, arm_row

MIB = 2 ** 20


def table(data: dict) -> str:
    """A stored result's table as Markdown."""
    head, rows = data["table"]["head"], data["table"]["rows"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def _unseen(measured: dict[str, Any]) -> list[str]:
    """Per arm and rank, the bytes the profiler never saw freed in the reported window (frees made
    on gloo's worker thread), where any."""
    out = []
    for arm, ranks in measured.items():
        for r, res in enumerate(ranks or []):
            windows, left = res.get("peak_bytes_per_window"), res.get("unseen_free_bytes")
            if not windows or not left:
                continue
            k = windows.index(min(windows))
            if left[k] > 0:
                out.append(f"{arm} rank {r} {left[k] / MIB:.1f} MiB")
    return out


def _windows(sh: dict) -> int:
    return max((len(r.get("peak_bytes_per_window") or []) for ranks in sh.get("measured", {}).values()
                for r in ranks or []), default=0)


def sharded(sh: dict) -> list[str]:
    """Uneven sharded DP vs torch FSDP2, even_fsdp and the best other plan under memory caps."""
    figs = sh.get("figures", {})
    mine = figs.get("fxpar sharded", {})
    lines = ["", "Uneven sharded data parallelism under emulated per-rank memory caps (`python -m "
             f"benchmarks.sharded_emulated`): {sh['model']}, batch {sh['global_batch']}, seq {sh['seq_len']}, fp32 "
             f"AdamW, emulated speeds {'/'.join(f'{s:g}' for s in sh['speeds'])} and caps "
             f"{' / '.join(f'{c:g}' for c in sh['caps_gib'])} GiB; an arm is out of memory when a rank's measured "
             "tensor peak exceeds its cap. fxpar's sharded plan comes from its planner; torch FSDP2 runs "
             "`fully_shard` per block with even shards and batch, emulated like every arm:", "", table(sh)]
    words = []
    for other, key in (("torch FSDP2", "vs_fsdp2"), ("fxpar's best other plan", "vs_best_other")):
        if mine.get(key) is not None:
            words.append(f"{mine[key]:.2f}x faster than {other}")
    even = figs.get("fxpar even_fsdp", {}).get("median_step_s")
    if mine.get("median_step_s") and even:
        words.append(f"{even / mine['median_step_s']:.2f}x faster than fxpar's even_fsdp")
    fsdp_verdict = figs.get("torch FSDP2", {}).get("verdict", "")
    if words:
        lines += ["", f"fxpar's sharded plan ({mine.get('verdict', '?')}) ran {', '.join(words)} (torch FSDP2: "
                  f"{fsdp_verdict}). The tensor peak is the least of {_windows(sh)} untimed one-step "
                  "profiler windows per rank; a window over-states by the frees gloo's worker thread made"
                  + (f" ({', '.join(_unseen(sh.get('measured', {})))} never seen freed)" if _unseen(sh.get("measured", {}))
                     else "") + "."]
    return lines


def memory(mem: dict) -> list[str]:
    """Predicted vs measured peak live tensor bytes per rank."""
    rows = mem["table"]["rows"]
    errors = [float(r[6].rstrip("%")) for r in rows if isinstance(r[6], str) and r[6].endswith("%")]
    lines = ["", "Peak memory per rank, predicted by fxpar's step-peak formula against the live tensor peak "
             "measured from the CPU allocator's events (`python -m benchmarks.memory_fidelity`; AdamW state "
             "included, the higher of the steady-state steps measured):", "", table(mem)]
    if errors:
        lines += ["", f"Every row is within {min(errors):+.1f}%..{max(errors):+.1f}% of the measurement "
                  f"({len(errors)} rank-rows)."]
    return lines


def zoo(z: dict) -> list[str]:
    """Coverage of the transformers causal-LM zoo, per column."""
    s = z["summary"]
    cov = s["coverage"]
    cells = [f"{c} {v['ok']}/{v['of']}" + (f" ({v['ok'] / v['of']:.1%})" if v["of"] else "")
             for c, v in cov.items() if v["run"]]
    kinds = ", ".join(f"{k} {n}" for k, n in s.get("architectures", {}).items())
    lines = ["", f"HF causal-LM zoo (`python -m benchmarks.zoo`, transformers {z['transformers']}): "
             f"{s['types']} model types, {s['skipped']} skipped (their tiny model does not train a step in plain "
             f"PyTorch), {s['tried']} tried ({kinds}). Covered: {', '.join(cells)}; `tp_decoder_only` counts the "
             "decoder-only types. Per-type rows and every failure's reason are in the JSON."]
    if s.get("recorded"):
        lines[-1] += (f" Recorded by running them, since they do not export as a whole: {len(s['recorded'])} "
                      f"({', '.join(s['recorded'])}); their plans are data parallel, sharded, or pipelines of eager "
                      "stages, tensor-parallel in the blocks read block by block.")
    top = s.get("top_failures", {})
    for col, items in top.items():
        if items:
            lines.append(f"- {col}: " + "; ".join(f"{reason} ({n})" for reason, n in items[:4]))
    return lines


def gpu_checks(results: list[dict]) -> list[str]:
    """The arms of the stored GPU checks that ran on CUDA (``python -m benchmarks.gpu_check``):
    one Markdown table, each run's machine and stack named above it, skipped arms left out."""
    runs = [r for r in results if r.get("device") == "cuda"]
    if not runs:
        return []
    out = ["", "One GPU, measured by `python -m benchmarks.gpu_check` (each arm in a fresh process from the same "
           "initial weights; 'x plain': against the plain HF loop of the same model, dtype and batch; 'pred': "
           "the plan's prediction under its own cost source, the catalog roofline for hand-written ZeRO plans "
           "and, in the later runs, a calibration of the GPU for `fxpar.auto`'s; gaps as a fraction of the "
           "tolerance from the precision's unit roundoff):"]
    rows: list[list[str]] = []
    for r in runs:
        m, p = r.get("machine", {}), r.get("packages", {})
        measured = [name for name, arm in r["arms"].items() if "step_s" in arm]
        out.append(f"- {m.get('gpu', '?')}, {m.get('date', '?')}, {m.get('cores', '?')} CPU cores: torch "
                   f"{m.get('torch', '?')}, transformers {p.get('transformers', {}).get('version', '?')}; "
                   f"{len(measured)} arms measured ({', '.join(sorted({n.split('/')[1] for n in measured}))})"
                   + (f"; {r['note']}" if r.get("note") else ""))
        rows += [row for name, arm in r["arms"].items() if "step_s" in arm
                 for row in [arm_row(name, arm, r["comparisons"].get(name, {}))]]
    out += ["", "| " + " | ".join(HEAD) + " |", "|" + "|".join("---" for _ in HEAD) + "|"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]



def recorded_fidelity(r: dict) -> list[str]:
    """How far a recorded graph's prediction is from the exported graph's (models that export)."""
    s = r["summary"]
    c = r["cluster"]["nodes"]
    where = " + ".join(f"{n['count']}x {n['gpu']}" for n in c)
    dtypes = " and ".join(h.split()[1] for h in r["table"]["head"] if h.startswith("step "))
    return ["", f"Recorded vs exported graph (`python -m benchmarks.recorded_fidelity`, transformers "
            f"{r['transformers']}, {r['machine']['date']}): {s['types']} causal-LM types that export, widened "
            f"tiny configs at sequence {r['seq_len']}, traced both ways; the data-parallel plan made from the "
            f"export ({where}, global batch {r['global_batch']}, {dtypes}) priced under each graph. "
            f"FLOPs equal on {s['flops_equal']}/{s['types']}; the recorded step differs by "
            f"{s['mean_abs_step_error']:.1%} on average, {s['max_abs_step_error']:.1%} at most.", "",
            table(r)]


#: where the adapt benchmark's decisions were solved (its ``background_planning``; files before
#: 2026-11-30 lack the field: a thread then; "process" was a child forked per decision until the
#: planning process replaced it)
_PLANNED_IN = {"planning_process": "in the job's planning process (a child interpreter rank 0 started once)",
               "process": "in a process forked from rank 0", "thread": "on a thread of rank 0"}


def _shared_cores_floor(a: dict) -> str:
    """The detector's floor where a row's ranks (one thread each) fill the host's cores
    (:func:`fxpar.runtime.device.ranks_share_cores`), or "" where the result predates it."""
    floor, cores = a.get("detector", {}).get("shared_cores_threshold"), a["machine"].get("cores")
    shared = sorted({r["ranks"] for r in a["runs"] if cores and r["ranks"] >= cores})
    if floor is None or not shared or floor <= a["detector"]["threshold"]:
        return ""
    return f", at least {floor} on the {' and '.join(map(str, shared))}-rank rows, whose ranks fill the {cores} cores"


def adapt(a: dict) -> list[str]:
    """Adapting while training under a straggler, and the elastic 4 -> 3 node loss."""
    m, d = a["machine"], a.get("detector", {})
    lines = ["", f"Adapting while training (`python -m benchmarks.adapt`, {m['date']}, EMULATED speeds): "
             f"the straggler slows to {a['slow_speed']} from step {a['phases'][0]} to "
             f"{a['phases'][1]} of {a['phases'][2]}; 'keep' runs the first plan throughout, 'DP rebalance' re-plans "
             "data-parallel shares only, 'adapt' every family, 'fresh plan' is made for the slowed speeds from the "
             "start; milliseconds are the slowest rank's mean step (optimizer included; the step that switches "
             "carries the migration) while the straggler lasts (detector: threshold "
             f"{d.get('threshold')}{_shared_cores_floor(a)}, a change lasting {d.get('min_steps')} steps and {d.get('min_seconds', 0)} s, "
             f"{d.get('warmup_steps', 0)} warm-up and {d.get('calibration_steps')} reference steps per plan); "
             f"'replan s' is rank 0's solve, run {_PLANNED_IN[a.get('background_planning', 'thread')]} while the "
             "ranks train on, and 'plan' in the migration's split the time the ranks then waited for the decision."
             + (" 'prepared': where each switch's new module was built, 'bg' on a thread while the old plan "
                "trained (its build time and the steps it overlapped), and in brackets the steps lost by the same "
                "arm with its module built at the switch." if any("adapt_at_switch" in r for r in a["runs"]) else "")
             + (_overhead_line(a["overhead"]) if a.get("overhead") else ""), "", table(a)]
    for what, e in (a.get("elastic") or {}).items():
        if "error" in e:
            lines += ["", f"A node {what} under elastic torchrun: not measured in this run ({e['error'][:200]})."]
            continue
        lines += ["", f"A node {what} under elastic torchrun (`benchmarks/elastic.py`, worlds {e['worlds']}): the "
                  f"{e['worlds'][-1]}-rank job resumed at step {e['resumed_step']} from a background checkpoint "
                  f"after the old job finished {e['steps_done_before_change']} steps ({e['steps_lost']} lost), its "
                  f"first step {e['resume_s']:.1f} s after the change (checkpoint load {e['load_s']:.2f} s; a step "
                  f"took {e['step_s']:.2f} s including the example's delay)."]
    return lines



def adapt_switches(s: dict) -> list[str]:
    """Adapting's switches end to end: the parity table, the capped move, leaks, noise-only runs."""
    m, move, leaks, quiet = s["machine"], s["capped_move"], s["leaks"], s["noise"]
    capped = [x for x in move if x["move"] == "capped"]
    lines = ["", f"Adapting's switches end to end (`python -m benchmarks.adapt_switches`, {m['date']}, gloo ranks): "
             "each chain starts under uneven data parallelism and switches through `pm.switch_to` (the path a "
             "decision takes), the 'decider' rows through decisions of their own under emulated speeds that change "
             "three times; losses are the worst step's relative gap to one process on the same batches, weights "
             "the gap after the last step (bf16/fp16 chains against one process under the host's autocast):",
             "", table(s)]
    rounds = sorted({x["rounds"] for x in capped})
    lines += ["", f"A capped move (PP -> ZeRO-3) ran in {' or '.join(map(str, rounds))} rounds; its predicted peak "
              f"over the measured one was {min(x['ratio'] for x in move):.3f}-{max(x['ratio'] for x in move):.3f} "
              f"({'within' if all(x['within'] for x in move) else 'NOT within'} measured <= predicted <= "
              f"{s['peak_bound']} x measured). Alternating a pipeline and ZeRO-3 for {len(leaks[0]['groups'])} "
              "switches, each rank's live process groups and live tensor bytes after the second switch and after "
              "the last were "
              + "; ".join(f"rank {r['rank']}: {r['groups'][1]} and {r['groups'][-1]} groups, "
                          f"{r['bytes'][1] / 2**20:.3f} and {r['bytes'][-1] / 2**20:.3f} MiB" for r in leaks)
              + ". Where nothing changed, "
              + " and ".join(f"{q['ranks']} ranks switched {q['switches']} times in {q['steps']} steps" for q in quiet)
              + "."]
    return lines


def torch_parity(tp: dict) -> list[str]:
    """fxpar's runtime against DDP, FSDP2, torch's TP and torch's pipelining on the same model,
    batch and split."""
    m, s = tp["machine"], tp.get("settings", {})
    runs = tp.get("runs", [])
    worst_bytes = max((r["bytes_ratio"] for r in runs if r.get("bytes_ratio")), default=None)
    reads = sum(r["host_reads"] or 0 for r in runs)
    lines = ["", f"fxpar's runtime card for card with torch's own (`python -m benchmarks --suite torch_parity`, "
             f"{m['date']}, torch {m['torch']}, {m['cores']} CPU cores, gloo ranks of one thread each at equal "
             f"speeds, nothing emulated): the same model ({s.get('model', {}).get('num_hidden_layers', '?')} Llama "
             f"blocks, hidden {s.get('model', {}).get('hidden_size', '?')}), the same {s.get('batch', '?')}x"
             f"{s.get('seq', '?')} batch and split, {s.get('rounds', '?')} rounds of {s.get('steps', '?')} timed "
             "steps (AdamW included), each arm in fresh processes, the arms' order alternating. Bytes sent per rank "
             "come from torch's profiler's gloo events (one formula per collective kind, "
             "`fxpar/profiling/wire_bytes.py`; the most any rank sends); host reads, syncs and ops from "
             "`fxpar/runtime/step_audit.py` (extra ops: the arm's minus the plain model's on the same rows; for the "
             "pipeline pair, fxpar's minus torch's over both ranks, as a stage runs half the model on every "
             "micro-batch); the step ratio is fxpar's median over "
             "torch's in the same round, with its range over the rounds; peaks are live tensor bytes "
             "(`TensorPeak`). 'cast all' is fxpar's dtype policy with FSDP2's rule (every parameter gathered in "
             "the low precision), the default 'autocast' rule gathering only what autocast casts (exact against "
             "one process under autocast; embeddings, norms and the residual stream stay fp32)."]
    if worst_bytes is not None:
        lines[-1] += (f" Largest bytes ratio {worst_bytes:.3f}; fxpar host reads in all audited steps: {reads}.")
    return lines + ["", table(tp)]


def plan_regret(pr: dict) -> list[str]:
    """The planner's pick against every family, timed (issue #37's plan-regret table)."""
    m, summary = pr["machine"], pr.get("summary", {})
    ranks = len(pr["results"][0]["case"]["speeds"]) if pr.get("results") else "?"

    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.0f}%"

    def ratio(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    model_timed = "model_calibration" in (pr.get("results") or [{}])[0]
    pricing = ("this machine's calibration corrected on each case's model, its forward + backward and AdamW step "
               f"timed on {ranks} ranks at once before any arm (`fxpar.calibrate.on_model`), 'machine error' with the "
               "machine's calibration alone and 'catalog error' with neither" if model_timed else
               "this machine's calibration and, for comparison, by the catalog alone ('catalog error')")
    lines = ["", f"Is the planner's pick the fastest plan when every family is timed? (`python -m benchmarks --suite "
             f"plan_regret`, {m['date']}, torch {m['torch']}, {m['cores']} CPU cores; {ranks} gloo ranks of one thread, "
             f"**emulated** speeds; {pr.get('rounds', '?')} rounds of {pr.get('steps', '?')} timed steps, AdamW in every "
             "step, fresh ranks per round, the arm order reversed every other round.) Every arm is priced before "
             f"any timing, with {pricing} (calibration: {pr.get('calibration', {}).get('calibration', '?')}); "
             "`choice_machine` and `choice_catalog` are the planner's picks under those. Regret is the choice's "
             "measured step over the fastest arm's, none when within the measured spread. Max regret of the "
             f"choice: {ratio(summary.get('max_regret'))} (machine's pick: {ratio(summary.get('max_regret_machine'))}, "
             f"catalog pick: {ratio(summary.get('max_regret_catalog'))}; without the spread allowance: "
             f"{ratio(max((r.get('raw_ratio_choice') or 0.0 for r in pr.get('results', [])), default=None))}); "
             f"mean |prediction error| {pct(summary.get('mean_abs_prediction_error'))} (machine "
             f"{pct(summary.get('mean_abs_prediction_error_machine'))}, catalog "
             f"{pct(summary.get('mean_abs_prediction_error_catalog'))})."]
    if summary.get("mean_abs_busy_error") is not None:
        lines[-1] += (" 'busy error' compares the slowest rank's compute alone (the runtime clock's busy seconds, "
                      "without its collectives or the optimizer step; a tensor-parallel price counts its blocking "
                      f"collectives in it): mean |busy error| {pct(summary['mean_abs_busy_error'])}.")
    return lines + ["", table(pr)]


def _own_words(o: dict[str, Any]) -> str:
    """Adapting's own seconds per step, timed from outside it, where the JSON has them (from
    2026-12-04 on)."""
    if "own_s" not in o:
        return ""
    o1, o3 = o["own_quartiles"]
    return (f"; adapting's own code, timed around it in the same blocks: {1e6 * o['own_s']:.0f} us per step, "
            f"(off + own) / off {o['own_ratio']:.4f} (quartiles {o1:.4f}-{o3:.4f}), of which its records' "
            f"gathers (collectives: waiting for the other rank included) leave {1e6 * o['code_s']:.0f} us, "
            f"{o['code_ratio']:.4f}")


def _overhead_line(o: dict[str, Any]) -> str:
    """The adapt benchmark's overhead at equal speeds, as its JSON stored it (paired blocks from
    2026-12-01 on; alternating rounds before)."""
    if "pairs" in o:
        q1, q3 = o["pair_quartiles"]
        return (f" At equal speeds, adapting on / off (data parallelism, {o['pairs']} pairs of {o['block_steps']}-step "
                f"blocks alternating in the same processes): {o['ratio']:.3f} (quartiles {q1:.3f}-{q3:.3f}; "
                f"{1e3 * o['on_s']:.2f} / {1e3 * o['off_s']:.2f} ms)" + _own_words(o) + ".")
    return (f" At equal speeds, adapting on / off (data parallelism, {len(o['rounds']['on'])} alternating rounds): "
            f"{o['ratio']:.3f} ({1e3 * o['on_s']:.2f} / {1e3 * o['off_s']:.2f} ms).")
