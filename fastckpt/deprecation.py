"""Old spellings of the public API, kept working for one release with a ``DeprecationWarning`` that names the new
one (the vocabulary is in ``docs/api.md``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["keywords_only", "warn"]


def warn(old: str, new: str, stacklevel: int = 3) -> None:
    """A ``DeprecationWarning`` for ``old``, pointing at ``new``, attributed to the caller's caller."""
    warnings.warn(f"{old} is deprecated and goes in the next release: {new}", DeprecationWarning,
                  stacklevel=stacklevel)


def keywords_only(positional: int, *names: str, renamed: dict[str, str] | None = None
                  ) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """For a function whose parameters ``names`` became keyword-only after its first ``positional`` ones: a call
    that still passes them by position (in that order), or by an old name of ``renamed`` (old: new), works and
    warns."""
    renamed = renamed or {}

    def decorate(fn: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            if len(args) > positional:
                extra = args[positional:]
                if len(extra) > len(names):
                    raise TypeError(f"{fn.__name__}() takes {positional} positional argument(s) and the keywords "
                                    f"{', '.join(names)}; {len(args)} positional given")
                given = dict(zip(names, extra, strict=False))
                warn(f"passing {', '.join(given)} to {fn.__name__}() by position",
                     f"pass {', '.join(f'{n}=' for n in given)} by keyword")
                clash = set(given) & set(kwargs)
                if clash:
                    raise TypeError(f"{fn.__name__}() got {', '.join(sorted(clash))} twice")
                args, kwargs = args[:positional], {**kwargs, **given}
            for old, new in renamed.items():
                if old in kwargs:
                    warn(f"{fn.__name__}({old}=)", f"use {fn.__name__}({new}=)")
                    if new in kwargs:
                        raise TypeError(f"{fn.__name__}() got both {old}= and {new}=")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
