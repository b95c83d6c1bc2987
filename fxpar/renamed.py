"""Names fxpar renamed, still accepted for one release with a ``FutureWarning`` that says what
to write instead (``docs/glossary.md``: one name per concept).

=====================================  ===================================  ===================
old name                               new name                             where
=====================================  ===================================  ===================
``strategies`` (keyword, option)       ``forms``                            ``fxpar.auto``,
                                                                            ``fxpar.Options``,
                                                                            ``fxpar.make_plan``,
                                                                            ``AdaptPolicy``
``strategies:`` (``fxpar.yaml`` key)   ``forms:``                           ``fxpar.yaml``
``--strategies`` (CLI flag)            ``--forms``                          ``fxpar plan``
``strategy`` (plan field, keyword)     ``form``                             ``fxpar.Plan``
``"strategy"`` (plan JSON key)         ``"form"``                           plan files (read by
                                                                            :mod:`fxpar.plan_upgrade`,
                                                                            no warning: files
                                                                            stay readable)
=====================================  ===================================  ===================

The old names go in the release after the one that renamed them (:data:`REMOVED_IN`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any, TypeVar

from fxpar.errors import ConfigError

#: the release that drops the old names
REMOVED_IN = "0.3"
#: old keyword / option / yaml key -> its new name
RENAMED: dict[str, str] = {"strategies": "forms", "strategy": "form"}

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def warn_renamed(old: str, new: str, where: str, *, stacklevel: int = 3) -> None:
    """The one warning every old name gives: where it was used, and what to write instead."""
    warnings.warn(f"{where}: {old!r} is renamed {new!r}; {old!r} still works until fxpar {REMOVED_IN}",
                  FutureWarning, stacklevel=stacklevel)


def renamed_keys(values: Mapping[str, Any], where: str, *, stacklevel: int = 3) -> dict[str, Any]:
    """``values`` (keyword or key -> value) with each old name of :data:`RENAMED` under its new
    one, warning once per old name; a :class:`~fxpar.errors.ConfigError` where both are given."""
    out = dict(values)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{where}: give {new!r} only ({old!r} is its old name), not both")
            warn_renamed(old, new, where, stacklevel=stacklevel + 1)
            out[new] = out.pop(old)
    return out


def accepts_renamed(where: str) -> Callable[[F], F]:
    """Decorate a function (or a class's ``__init__``) so that the old keyword names of
    :data:`RENAMED` reach it under their new names, with :func:`warn_renamed`."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if any(old in kwargs for old in RENAMED):
                kwargs = renamed_keys(kwargs, where)
            return fn(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def keeps_old_names(where: str) -> Callable[[C], C]:
    """A class decorator (over ``@dataclass``): its ``__init__`` also takes the old keyword names
    of :data:`RENAMED` (:func:`accepts_renamed`), and each renamed field can still be read under
    its old name, with :func:`warn_renamed`."""
    def wrap(cls: C) -> C:
        cls.__init__ = accepts_renamed(where)(cls.__init__)  # type: ignore[misc]
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
