"""One command on a GPU machine: ``python -m benchmarks.gpu_check [--budget-s 420] [--out FILE | --out-dir DIR]``.

Checks, in this order, each part in a fresh process (so one arm's memory cannot leak into the
next), within a wall-clock budget (``--budget-s``; ``--pytest-s`` of it kept for the test suite):

(a) ``fxpar.runtime.init_distributed`` of a one-rank group (NCCL; RANK=0, WORLD_SIZE=1, a free
    MASTER_PORT) and ``fxpar.Cluster.detect()``;
(b) for a TinyLlama-shaped 1.1B Llama and GPT-2 124M in bf16 (in fp32 after (c)), built on the
    host with one seed: the plain HF loop and every plan family one GPU runs — data parallel, ZeRO-2 and
    ZeRO-3 on one rank (hand-written plans: the planner offers sharded plans only from two ranks
    on), a one-stage pipeline, and that pipeline traced with and fed an all-ones
    ``attention_mask`` (a Trainer collator's batch: ``pipeline-mask``) — each compared with the plain loop (first-step loss, every
    parameter's gradient, step time, peak memory) and with its plan's predictions
    (:mod:`benchmarks.gpu_check_arms`, :mod:`benchmarks.gpu_check_report`);
(c) ``fxpar.from_pretrained`` of the Llama saved in bf16 as a sharded checkpoint, its first-step
    loss against a HF forward of the same weights; after the fp32 arms, time-boxed and only if time
    is left, ``fxpar profile`` of GPT-2 and the bf16 GPT-2 plans predicted with it;
(d) the suite's single-process tests, ``FXPAR_FULL=1 python -m pytest -v -m "gpu and not multirank"
    -n 8 -p no:cacheprovider -rfE --tb=short`` first, then ``-m "not multirank and not gpu"``
    (``--timeout`` where pytest-timeout is installed; ``tests/gpu/test_gpu_check.py``, this check's
    own CPU smoke run, left out), killed at the budget.

A part that does not fit in what is left of the budget is skipped, and the JSON says so.  The JSON
(default ``benchmarks/results/gpu_check.json``) is rewritten after every part, so a killed run
keeps what it measured; the children's output goes to ``gpu_check_children.log`` beside it and
the suite's to ``gpu_check_pytest_gpu.log`` and ``gpu_check_pytest.log``.  Without CUDA (or with ``--device cpu``) the same
parts run with tiny models on the CPU under gloo (``--tiny`` does so on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import machine
from benchmarks.gpu_check_report import LOSS_RTOL, compare, render
from benchmarks.gpu_check_setup import (
    DTYPES,
    FAMILIES,
    FIRST_GUESS_S,
    MODELS,
    NCCL_GUESS_S,
    PARENT_MARGIN_S,
    PER_TEST_S,
    PROFILE_MIN_S,
    SUITE_MIN_S,
    NEEDED,
    Budget,
    Sizes,
    arm_id,
    arm_order,
    child_command,
    child_env,
    free_port,
    missing,
    packages,
)
from benchmarks.gpu_check_suite import SUITE_PASSES, pytest_command, run_group, run_pytest

RESULT = Path(__file__).resolve().parent / "results" / "gpu_check.json"
PARTS = ("nccl", "from_pretrained", "profile", "pytest")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help=f"the JSON result (default {RESULT.relative_to(RESULT.parents[2])})")
    ap.add_argument("--out-dir", type=Path, help="a folder for the JSON and the logs (gpu_check.json in it)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall seconds for the whole check (default 420)")
    ap.add_argument("--pytest-s", type=float, default=180.0, help="seconds of the budget kept for the test suite")
    ap.add_argument("--pytest-workers", type=int, default=8, help="pytest-xdist workers (-n)")
    ap.add_argument("--arm-timeout-s", type=float, default=150.0, help="most seconds one arm may run")
    ap.add_argument("--profile-s", type=float, default=60.0, help="most seconds `fxpar profile` may run")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny models (always so on a CPU)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    ap.add_argument("--dtypes", default=",".join(DTYPES), help=f"subset of {','.join(DTYPES)}")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"subset of {','.join(FAMILIES)}")
    ap.add_argument("--skip", default="", help=f"parts left out, comma-separated: {','.join(PARTS)}")
    ap.add_argument("--warmup", type=int, help="untimed steps, the first compared (default 2 on a GPU, 1 on a CPU)")
    ap.add_argument("--steps", type=int, help="timed steps (default 5 on a GPU, 1 on a CPU)")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (fingerprints, plans)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _list(text: str, allowed: tuple[str, ...], flag: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"{flag} {text!r}: {', '.join(bad)} not among {', '.join(allowed)}")
    return items


def error_text(exc: BaseException) -> str:
    """``Type: first lines`` of an exception (at most 3 lines, 600 characters)."""
    text = " | ".join(line.strip() for line in str(exc).strip().splitlines()[:3])
    return f"{type(exc).__name__}: {text[:600]}"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomically: a reader (or a kill) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def run_child(kind: str, spec_path: Path) -> int:
    """A child process: one part, its record written to ``spec["result"]`` as it goes."""
    spec = json.loads(spec_path.read_text())
    record: dict[str, Any] = {"kind": kind}
    out = Path(spec["result"])

    def save() -> None:
        write_json(out, record)

    try:
        if kind == "train":  # lazy: only a child imports fxpar's runtime and touches the device
            from benchmarks.gpu_check_arms import train_arm as part
        else:  # lazy: as above
            from benchmarks import gpu_check_parts as parts

            part = {"nccl": parts.nccl_part, "from_pretrained": parts.from_pretrained_part,
                    "profile": parts.profile_part}[kind]
        part(spec, record, save)
        record["done"] = True
    except BaseException as exc:  # noqa: BLE001 - the parent reads the error from the record
        record.update(error=error_text(exc), traceback=traceback.format_exc()[-4000:])
    finally:
        save()
    return 0


class Check:
    """The parent: runs the parts as children, keeps the result, rewrites the JSON."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, out: Path, tmp: Path) -> None:
        self.args, self.sizes, self.out, self.tmp = args, sizes, out, tmp
        out.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(out.with_name(out.stem + "_children.log"), "w")
        self.result: dict[str, Any] = {
            "machine": machine(), "argv": sys.argv[1:], "device": sizes.device, "tiny": sizes.tiny,
            "budget_s": args.budget_s, "warmup": sizes.warmup, "steps": sizes.steps,
            "packages": {}, "arms": {}, "comparisons": {}, "skipped": []}
        self.walls: dict[str, list[float]] = {}
        self.probed = False  # whether an arm asked the planner for a sharded plan yet
        self.running: subprocess.Popen | None = None  # the child (or test run) going on now

    def started(self, proc: subprocess.Popen) -> None:
        self.running = proc

    def stop_on_signals(self) -> None:
        """SIGTERM or SIGINT (an outer time limit, Ctrl-C): the running child's process group is
        killed, the JSON says so, and the check ends (its ``finally`` saves what it measured)."""
        def stop(signum: int, frame: Any) -> None:
            if self.running is not None and self.running.poll() is None:
                os.killpg(self.running.pid, signal.SIGKILL)
            self.result["stopped_by"] = signal.Signals(signum).name
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)

    def init_dir(self, model: str) -> str:
        """Where the first arm of ``model`` saves its initial weights for the others."""
        return str(self.tmp / "init" / model)

    def save(self, budget: Budget | None = None) -> None:
        if budget is not None:
            self.result["elapsed_s"] = budget.elapsed()
        write_json(self.out, self.result)

    def skip(self, part: str, reason: str) -> None:
        self.result["skipped"].append({"part": part, "reason": reason})
        print(f"[gpu_check] skipped {part}: {reason}", flush=True)

    def child(self, kind: str, name: str, spec: dict[str, Any], seconds: float) -> dict[str, Any]:
        """Run one part in a child process for at most ``seconds``; its record (or why none)."""
        file = name.replace("/", "_")
        spec = dict(spec, device=self.sizes.device, tmp=str(self.tmp), file=file,
                    result=str(self.tmp / f"{file}.result.json"))
        spec_path = self.tmp / f"{file}.spec.json"
        spec_path.write_text(json.dumps(spec))
        self.log.write(f"\n===== {name} ({kind}) =====\n")
        rc, lines, killed, wall = run_group(child_command(kind, spec_path), seconds, self.log,
                                            child_env(free_port(), self.tmp / "cache"), self.started)
        result = Path(spec["result"])
        record = json.loads(result.read_text()) if result.is_file() else {}
        record.update(wall_s=wall, rc=rc)
        if killed:
            record["error"] = f"killed after {seconds:.0f} s (the budget or --arm-timeout-s)"
        elif not record.get("done") and not record.get("error"):
            record["error"] = f"exit status {rc}: " + " | ".join(lines[-3:])[-600:]
        print(f"[gpu_check] {name}: {wall:.1f} s" + (f", ERROR {record['error']}" if record.get("error") else ""),
              flush=True)
        return record

    def estimate(self, model: str) -> float:
        seen = self.walls.get(model)
        return max(seen) if seen else FIRST_GUESS_S["tiny" if self.sizes.tiny else model]

    def train(self, model: str, dtype: str, family: str, budget: Budget) -> None:
        """One arm, then its comparison with the plain loop (:mod:`benchmarks.gpu_check_report`)."""
        name = arm_id(model, dtype, family)
        guess = self.estimate(model)
        if not budget.fits(guess):
            self.result["arms"][name] = {"skipped": True}
            self.skip(name, budget.why_not("the arm", guess))
            return
        batch, seq = self.sizes.batch(model, dtype)
        spec = dict(model=model, dtype=dtype, family=family, config=self.sizes.config(model), batch=batch, seq=seq,
                    warmup=self.sizes.warmup, steps=self.sizes.steps, init_dir=self.init_dir(model),
                    probe_planner=family.startswith("zero") and not self.probed)
        self.probed = self.probed or family.startswith("zero")
        record = self.child("train", name, spec, min(self.args.arm_timeout_s, budget.left()))
        self.result["arms"][name] = record
        self.walls.setdefault(model, []).append(record["wall_s"])
        if family != "plain":
            try:
                plain = self.result["arms"].get(arm_id(model, dtype, "plain"))
                self.result["comparisons"][name] = compare(record, plain, dtype)
            except Exception as exc:  # noqa: BLE001 - a broken fingerprint is recorded, the check goes on
                self.result["comparisons"][name] = {"error": error_text(exc)}
        self.save(budget)


