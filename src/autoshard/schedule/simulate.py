"""Playing a schedule: the validator's structural checks, and the simulator that times every
action of every rank from the costs of its actions.

The simulator runs each rank's list in order. A compute action starts when the rank is free
and its inputs are there: the forward of the stage before (its end on the same rank, or the
arrival of its send), the gradient from the stage after, the action's own forward (or ``I``
for a ``W``). A send takes no time of the rank that posts it; its tensor arrives ``transfer``
seconds later. A receive is a posting and takes no time; the compute that reads it waits.
``REDUCE_GRAD`` takes its cost after the stage's last backward. A rank that cannot go on
while no other rank can is a deadlock, reported with what each rank waits for.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from autoshard.schedule.actions import Action, Schedule, ScheduleError

Key = tuple[str, int, int]  # (kind, stage, microbatch)


class Timed(NamedTuple):
    """One action's place on the timeline (a tuple: a schedule has many of them)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every action's start and end, per rank in its order; the step; the bubble (the share
    of the ranks' time, from the first compute to the last, that no compute runs); each
    stage's most micro-batches in flight (forward started, backward not finished) and, when
    activation bytes were given, each rank's peak of them."""

    schedule: Schedule
    events: tuple[tuple[Timed, ...], ...]
    step: float
    bubble: float
    in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]

    def compute_time(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events[rank] if e.action.is_compute)


def unit_cost(action: Action) -> float:
    """Nominal costs: a forward 1, a backward 2 (1 + 1 when split), communication free."""
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}.get(action.kind, 0.0)


def validate(schedule: Schedule) -> Timeline:
    """Raise ScheduleError naming the first problem of ``schedule``: an action missing,
    repeated or on the wrong rank, a dependency out of order on a rank, sends and receives that
    do not pair up in the same order on every pair of ranks, or a deadlock. Returns the
    timeline at nominal costs."""
    _check_compute(schedule)
    _check_communication(schedule)
    return simulate(schedule, unit_cost)


def _check_compute(schedule: Schedule) -> None:
    p, stages, m = schedule.num_ranks, schedule.num_stages, schedule.microbatches
    if any(not 0 <= r < p for r in schedule.placement):
        raise ScheduleError(
            f"{schedule.name}: placement {schedule.placement} names a rank not in 0..{p - 1}"
        )
    backward = ("I", "W") if schedule.split_backward else ("B",)
    wanted = Counter((k, s, i) for s in range(stages) for i in range(m) for k in ("F", *backward))
    seen: Counter[Key] = Counter()
    for rank, a in schedule:
        if not a.is_compute and a.kind != "REDUCE_GRAD":
            continue
        if schedule.placement[a.stage] != rank:
            raise ScheduleError(
                f"{schedule.name}: {a} runs on rank {rank}; stage {a.stage} is on rank "
                f"{schedule.placement[a.stage]}"
            )
        if a.is_compute:
            seen[(a.kind, a.stage, a.microbatch)] += 1
    for key in sorted(set(wanted) | set(seen)):
        if seen[key] != 1:
            what = "missing" if seen[key] == 0 else f"there {seen[key]} times"
            if key not in wanted:
                how = "split" if schedule.split_backward else "whole"
                what = f"not an action of a {how}-backward schedule"
            raise ScheduleError(f"{schedule.name}: {Action(*key)} is {what}")
    for s in range(stages):
        count = schedule.actions[schedule.placement[s]].count(Action("REDUCE_GRAD", s))
        if count != 1:
            raise ScheduleError(f"{schedule.name}: REDUCE_GRAD{s} is there {count} times, not once")


def _needed_messages(schedule: Schedule) -> Counter[tuple[str, int, int, int]]:
    """Every tensor that crosses ranks: (SEND kind, from stage, microbatch, to stage)."""
    needed: Counter[tuple[str, int, int, int]] = Counter()
    last = schedule.num_stages - 1
    for _, a in schedule:
        if (
            a.kind == "F"
            and a.stage < last
            and schedule.placement[a.stage + 1] != schedule.placement[a.stage]
        ):
            needed[("SEND_F", a.stage, a.microbatch, a.stage + 1)] += 1
        if (
            a.kind in ("B", "I")
            and a.stage > 0
            and schedule.placement[a.stage - 1] != schedule.placement[a.stage]
        ):
            needed[("SEND_B", a.stage, a.microbatch, a.stage - 1)] += 1
    return needed


