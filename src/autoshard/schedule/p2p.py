"""NCCL's rule for point-to-point groups, played on a schedule.

Under NCCL a rank's point-to-point groups (one ``batch_isend_irecv`` each) run in the order
they were posted, one after the other on one stream, and a send completes only when its
receiver runs the group holding the matching receive. So: a send and its receive complete
together, once each is in the group its rank runs now (its earliest group not complete); a
group completes when all of its sends and receives have; a compute action that reads a
received tensor waits for the group of that receive; a rank waits for all of its groups at
the end of the step. A schedule whose ranks would wait for each other forever under that rule
hangs on GPUs even where gloo, which completes each operation on its own, runs it.

:func:`check_p2p_order` plays a schedule so: its groups are those the runtime posts
(:func:`autoshard.schedule.p2p_groups`), or, with ``batched=False``, every send and receive a
group of its own (a runtime posting each action alone).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from autoshard.schedule.actions import Action, Schedule, ScheduleError, p2p_groups

#: a tensor that crosses ranks: (SEND kind, from stage, microbatch, to stage)
Message = tuple[str, int, int, int]


def _message(a: Action) -> Message:
    if a.kind.startswith("SEND"):
        return (a.kind, a.stage, a.microbatch, a.peer)
    return ("SEND" + a.kind[4:], a.peer, a.microbatch, a.stage)


def _items(schedule: Schedule, rank: int, batched: bool) -> list[Action | tuple[Action, ...]]:
    if batched:
        return p2p_groups(schedule.actions[rank])
    return [(a,) if a.kind.startswith(("SEND", "RECV")) else a for a in schedule.actions[rank]]


class _Rank:
    """One rank's place in its list and its groups posted and not complete, first first."""

    def __init__(self, items: list[Action | tuple[Action, ...]]) -> None:
        self.items, self.at = items, 0
        self.posted: deque[tuple[Action, ...]] = deque()
        self.done: set[Message] = set()  # sends and receives complete

    def current(self) -> tuple[Action, ...]:
        return self.posted[0] if self.posted else ()

    @property
    def finished(self) -> bool:
        return self.at == len(self.items) and not self.posted


def check_p2p_order(schedule: Schedule, batched: bool = True) -> None:
    """Raise ScheduleError when ``schedule`` hangs under NCCL's point-to-point rule (the
    module's docstring), naming what each stuck rank waits for and the group its peer runs."""
    ranks = [_Rank(_items(schedule, r, batched)) for r in range(schedule.num_ranks)]
    arrived: set[tuple[str, int, int]] = set()  # (RECV kind, stage, microbatch) complete
    moved = True
    while moved:
        moved = _match(schedule, ranks, arrived)
        for r, state in enumerate(ranks):
            moved |= _advance(schedule, r, state, arrived)
    stuck = [r for r, state in enumerate(ranks) if not state.finished]
    if stuck:
        raise ScheduleError(
            f"{schedule.name} hangs under NCCL's in-order point-to-point groups: "
            + "; ".join(_stuck(schedule, ranks, r) for r in stuck)
        )


def _match(schedule: Schedule, ranks: list[_Rank], arrived: set[tuple[str, int, int]]) -> bool:
    """Complete every send and receive whose match is in its peer's current group, and the
    groups that are then complete; whether anything did."""
    moved = False
    for state in ranks:
        for a in state.current():
            m = _message(a)
            if m in state.done:
                continue
            peer = ranks[schedule.placement[a.peer]]
            if any(_message(b) == m and b.kind != a.kind for b in peer.current()):
                state.done.add(m)
                peer.done.add(m)
                moved = True
    for state in ranks:
        while state.posted and all(_message(a) in state.done for a in state.posted[0]):
            for a in state.posted.popleft():
                if a.kind.startswith("RECV"):
                    arrived.add((a.kind, a.stage, a.microbatch))
            moved = True
    return moved


def _advance(
    schedule: Schedule, rank: int, state: _Rank, arrived: set[tuple[str, int, int]]
) -> bool:
    """Run the rank's list until a compute action waits for a receive not complete; whether
    it moved."""
    start = state.at
    while state.at < len(state.items):
        item = state.items[state.at]
        if isinstance(item, tuple):
            state.posted.append(item)
        elif _reads(schedule, rank, item) - arrived:
            break
        state.at += 1
    return state.at != start


def _reads(schedule: Schedule, rank: int, a: Action) -> set[tuple[str, int, int]]:
    """The receives compute action ``a`` reads (none for a send, receive or sum)."""
    s, i, last = a.stage, a.microbatch, schedule.num_stages - 1
    if a.kind == "F" and s > 0 and schedule.placement[s - 1] != rank:
        return {("RECV_F", s, i)}
    if a.kind in ("B", "I") and s < last and schedule.placement[s + 1] != rank:
        return {("RECV_B", s, i)}
    return set()


def _group_text(group: Sequence[Action]) -> str:
    return "[" + " ".join(map(str, group)) + "]" if group else "none"


def _stuck(schedule: Schedule, ranks: list[_Rank], r: int) -> str:
    state = ranks[r]
    at = "the step's end" if state.at == len(state.items) else str(state.items[state.at])
    peers = sorted({schedule.placement[a.peer] for a in state.current()} - {r})
    others = ", ".join(f"rank {q} runs {_group_text(ranks[q].current())}" for q in peers)
    return f"rank {r} at {at} runs group {_group_text(state.current())}" + (
        f" while {others}" if others else ""
    )


__all__ = ["check_p2p_order"]
