"""Caches that belong to one search: a function decorated :func:`per_search` keeps what it
computed in the scope a search opens (``search.state.search_session`` opens one) and drops it
when the scope closes, so no price, plan or grid a search learnt stays in a module, and two
searches in other threads or contexts never share one (``contextvars``).

Outside any scope such a function computes afresh, or, where ``outside`` is given (the
redistribution plans the runtime asks for at every step), keeps that many answers of its own
for the runtime; a search never fills those."""

from __future__ import annotations

import functools
from collections import namedtuple
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

#: how many answers a memoized function keeps outside a search (``cache_info()``, as
#: ``functools.lru_cache`` tells it)
Held = namedtuple("Held", "currsize")

_OPEN: ContextVar[dict | None] = ContextVar("autoshard_memo", default=None)


@contextmanager
def scope() -> Iterator[dict]:
    """The caches of the block: the scope open already, else a new one for the block."""
    open_ = _OPEN.get()
    if open_ is not None:
        yield open_
        return
    token = _OPEN.set({})
    try:
        yield _OPEN.get()
    finally:
        _OPEN.reset(token)


def per_search(*, outside: int = 0, key: Callable[..., Any] | None = None) -> Callable[[_F], _F]:
    """Memoize a function of hashable positional arguments in the open scope (outside one:
    in a cache of ``outside`` answers, none where 0); ``key``: what of the arguments the
    answer depends on (the arguments themselves where None), so that calls that differ
    elsewhere share it."""

    def wrap(fn: _F) -> _F:
        of = key or (lambda *args: args)
        kept: dict = {}

        def fallback(*args: Any) -> Any:
            k = of(*args)
            if k not in kept:
                if len(kept) >= outside:
                    kept.clear()
                kept[k] = fn(*args)
            return kept[k]

        fallback.cache_info = lambda: Held(len(kept))  # type: ignore[attr-defined]

        @functools.wraps(fn)
        def cached(*args: Any) -> Any:
            caches = _OPEN.get()
            if caches is None:
                return fallback(*args) if outside else fn(*args)
            cache = caches.get(fn)
            if cache is None:
                cache = caches[fn] = {}
            k = of(*args)
            try:
                return cache[k]
            except KeyError:
                value = cache[k] = fn(*args)
                return value

        cached.outside = fallback if outside else None  # type: ignore[attr-defined]
        return cached  # type: ignore[return-value]

    return wrap


__all__ = ["per_search", "scope"]
