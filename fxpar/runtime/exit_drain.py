"""A clean process exit after collectives: let gloo's worker threads finish before Python stops.

The crash this prevents ("terminate called without an active exception", SIGABRT, seen in about
one 2-rank gloo run in five of ``examples/train_resilient.py``, always after the last step).
gloo runs every collective on worker threads of its own.  When a worker has finished a
collective it drops its reference to the work, and with it to the work's tensors; since torch
2.10 a tensor that Python also knows keeps its Python object alive through C++ references
(``c10/util/intrusive_ptr.h``, "PyObject preservation"), so dropping such a reference from
2 to 1 decrefs the Python object and **takes the GIL** on the worker thread.  The Python thread
does not give the GIL away while it runs bytecode for less than the switch interval (5 ms), so
when a script's last collective (a checkpoint's ``all_gather_object``, a gradient
reduce-scatter) is followed within milliseconds by the end of the script, the worker is still
waiting for the GIL when the interpreter starts finalizing.  Python (< 3.14) then ends the
waiting thread with ``pthread_exit``, whose forced unwind crosses a ``noexcept`` C++ frame of
the worker (the work's destructor): ``std::terminate``.  ``destroy_process_group`` does not help
because gloo's process groups have no shutdown that joins their threads, and the parallel
module still references its groups.  The core dump's stacks (``gdb``): the main thread in
``Py_FinalizeEx``; a ``ProcessGroupGloo::runLoop`` thread in ``~AsyncAllgatherWork`` →
``TensorImpl::decref_pyobject`` → ``PyEval_AcquireThread`` → ``pthread_exit`` → ``terminate``.

The remedy: an :mod:`atexit` handler — exit handlers run while the interpreter is whole, before
finalization — that gives the GIL away for :data:`DRAIN_S` seconds (a sleep), so a worker
waiting for it takes it, drops its Python references and goes back to waiting for work, where
the end of the process finds it harmless.  A worker needs the GIL for microseconds; the wait
covers scheduling delays of a loaded machine with a wide margin.  Registered once per process
by :func:`drain_collective_threads_at_exit`, which fxpar calls whenever it builds a module over
a process group (and :func:`fxpar.runtime.init_distributed` calls), so user scripts need nothing.
"""

from __future__ import annotations

import atexit
import time

#: Seconds the exit handler gives the GIL away for (module docstring).
DRAIN_S = 0.2

_registered = False


def _drain() -> None:
    """The exit handler: release the GIL long enough for every waiting worker to take it."""
    time.sleep(DRAIN_S)


def drain_collective_threads_at_exit() -> bool:
    """Register the exit handler of the module docstring, once per process; returns whether
    this call registered it."""
    global _registered
    if _registered:
        return False
    atexit.register(_drain)
    _registered = True
    return True


def is_registered() -> bool:
    """Whether this process will drain collective threads at exit."""
    return _registered
