"""Error types raised by fxpar.

Every error that a user can cause (a bad cluster file, an unknown GPU, a model that will not
export, a plan that does not fit in memory) is an :class:`FxparError` whose message names the
input, the value, what is wrong and what to do.  The CLI prints such errors without a
traceback; anything else escaping from fxpar is a bug.
"""

from __future__ import annotations


class FxparError(Exception):
    """Base class of every error fxpar raises on purpose."""


class ConfigError(FxparError, ValueError):
    """A cluster, scenario, model spec or option is malformed or out of range."""


class TraceError(FxparError, RuntimeError):
    """The model could not be exported to a graph."""


class InfeasibleError(FxparError, RuntimeError):
    """No plan fits: the message says which device lacks how many bytes and what would help."""

    def __init__(self, message: str, shortfalls: dict[str, int] | None = None) -> None:
        super().__init__(message)
        #: device description -> missing bytes (positive), for programmatic use.
        self.shortfalls: dict[str, int] = dict(shortfalls or {})


class PlanError(FxparError, ValueError):
    """A plan (hand-written or loaded from JSON) is inconsistent with the model or cluster."""


class RuntimeSetupError(FxparError, RuntimeError):
    """The distributed runtime does not match the plan (world size, backend, rank)."""


class CheckpointError(FxparError, RuntimeError):
    """A checkpoint directory is missing, incomplete, or does not fit the model or optimizer."""


class SwitchRefused(FxparError, RuntimeError):
    """A running job's switch to another plan, refused on every rank alike before anything
    moved (the old plan keeps running): the new plan could not be built on some rank.
    ``form``: the form whose build failed (adapting offers it no more); empty when
    the plan was built and something else refused it."""

    def __init__(self, message: str, *, form: str = "") -> None:
        super().__init__(message)
        self.form = form


class MoveDoesNotFit(CheckpointError, SwitchRefused):
    """A move of live state to another plan that does not fit some rank's memory, refused on
    every rank alike before anything moved (the old plan keeps running)."""