def run_parts(check: Check, budget: Budget, skip: tuple[str, ...], order: list[tuple[str, str, str]]) -> None:
    """(a), (b) in bf16, (c), (b) in fp32, the profile; the test suite is the caller's."""
    args, sizes = check.args, check.sizes
    if "nccl" not in skip:
        if budget.fits(NCCL_GUESS_S):
            check.result["nccl"] = check.child("nccl", "nccl", {}, min(args.arm_timeout_s, budget.left()))
            check.save(budget)
        else:
            check.skip("nccl", budget.why_not("the process group", NCCL_GUESS_S))
    for model, dtype, family in [a for a in order if a[1] == "bf16"]:
        check.train(model, dtype, family, budget)
    if "from_pretrained" not in skip:
        guess = check.estimate("llama")
        if budget.fits(guess):
            batch, seq = sizes.batch("llama", "bf16")
            spec = dict(model="llama", config=sizes.config("llama"), batch=batch, seq=seq,
                        shard_size="64KB" if sizes.tiny else "1GB", init_dir=check.init_dir("llama"))
            record = check.child("from_pretrained", "from_pretrained", spec, min(args.arm_timeout_s, budget.left()))
            if record.get("loss0_fxpar") is not None and record.get("loss0_hf") is not None:
                record["loss_rel_gap"] = abs(record["loss0_fxpar"] - record["loss0_hf"]) / abs(record["loss0_hf"])
                record["loss_ok"] = record["loss_rel_gap"] <= LOSS_RTOL["bf16"]
            check.result["from_pretrained"] = record
            check.save(budget)
        else:
            check.skip("from_pretrained", budget.why_not("from_pretrained", guess))
    for model, dtype, family in [a for a in order if a[1] != "bf16"]:
        check.train(model, dtype, family, budget)
    if "profile" not in skip:
        profile(check, budget)