def _check_communication(schedule: Schedule) -> None:
    needed = _needed_messages(schedule)
    sends: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for rank, a in schedule:
        if a.kind.startswith("SEND"):
            message = (a.kind, a.stage, a.microbatch, a.peer)
            if needed[message] != 1:
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} sends {a}, which no stage needs (or twice)"
                )
            needed[message] -= 1
            sends[(rank, schedule.placement[a.peer])].append(message)
        elif a.kind.startswith("RECV"):
            message = ("SEND" + a.kind[4:], a.peer, a.microbatch, a.stage)
            if a.peer is None or schedule.placement[a.stage] != rank:
                raise ScheduleError(
                    f"{schedule.name}: rank {rank} receives {a} for a stage it does not hold"
                )
            recvs[(schedule.placement[a.peer], rank)].append(message)
    missing = [m for m, n in needed.items() if n]
    if missing:
        kind, stage, mb, to = missing[0]
        raise ScheduleError(f"{schedule.name}: nothing sends {kind}{stage}.{mb}>{to}")
    for pair in sorted(set(sends) | set(recvs)):
        if sends[pair] != recvs[pair]:
            got = [f"{k}{s}.{i}>{t}" for k, s, i, t in recvs[pair]]
            sent = [f"{k}{s}.{i}>{t}" for k, s, i, t in sends[pair]]
            raise ScheduleError(
                f"{schedule.name}: rank {pair[0]} sends to rank {pair[1]} in the order {sent}, "
                f"which receives in the order {got}"
            )


def simulate(
    schedule: Schedule,
    cost: Callable[[Action], float],
    transfer: Callable[[Action], float] | None = None,
    activation_bytes: Callable[[int], float] | None = None,
) -> Timeline:
    """The timeline of ``schedule`` when each action takes ``cost(action)`` seconds and a
    send's tensor arrives ``transfer(send)`` seconds after it is posted (default: at once);
    ``activation_bytes(stage)``: what one micro-batch's forward of a stage keeps for its
    backward."""
    transfer = transfer or (lambda a: 0.0)
    order = _played(schedule)
    ends = [0.0] * len(order)
    arrives = [0.0] * len(order)
    clock = [0.0] * schedule.num_ranks
    events: list[list[Timed]] = [[] for _ in range(schedule.num_ranks)]
    for j, (rank, a, after, arrived, timed, sends) in enumerate(order):
        start = clock[rank]
        for k in after:
            if ends[k] > start:
                start = ends[k]
        for k in arrived:
            if arrives[k] > start:
                start = arrives[k]
        end = start + cost(a) if timed else start
        if sends:
            arrives[j] = start + transfer(a)
        ends[j] = clock[rank] = end
        events[rank].append(Timed(rank, a, start, end))
    return _timeline(schedule, events, activation_bytes)


#: one step of a played schedule: (rank, action, the steps whose ends it waits for, the sends
#: whose arrivals it waits for, whether it takes its cost, whether it is a send)
Played = tuple[int, Action, tuple[int, ...], tuple[int, ...], bool, bool]
_PLAYED: dict[int, tuple[weakref.ref, tuple[Played, ...]]] = {}


def _played(schedule: Schedule) -> tuple[Played, ...]:
    """The order in which ranks can run the actions of ``schedule``, each with what it waits
    for; ScheduleError for a dependency out of order or a deadlock. Whether an action can run
    depends only on what ran before it, never on times, so the order is found once per
    schedule and every pricing of it replays the order with its own costs."""
    known = _PLAYED.get(id(schedule))
    if known is not None and known[0]() is schedule:
        return known[1]
    order = _play(schedule)
    for key in [k for k, (ref, _) in _PLAYED.items() if ref() is None]:
        del _PLAYED[key]
    _PLAYED[id(schedule)] = (weakref.ref(schedule), order)
    return order


def _play(schedule: Schedule) -> tuple[Played, ...]:
    # Whole: one pass over the ranks' lists with the shared state of what ran and what arrived
    ends: dict[Key, int] = {}
    arrivals: dict[tuple[str, int, int], int] = {}  # (RECV kind, to stage, microbatch) -> send
    posted: set[tuple[str, int, int]] = set()
    position = [0] * schedule.num_ranks
    order: list[Played] = []
    total = sum(len(a) for a in schedule.actions)
    # a rank runs until an input it needs has not arrived; a send wakes the rank it goes to
    ready = deque(range(schedule.num_ranks))
    while ready:
        rank = ready.popleft()
        actions = schedule.actions[rank]
        while position[rank] < len(actions):
            a = actions[position[rank]]
            inputs = _inputs_ready(schedule, rank, a, ends, arrivals, posted)
            if inputs is None:
                break
            j = len(order)
            if a.kind.startswith("SEND"):
                arrivals[("RECV" + a.kind[4:], a.peer, a.microbatch)] = j
                ready.append(schedule.placement[a.peer])
            elif a.kind.startswith("RECV"):
                posted.add((a.kind, a.stage, a.microbatch))
            else:
                ends[(a.kind, a.stage, a.microbatch)] = j
            timed = a.is_compute or a.kind == "REDUCE_GRAD"
            own = tuple(k for kind, k in inputs if kind == "end")
            sent = tuple(k for kind, k in inputs if kind == "arrival")
            order.append((rank, a, own, sent, timed, a.kind.startswith("SEND")))
            position[rank] += 1
    if len(order) < total:
        waiting = [
            f"rank {r} at {schedule.actions[r][position[r]]}"
            for r in range(schedule.num_ranks)
            if position[r] < len(schedule.actions[r])
        ]
        raise ScheduleError(f"{schedule.name} deadlocks: " + "; ".join(waiting))
    return tuple(order)


