"""Names fxpar renamed, still accepted for one release with a ``FutureWarning`` that says what
to write instead (``docs/glossary.md``: one name per concept).

=====================================  ===================================  ===================
old name                               new name                             where
=====================================  ===================================  ===================
``strategies`` (keyword, option)       ``forms``                            ``fxpar.auto``,
                                                                            ``fxpar.Options``,
                                                                            ``fxpar.make_plan``,
                                                                            ``AdaptPolicy``,
                                                                            ``fxpar.solvers.plan``,
                                                                            ``plan_model``
``strategies:`` (``fxpar.yaml`` key)   ``forms:``                           ``fxpar.yaml``
``--strategies`` (CLI flag)            ``--forms``                          ``fxpar plan``
``strategy`` (plan field, keyword)     ``form``                             ``fxpar.Plan``,
                                                                            ``fxpar.Prediction``
``fxpar.solvers.planner.FAMILIES``     ``fxpar.forms.SEARCHED``             the planner
``"strategy"`` (plan JSON key)         ``"form"``                           plan files (read by
                                                                            :mod:`fxpar.plan_upgrade`,
                                                                            no warning: files
                                                                            stay readable)
``pipelines``, ``num_microbatches``,   ``pipeline``, a ``PipelineSpec``     ``fxpar.Plan``
``schedule``,                          (moved: :class:`Moved`)              (reading them:
``zero_sharded_optimizer`` (keywords)                                       views, no warning)
``fxpar.codegen.hand_plans``,          ``fxpar.forms.hand_plans``           importing it
``fxpar.codegen.sharded_plans``        (each form's in its folder)
=====================================  ===================================  ===================

The old names go in the release after the one that renamed them (:data:`REMOVED_IN`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from fxpar.errors import ConfigError

#: the release that drops the old names
REMOVED_IN = "0.3"
#: old keyword / option / yaml key -> its new name
RENAMED: dict[str, str] = {"strategies": "forms", "strategy": "form"}

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def _warn_old(change: str, old: str, stacklevel: int) -> None:
    """The one warning every old name gives: ``change`` (where it was used and what to write
    instead), then until when ``old`` still works; ``stacklevel`` counts from the caller."""
    warnings.warn(f"{change}; {old} still works until fxpar {REMOVED_IN}", FutureWarning, stacklevel=stacklevel + 1)


def warn_renamed(old: str, new: str, where: str, *, stacklevel: int = 3) -> None:
    """The warning of a renamed keyword, option, key, flag or field."""
    _warn_old(f"{where}: {old!r} is renamed {new!r}", repr(old), stacklevel)


def renamed_keys(values: Mapping[str, Any], where: str, *, accepted: Collection[str],
                 stacklevel: int = 3) -> dict[str, Any]:
    """``values`` (keyword or key -> value) with each old name of :data:`RENAMED` whose new name
    is ``accepted`` there put under its new name, warning once per old name (an old name of
    something ``where`` never took stays, for ``where`` to call unknown); a
    :class:`~fxpar.errors.ConfigError` where both names are given."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out and new in accepted:
            if new in out:
                raise ConfigError(f"{where}: give {new!r} only ({old!r} is its old name), not both")
            warn_renamed(old, new, where, stacklevel=stacklevel + 1)
            out[new] = out.pop(old)
    return out


@dataclass(frozen=True)
class Moved:
    """Keywords that moved into a typed spec: ``keys`` now live in the field ``into``, and
    ``fold(keywords, where)`` puts them there (merged into an ``into`` given beside them, as
    ``dataclasses.replace`` passes it)."""
    keys: Collection[str]
    into: str
    fold: Callable[[Mapping[str, Any], str], dict[str, Any]]


def accepts_renamed(where: str, *, moved: Moved | None = None) -> Callable[[F], F]:
    """Decorate a function (or a class's ``__init__``) so that the old keyword names of
    :data:`RENAMED` whose new names it takes reach it under those, with :func:`warn_renamed`, and
    the keywords that ``moved`` into a spec reach it folded there, with :func:`warn_moved`.
    (``dataclasses.replace(obj, old=...)`` passes the new name too, so it is the "not both"
    error: replace with the new name.)"""
    def wrap(fn: F) -> F:
        accepted = frozenset(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if any(old in kwargs for old in RENAMED):
                kwargs = renamed_keys(kwargs, where, accepted=accepted)
            if moved is not None and any(k in moved.keys for k in kwargs):
                for k in [k for k in kwargs if k in moved.keys]:
                    warn_moved(k, moved.into, where)
                kwargs = moved.fold(kwargs, where)
            return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def keeps_old_names(where: str, *, moved: Moved | None = None) -> Callable[[C], C]:
    """A class decorator (over ``@dataclass``): its ``__init__`` also takes the old keyword names
    of :data:`RENAMED` and the keywords that ``moved`` (:func:`accepts_renamed`, one wrapper), and
    each renamed field can still be read under its old name, with :func:`warn_renamed`."""
    def wrap(cls: C) -> C:
        cls.__init__ = accepts_renamed(where, moved=moved)(cls.__init__)  # type: ignore[misc]
        names = {f.name for f in fields(cls)}   # type: ignore[arg-type]
        for old, new in RENAMED.items():
            if new in names:
                setattr(cls, old, property(_old_reader(old, new, where), doc=f"Renamed :attr:`{new}`."))
        return cls
    return wrap


def _old_reader(old: str, new: str, where: str) -> Callable[[Any], Any]:
    def read(self: Any) -> Any:
        warn_renamed(old, new, where)
        return getattr(self, new)
    return read


def warn_moved(old: str, into: str, where: str, *, stacklevel: int = 3) -> None:
    """The warning of a keyword that moved into a typed spec (:class:`Moved`)."""
    _warn_old(f"{where}: {old!r} moved into {into!r} ({into}={{{old!r}: ...}})", repr(old), stacklevel)


def warn_module_moved(old: str, new: str) -> None:
    """The warning a module that moved gives when it is imported (once per process)."""
    _warn_old(f"{old} moved to {new}", old, 3)
