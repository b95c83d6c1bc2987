"""The ``fxpar`` command line: ``fxpar plan``, ``fxpar simulate`` (predict a given plan),
``fxpar profile``, ``fxpar calibrate`` (this machine's rates, links and overlap) and ``fxpar demo``.

Errors that the user can fix (bad files, flags, memory) print one clear message and exit 2;
a plan that does not fit exits 3.  Nothing is written when a command fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from fxpar import calibrate
from fxpar.cluster import Cluster
from fxpar.cluster.catalog import FRAMEWORK_CALIBRATION
from fxpar.codegen.emit import emit
from fxpar.demo import run_demo
from fxpar.errors import ConfigError, FxparError, InfeasibleError
from fxpar.forms import SEARCHED, form
from fxpar.models import resolve_model
from fxpar.plan import Plan
from fxpar.planning import plan_model, trace_spec
from fxpar.predict import predict
from fxpar.profile_cmd import maybe_init_process_group, profile_collectives, profile_ops
from fxpar.rank_layout import RankLayout
from fxpar.profiling import CostModel, local_cache
from fxpar.profiling.database import PROFILE_DIR_ENV, load_profiles, with_calibration
from fxpar.scenario import load_scenario
from fxpar.sim import simulate
from fxpar.renamed import warn_renamed
from fxpar.sim.plot import plot_timeline
from fxpar.tracing.hf import ModelSpec, build_model, example_inputs
from fxpar.workload import OPTIMIZERS, Workload

EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
#: --timeline formats (matplotlib's raster and vector writers)
TIMELINE_SUFFIXES: tuple[str, ...] = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif",
                                      ".tiff", ".webp")
MAX_SPEED = 1e3


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag prints one line (what was wrong and where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def _progress(message: str) -> None:
    print(f"[fxpar] {message}", file=sys.stderr, flush=True)


def _forms(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in SEARCHED]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(SEARCHED)}")
    return names


def _old_forms(text: str) -> tuple[str, ...]:
    """``--strategies``, ``--forms``'s old name (:mod:`fxpar.renamed`): a FutureWarning."""
    warn_renamed("--strategies", "--forms", "fxpar plan", stacklevel=2)
    return _forms(text)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _speed(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a relative speed such as 0.5, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_SPEED):
        raise argparse.ArgumentTypeError(f"expected a relative speed in (0, {MAX_SPEED:g}], got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxpar", description=(
        "Automatic parallelization for heterogeneous GPU clusters."))
    sub = parser.add_subparsers(dest="command", required=True)

    _add_plan(sub)
    _add_calibrate(sub)

    f = sub.add_parser("profile", help="measure per-op costs (or collectives) on this device")
    f.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    f.add_argument("--model", default="llama-tiny", help="preset or HF config.json to profile")
    f.add_argument("--batch", type=_positive, default=2,
                   help="profile at this batch (>= 2) and 4x it")
    f.add_argument("--seq", type=_positive, default=128)
    f.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    f.add_argument("--repeats", type=_positive, default=5)
    f.add_argument("--collectives", action="store_true",
                   help="measure collectives on the running process group (under torchrun)")
    f.add_argument("--out", type=Path, default=Path("profiles"), help="database directory")

    s = sub.add_parser("simulate", help="predict a given plan: step time, its parts, per-rank memory",
                       description="Predict a plan (from `fxpar plan --json`, a hand-written one, or one "
                                   "describing another framework's run) on a cluster: the simulator's step "
                                   "time, its parts and each rank's peak memory.")
    s.add_argument("--plan", type=Path, required=True, help="plan JSON")
    s.add_argument("--model", required=True, help="preset name, path to a HF config.json, or module:function")
    s.add_argument("--cluster", type=Path, required=True, help="cluster YAML/JSON")
    s.add_argument("--task", choices=("causal-lm", "masked-lm", "seq2seq-lm", "image-classification"))
    s.add_argument("--profiles", type=Path, help="directory of measured profiles (fxpar profile --out)")
    s.add_argument("--calibration", choices=sorted(FRAMEWORK_CALIBRATION),
                   help="constants calibrated for the framework the plan describes (default: fxpar's own)")
    s.add_argument("--json", nargs="?", const="-", dest="json_out", metavar="FILE",
                   help="the prediction as JSON: on stdout (no FILE), or written to FILE")

    d = sub.add_parser("demo", help="2-rank gloo training: fxpar vs torch DDP, emulated speeds")
    d.add_argument("--steps", type=_positive, default=5, help="measured steps per method (default 5)")
    d.add_argument("--speeds", type=_speed, nargs="+", default=[1.0, 0.5],
                   help="emulated relative speed per rank (default 1.0 0.5)")
    d.add_argument("--json", type=Path, dest="json_out", help="write the figures as JSON here")
    return parser


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="plan a model on a cluster (no weights are allocated)",
                       description="Plan a model on a cluster. Either --scenario FILE, or "
                                   "--cluster FILE with --model MODEL.")
    p.add_argument("--scenario", type=Path, help="scenario YAML/JSON (cluster + model + workload)")
    p.add_argument("--cluster", type=Path, help="cluster YAML/JSON (a scenario's cluster part)")
    p.add_argument("--model", help="preset name, path to a HF config.json, or module:function")
    p.add_argument("--task", choices=("causal-lm", "masked-lm", "seq2seq-lm", "image-classification"))
    p.add_argument("--batch", type=_positive, help="global batch (default: the scenario's, else 8)")
    p.add_argument("--seq", type=_positive, help="sequence length (default: the scenario's, else 512)")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), help="training precision")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer (state bytes, the step's traffic)")
    p.add_argument("--max-microbatches", type=_positive, help="cap on gradient-accumulation steps")
    p.add_argument("--json", type=Path, dest="json_out", help="write the plan as JSON here")
    p.add_argument("--profiles", type=Path, help="directory of measured profiles (fxpar profile "
                   "--out); default $FXPAR_PROFILE_DIR, else the roofline alone")
    p.add_argument("--timeline", type=Path, help="draw the predicted per-device timeline (PNG)")
    p.add_argument("--emit", type=Path, help="write what each rank runs (stage code, parameters) here")
    p.add_argument("--forms", type=_forms, default=SEARCHED, metavar="LIST",
                   help=f"comma-separated parallel forms to search (default: all of {','.join(SEARCHED)})")
    p.add_argument("--strategies", type=_old_forms, dest="forms", help=argparse.SUPPRESS)   # the old name (fxpar.renamed)
    p.add_argument("--explain", action="store_true",
                   help="print the candidates considered, the baselines and the solver's bound")
    p.add_argument("--calibrate", nargs="?", const="auto", default="off", metavar="FILE",
                   help="price CPU ranks with this machine's calibration (cached; measured first with "
                        "spawned gloo ranks when there is none), or with FILE from `fxpar calibrate --out`")


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="measure this machine's compute rates, optimizer, collectives and "
                                          "overlap (cached; fxpar.auto and fxpar plan --calibrate use it)",
                       description="Measure what the cost model assumes, on this machine: matrix-product and "
                                   "memory rates, the per-op launch cost, the optimizer step, each collective's "
                                   "alpha-beta on gloo ranks spawned here (one thread each) and whether "
                                   "communication overlaps compute.  Cached per machine, torch version, backend "
                                   "and world size.")
    c.add_argument("--world", type=_positive, default=2, help="gloo ranks to measure the collectives on (default 2)")
    c.add_argument("--force", action="store_true", help="measure again even when a calibration is cached")
    c.add_argument("--out", type=Path, help="also write the calibration (a profile database JSON) here")