def _inputs_ready(
    schedule: Schedule,
    rank: int,
    a: Action,
    ends: dict[Key, int],
    arrivals: dict[tuple[str, int, int], int],
    posted: set[tuple[str, int, int]],
) -> list[tuple[str, int]] | None:
    """What ``a`` waits for, ("end", step) or ("arrival", send step), or None while
    something it needs has not run. A dependency that belongs earlier on this rank and is not
    done is a ScheduleError."""
    needs: list[tuple[str, int] | None] = []
    s, i, last = a.stage, a.microbatch, schedule.num_stages - 1
    if a.kind == "F" and s > 0:
        needs.append(_from(schedule, rank, "F", s - 1, i, "RECV_F", s, ends, arrivals, posted))
    if a.kind in ("B", "I"):
        needs.append(_own(rank, a, ("F", s, i), ends))
        if s < last:
            back = "I" if schedule.split_backward else "B"
            needs.append(_from(schedule, rank, back, s + 1, i, "RECV_B", s, ends, arrivals, posted))
    if a.kind == "W":
        needs.append(_own(rank, a, ("I", s, i), ends))
    if a.kind.startswith("SEND"):
        made = (
            ("F", s, i) if a.kind == "SEND_F" else ("I" if schedule.split_backward else "B", s, i)
        )
        needs.append(_own(rank, a, made, ends))
    if a.kind == "REDUCE_GRAD":
        kind = "W" if schedule.split_backward else "B"
        needs += [_own(rank, a, (kind, s, j), ends) for j in range(schedule.microbatches)]
    if any(n is None for n in needs):
        return None
    return [n for n in needs if n is not None]


def _own(rank: int, a: Action, key: Key, ends: dict[Key, int]) -> tuple[str, int]:
    if key not in ends:
        raise ScheduleError(f"rank {rank} runs {a} before {Action(*key)}, which it needs")
    return ("end", ends[key])


def _from(schedule, rank, kind, stage, i, recv, to, ends, arrivals, posted):
    """The input made by (kind, stage, i) for stage ``to`` on ``rank``: its end on this rank,
    or its arrival, which a receive posted before must be waiting for (None: not sent yet)."""
    if schedule.placement[stage] == rank:
        return _own(rank, Action(kind, to, i), (kind, stage, i), ends)
    if (recv, to, i) not in posted:
        raise ScheduleError(
            f"rank {rank} runs {Action(kind, to, i)} before it posts {recv}{to}.{i}"
        )
    sent = arrivals.get((recv, to, i))
    return None if sent is None else ("arrival", sent)


def _timeline(
    schedule: Schedule,
    events: list[list[Timed]],
    activation_bytes: Callable[[int], float] | None,
) -> Timeline:
    compute = [e for rank in events for e in rank if e.action.is_compute]
    first = min((e.start for e in compute), default=0.0)
    last = max((e.end for e in compute), default=0.0)
    span = (last - first) * schedule.num_ranks
    busy = sum(e.end - e.start for e in compute)
    step = max((e.end for rank in events for e in rank), default=0.0)
    # in flight from a forward's start to the end of the backward that frees it
    frees = "W" if schedule.split_backward else "B"
    changes: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for e in compute:
        if e.action.kind == "F":
            changes[e.action.stage].append((e.start, 1))
        elif e.action.kind == frees:
            changes[e.action.stage].append((e.end, -1))
    in_flight = [0] * schedule.num_stages
    peak_bytes = [0.0] * schedule.num_ranks
    for rank in range(schedule.num_ranks):
        held, peak = 0.0, 0.0
        moves = sorted(
            (t, d, s) for s in schedule.stages_of(rank) for t, d in changes[s]
        )  # a free at time t comes before a forward starting at t (-1 sorts first)
        counts: Counter[int] = Counter()
        for _, d, s in moves:
            counts[s] += d
            in_flight[s] = max(in_flight[s], counts[s])
            held += d * (activation_bytes(s) if activation_bytes else 0.0)
            peak = max(peak, held)
        peak_bytes[rank] = peak
    return Timeline(
        schedule,
        tuple(tuple(e) for e in events),
        step,
        1.0 - busy / span if span else 0.0,
        tuple(in_flight),
        tuple(peak_bytes),
    )
