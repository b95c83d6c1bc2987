"""One thread exports (:mod:`fxpar.tracing.export`, "One thread exports"): ``torch.export`` sets
process-wide state, so a helper thread that builds while another trains hands its exports to the
training thread (:class:`fxpar.adapt.prepare.MainThreadCalls`), which runs them between steps."""

from __future__ import annotations

import threading

import torch

from fxpar.adapt.prepare import MainThreadCalls
from fxpar.tracing.export import export_program, exports_run_by, on_the_exporting_thread


def _serve_until_done(calls: MainThreadCalls, helper: threading.Thread, between=lambda: None) -> int:
    served = 0
    while helper.is_alive():
        served += calls.serve()
        between()
        helper.join(0.001)
    return served + calls.serve()


def test_a_marked_call_on_a_helper_runs_on_the_thread_that_serves_and_raises_on_the_helper():
    calls, threads, out = MainThreadCalls(), [], {}

    @on_the_exporting_thread
    def plus_one(x: int) -> int:
        threads.append(threading.current_thread())
        return x + 1

    @on_the_exporting_thread
    def fails() -> None:
        raise ValueError("the export failed")

    def helper() -> None:
        with exports_run_by(calls.call):
            out["value"] = plus_one(1)
            try:
                fails()
            except ValueError as exc:
                out["error"] = str(exc)
        out["outside"] = plus_one(5)   # no runner: where it is called

    thread = threading.Thread(target=helper)
    thread.start()
    served = _serve_until_done(calls, thread)
    assert served == 2 and out == {"value": 2, "error": "the export failed", "outside": 6}
    assert threads == [threading.main_thread(), thread]


def test_while_a_helper_exports_the_training_thread_never_runs_as_compiled():
    # the hazard: torch.compiler.is_compiling() is one flag for every thread while an export runs
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    x = torch.randn(3, 16)
    calls, out, compiled = MainThreadCalls(), {}, []

    def helper() -> None:
        with exports_run_by(calls.call):
            out["program"] = export_program(model, (x,), {})

    def a_step() -> None:
        compiled.append(torch.compiler.is_compiling())
        model(x).sum().backward()

    thread = threading.Thread(target=helper)
    thread.start()
    assert _serve_until_done(calls, thread, a_step) == 1
    assert isinstance(out["program"], torch.export.ExportedProgram)
    assert compiled and not any(compiled)