def profile(check: Check, budget: Budget) -> None:
    """``fxpar profile`` of GPT-2 in bf16, time-boxed, then its plans predicted with the profile."""
    overhead = FIRST_GUESS_S["gpt2"]  # the child's start and the predictions after the profile
    seconds = min(check.args.profile_s, budget.left() - overhead)
    if seconds < PROFILE_MIN_S:
        check.skip("profile", budget.why_not("fxpar profile", check.args.profile_s + overhead))
        return
    _, seq = check.sizes.batch("gpt2", "bf16")
    spec = dict(model="gpt2", dtype="bf16", config=check.sizes.config("gpt2"), seq=seq, profile_batch=2,
                timeout_s=seconds)
    check.result["profile"] = check.child("profile", "profile", spec, seconds + overhead)
    check.save(budget)


def run_suite(check: Check, budget: Budget) -> None:
    """(d): the single-process tests in what is left of the budget, those marked ``gpu`` first
    (:data:`benchmarks.gpu_check_suite.SUITE_PASSES`)."""
    for key, marks in SUITE_PASSES:
        seconds = budget.left(reserved=False) - PARENT_MARGIN_S
        if seconds < SUITE_MIN_S:
            check.skip(key, f"budget: {max(seconds, 0):.0f} s left (raise --budget-s or --pytest-s)")
            continue
        cmd = pytest_command(check.args.pytest_workers, min(PER_TEST_S, seconds), check.result["packages"], marks)
        print(f"[gpu_check] test suite ({marks}) for at most {seconds:.0f} s: {' '.join(cmd[1:])}", flush=True)
        log = check.out.with_name(f"{check.out.stem}_{key}.log")
        check.result[key] = run_pytest(cmd, seconds, log, check.started)
        check.save(budget)