def _cmd_plan(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    _check_outputs(args)
    if args.scenario is not None:
        if args.cluster is not None or args.model is not None:
            raise ConfigError("fxpar plan: give either --scenario, or --cluster with --model, not both")
        scenario = load_scenario(args.scenario)
        cluster, model, w = scenario.cluster, scenario.model, scenario.workload
        workload = Workload(global_batch=args.batch or w.global_batch, seq_len=args.seq or w.seq_len,
                            dtype=args.dtype or w.dtype, optimizer=args.optimizer or w.optimizer,
                            max_microbatches=args.max_microbatches or w.max_microbatches)
    else:
        if args.cluster is None or args.model is None:
            raise ConfigError("fxpar plan: needs --scenario FILE, or both --cluster FILE and --model MODEL")
        cluster = Cluster.from_file(args.cluster)
        model = resolve_model(args.model, args.task)
        workload = Workload(global_batch=args.batch or 8, seq_len=args.seq or 512,
                            dtype=args.dtype or "fp32", optimizer=args.optimizer or "adam",
                            max_microbatches=args.max_microbatches)
    _progress(f"cluster {cluster.name}: {cluster.world_size} devices; workload: batch "
              f"{workload.global_batch}, seq {workload.seq_len}, {workload.dtype}, {workload.optimizer}")

    profiles = _profiles(args.profiles, cluster, workload)
    calibration = calibrate.for_planning(cluster, args.calibrate, progress=_progress)
    if calibration is not None:
        _progress(calibration.calibration)
        profiles = with_calibration(profiles, calibration)
    plan = plan_model(model, cluster, workload, progress=_progress, profiles=profiles,
                      forms=args.forms)
    print(plan.table())
    if args.explain:
        print("\nwhy this plan:")
        for line in plan.explain:
            print(f"  {line}")
        print(f"  predicted / lower bound = {plan.predicted_step_s / plan.lower_bound_s:.3f}")
        print("\nwhere each rank sits:\n  " + "\n  ".join(RankLayout(plan).lines()))
        if plan.solver is not None:
            sv = plan.solver
            print(f"  share LP: {sv.backend} {sv.status}, objective {sv.objective_s:.4g} s, "
                  f"integer {sv.integer_s:.4g} s, gap {100 * sv.gap:.2f}%")
    if args.timeline is not None:
        _draw_timeline(plan, cluster, model, workload, profiles, args.timeline)
    if args.emit is not None:
        _emit(plan, model, workload, args.emit)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json_out.with_suffix(args.json_out.suffix + ".tmp")
        tmp.write_text(plan.to_json())
        tmp.replace(args.json_out)
        _progress(f"wrote {args.json_out}")
    _progress(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    key = calibrate.spawned_key(args.world)
    db = None if args.force else calibrate.load_cached(key)
    if db is not None:
        _progress(f"cached calibration {calibrate.cache_path(key)} (measure again with --force)")
    else:
        _progress(f"calibrating {key}")
        db = calibrate.calibrate_spawned(args.world, progress=_progress)
        where = calibrate.store(db, key)
        _progress(f"cached in {where}" if where else "the cache folder is not writable: not cached")
    print(calibrate.describe(db))
    if args.out is not None:
        _writable_file("--out", args.out)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(db.to_dict(), indent=1))
        tmp.replace(args.out)
        _progress(f"wrote {args.out}")
    _progress(f"done in {time.perf_counter() - start:.1f} s")
    return 0


def _profiles(directory: Path | None, cluster: Cluster, workload: Workload) -> dict:
    """The measured profiles to plan with: ``--profiles DIR`` or ``$FXPAR_PROFILE_DIR`` when
    given; else, on a machine with CUDA, the profile ``fxpar profile --device cuda`` cached for
    this GPU, torch version and dtype (:func:`fxpar.profiling.local_cache.lookup`); else none
    (the catalog roofline).  The plan names what it used (``Plan.cost_source``)."""
    if directory is not None or os.environ.get(PROFILE_DIR_ENV):
        return load_profiles(directory)
    import torch

    if not torch.cuda.is_available():
        return {}
    found = local_cache.lookup(cluster, workload.dtype)
    _progress(f"cost source: {found.description}")
    return dict(found.profiles or {})


def _writable_file(flag: str, path: Path) -> None:
    """``path`` can be written as a file: not a directory, parent creatable."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path, e.g. {path / 'plan.json'}")
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, so the folder cannot be created; "
                          "choose another path")


def _writable_dir(flag: str, path: Path) -> None:
    """``path`` can be (or already is) a directory."""
    for p in [path, *path.parents]:
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{flag} {path}: {p} is a file, not a directory; choose a folder path")
            return


def _check_outputs(args: argparse.Namespace) -> None:
    """Reject output paths that cannot be written before the (slow) planning starts."""
    if args.json_out is not None:
        _writable_file("--json", args.json_out)
    if args.timeline is not None:
        _writable_file("--timeline", args.timeline)
        if args.timeline.suffix.lower() not in TIMELINE_SUFFIXES:
            raise ConfigError(f"--timeline {args.timeline}: unsupported image type "
                              f"{args.timeline.suffix or '(none)'!r}; use one of {', '.join(TIMELINE_SUFFIXES)}")
    if args.emit is not None:
        _writable_dir("--emit", args.emit)


def _draw_timeline(plan, cluster, model, workload, profiles, path: Path) -> None:
    graph = trace_spec(model, workload, op_keys=bool(profiles))
    cost = CostModel(graph, cluster, dtype=workload.dtype, optimizer=workload.optimizer, profiles=profiles)
    result = simulate(plan, cost)
    labels = [f"{r.rank} {r.device}" + (f"@{r.speed:g}" if r.speed != 1 else "") for r in plan.ranks]
    plot_timeline(result, path, labels=labels, title=f"{plan.model} on {plan.cluster}: predicted "
                  f"step {result.step_s:.4g} s")
    _progress(f"wrote {path}")


def _emit(plan, model, workload, directory: Path) -> None:
    module = inputs = None
    if form(plan.form).emits_from_model:
        if not isinstance(model, ModelSpec):
            raise ConfigError(f"--emit of a {plan.form} plan needs a preset, config.json or scenario model")
        module = build_model(model, device="meta", dtype=workload.dtype)
        inputs = example_inputs(module, max(2, plan.ranks[0].micro_batch_size), workload.seq_len,
                                task=model.task, device="meta")
    written = emit(plan, module, inputs, directory)
    _progress(f"wrote {len(written)} files to {directory}")


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch.distributed as dist


    _writable_dir("--out", args.out)
    if args.collectives:
        profile_collectives(out=args.out, progress=_progress)
        return 0
    created = maybe_init_process_group(args.device)
    try:
        profile_ops(model=args.model, batch=args.batch, seq=args.seq, device=args.device,
                    out=args.out, repeats=args.repeats, dtype=args.dtype, progress=_progress)
    finally:
        if created:
            dist.destroy_process_group()
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.json_out not in (None, "-"):
        _writable_file("--json", Path(args.json_out))
    try:
        text = args.plan.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--plan {args.plan}: file not found; write one with `fxpar plan --json FILE`") from None
    plan = Plan.from_json(text, source=str(args.plan))
    cluster = Cluster.from_file(args.cluster)
    model = resolve_model(args.model, args.task)
    calibration = FRAMEWORK_CALIBRATION[args.calibration] if args.calibration else None
    prediction = predict(plan, model, cluster, profiles=load_profiles(args.profiles), calibration=calibration)
    if args.json_out == "-":
        print(json.dumps(prediction.to_dict(), indent=2))
        return 0
    print(prediction.table())
    if args.json_out is not None:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(prediction.to_dict(), indent=2))
        _progress(f"wrote {out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.json_out is not None:
        _writable_file("--json", args.json_out)
    figures = run_demo(steps=args.steps, speeds=tuple(args.speeds), progress=_progress)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(figures, indent=2))
        _progress(f"wrote {args.json_out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"plan": _cmd_plan, "demo": _cmd_demo, "profile": _cmd_profile, "calibrate": _cmd_calibrate,
                "simulate": _cmd_simulate}[args.command](args)
    except InfeasibleError as exc:
        print(f"fxpar: no plan fits: {exc}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except FxparError as exc:
        print(f"fxpar: error: {_one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a file that cannot be read or written: the user's to fix
        where = f" {exc.filename}" if exc.filename else ""
        print(f"fxpar: error:{where}: {exc.strerror or exc}; check the path and its permissions",
              file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("fxpar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
