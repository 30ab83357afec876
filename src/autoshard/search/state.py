"""One search's state while it runs: its caches, how it prices (attention, the sequence, sequence
parallelism, the precision policy) and the lower layers' ``memo`` scope, which the outermost
``search_session`` opens for the searches inside and drops when it ends: nothing learnt stays in
a module, and searches in other threads or contexts each have their own (``contextvars``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from autoshard import memo


class SearchState:
    """One search's caches (by name, each a dict) and the way it prices."""

    def __init__(self) -> None:
        self.caches: defaultdict[str, dict] = defaultdict(dict)
        #: how options are made (``options.searching``): the one attention method (None:
        #: any), the inputs' sequence length, whether every op splits over tp where it can
        self.context: dict[str, Any] = {
            "attention": None,
            "sequence": None,
            "sequence_parallel": False,
        }
        self.precision: Any = None  # the policy parameters are priced under (pricing)
        self.offload: Any = None  # the ``cost.offload.Offload`` they are priced under
        self.priced_as: tuple | None = None  # what the graphs below were priced under
        self.bare: dict[tuple, tuple[Any, Any]] = {}  # each graph without moves
        self.priced: dict[tuple, tuple[Any, Any]] = {}  # the bare graphs at every stage
        self.moves: dict[tuple, tuple[Any, Any]] = {}  # each mesh's moves

    def forget(self, *names: str) -> None:
        """The caches named (all, without names) and the graphs emptied."""
        for name in names or list(self.caches):
            self.caches[name].clear()
        if not names:
            self.bare.clear()
            self.priced.clear()
            self.moves.clear()


_CURRENT: ContextVar[SearchState | None] = ContextVar("autoshard_search", default=None)


@contextmanager
def search_session() -> Iterator[SearchState]:
    """The search state of the block: the one open already, else a new one for the block
    (the graphs and clusters given to the searches inside must not change meanwhile)."""
    open_ = _CURRENT.get()
    if open_ is not None:
        yield open_
        return
    token = _CURRENT.set(SearchState())
    try:
        with memo.scope():
            yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def state() -> SearchState:
    """The search state of the search under way; outside any, one for this call alone."""
    return _CURRENT.get() or SearchState()


def cache(name: str) -> dict:
    """The search under way's cache ``name``."""
    return state().caches[name]


__all__ = ["SearchState", "cache", "search_session", "state"]