def preflight(check: Check, budget: Budget) -> bool:
    """Say which packages are there; False (the check stops) when a needed one is missing."""
    found = packages()
    check.result.update(packages=found, missing=missing(found))
    print(f"[gpu_check] {check.sizes.device}{' (tiny models)' if check.sizes.tiny else ''}, budget "
          f"{budget.total_s:.0f} s; packages: "
          + ", ".join(f"{k} {v['version']}" if v["ok"] else f"{k} {'MISSING' if k in NEEDED else 'absent (optional)'}"
                      for k, v in found.items()), flush=True)
    if check.result["missing"]:
        names = " ".join(check.result["missing"])
        print(f"[gpu_check] missing: {names}; install them (pip install {names}) or put them on PYTHONPATH",
              flush=True)
    return not check.result["missing"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args.spec)
    skip = _list(args.skip, PARTS, "--skip")
    order = arm_order(_list(args.models, MODELS, "--models"), _list(args.dtypes, DTYPES, "--dtypes"),
                      _list(args.families, FAMILIES, "--families"))
    budget = Budget(args.budget_s, 0.0 if "pytest" in skip else args.pytest_s)
    # the parent only asks whether CUDA is there: it never allocates on the device, the children do
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    tiny = args.tiny or device == "cpu"
    sizes = Sizes(device=device, tiny=tiny, warmup=args.warmup or (1 if tiny else 2),
                  steps=args.steps or (1 if tiny else 5))
    out = (args.out_dir / "gpu_check.json") if args.out_dir else (args.out or RESULT)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    check = Check(args, sizes, out, tmp)
    check.stop_on_signals()
    try:
        if not preflight(check, budget):
            return 2
        run_parts(check, budget, skip, order)
        if "pytest" not in skip:
            run_suite(check, budget)
    finally:
        check.save(budget)
        check.log.close()
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + render(check.result))
    print(f"\nwrote {out} in {budget.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
