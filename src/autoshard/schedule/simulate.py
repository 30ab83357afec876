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

from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from autoshard.schedule.actions import Action, Schedule, ScheduleError
from autoshard.schedule.p2p import check_p2p_order

Key = tuple[str, int, int]  # (kind, stage, microbatch)


class Timed(NamedTuple):
    """One action's place on the timeline (a tuple: a schedule has many of them)."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every action's start and end, per rank in its order (``events``); the step; the
    bubble (the share of the ranks' time, from the first compute to the last, that no compute
    runs); each stage's most micro-batches in flight (forward started, backward not finished)
    and, when activation bytes were given, each rank's peak of them."""

    schedule: Schedule
    step: float
    bubble: float
    in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]
    #: the replay and each of its steps' start and end, which ``events`` is made of when read
    #: (pricing reads the step and the peaks only, many times a search)
    played: tuple[_Replay, tuple[float, ...], tuple[float, ...]] = field(repr=False, compare=False)

    @cached_property
    def events(self) -> tuple[tuple[Timed, ...], ...]:
        replay, starts, ends = self.played
        out = []
        for rank, steps in enumerate(replay.steps_of):
            # an untimed step starts and ends on its rank's clock: the timed step before's end
            out.append(
                tuple(
                    Timed(rank, a, starts[t], ends[t])
                    if timed
                    else Timed(rank, a, ends[t] if t >= 0 else 0.0, ends[t] if t >= 0 else 0.0)
                    for a, timed, t in steps
                )
            )
        return tuple(out)

    def compute_time(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events[rank] if e.action.is_compute)


def unit_cost(action: Action) -> float:
    """Nominal costs: a forward 1, a backward 2 (1 + 1 when split), communication free."""
    return {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}.get(action.kind, 0.0)


def validate(schedule: Schedule) -> Timeline:
    """Raise ScheduleError naming the first problem of ``schedule``: an action missing,
    repeated or on the wrong rank, a dependency out of order on a rank, sends and receives that
    do not pair up in the same order on every pair of ranks, a deadlock, or groups of sends and
    receives that would hang under NCCL's in-order rule (:func:`check_p2p_order`). Returns the
    timeline at nominal costs."""
    _check_compute(schedule)
    _check_communication(schedule)
    timeline = simulate(schedule, unit_cost)
    check_p2p_order(schedule)
    return timeline


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
    replay = _replayed(schedule)
    seconds = [cost(a) for a in replay.actions]
    hops = [transfer(a) for a in replay.sends] if transfer else [0.0] * len(replay.sends)
    # a search prices one schedule again with the same costs (its stage plan at another
    # ZeRO stage): the timeline is the one played before (64 ranks, 512 micro-batches: 0.4-0.9 s)
    key = (tuple(seconds), tuple(hops)) if activation_bytes is None else None
    known = schedule.found.setdefault("timelines", {})
    if key in known:
        return known[key]
    # a send and a receive take no time of their rank: only the timed steps are replayed, a
    # send's tensor arriving ``hop`` after the end of its rank's timed step before it
    starts = [0.0] * len(seconds)
    ends = [0.0] * (len(seconds) + 1)  # ends[-1]: a rank's clock before its first timed step
    clock = [0.0] * schedule.num_ranks
    steps = zip(replay.ranks, replay.after, replay.arrived, seconds, strict=True)
    for j, (rank, after, arrived, took) in enumerate(steps):
        start = clock[rank]
        for k in after:
            if ends[k] > start:
                start = ends[k]
        for k, send in arrived:
            if ends[k] + hops[send] > start:
                start = ends[k] + hops[send]
        starts[j] = start
        ends[j] = clock[rank] = start + took
    ends.pop()
    timeline = _timeline(schedule, replay, starts, ends, activation_bytes)
    if key is not None:
        known[key] = timeline
    return timeline


#: one step of a played schedule: (rank, action, the steps whose ends it waits for, the sends
#: whose arrivals it waits for, whether it takes its cost, whether it is a send)
Played = tuple[int, Action, tuple[int, ...], tuple[int, ...], bool, bool]


@dataclass(frozen=True)
class _Replay:
    """A schedule's played order, what the simulator replays of it: its timed steps (compute
    and ``REDUCE_GRAD``) as columns, each with the timed steps whose ends it waits for and
    the sends whose arrivals it waits for (the timed step before the send on its rank, -1 for
    none, and the send's number); the sends; and what the timeline reads: each rank's steps
    in its own order (a step: timed ``True`` and its number, or ``False`` and the number of
    the rank's timed step before it), its compute steps, and its changes of micro-batches in
    flight."""

    ranks: tuple[int, ...]
    actions: tuple[Action, ...]
    after: tuple[tuple[int, ...], ...]
    arrived: tuple[tuple[tuple[int, int], ...], ...]
    sends: tuple[Action, ...]
    steps_of: tuple[tuple[tuple[Action, bool, int], ...], ...]
    compute_of: tuple[tuple[int, ...], ...]  # per rank, its compute steps in its order
    #: per rank: (timed step, +1 at its start (a forward) or -1 at its end (what frees), stage)
    changes_of: tuple[tuple[tuple[int, int, int], ...], ...]

    @staticmethod
    def of(schedule: Schedule, order: tuple[Played, ...]) -> _Replay:
        frees = "W" if schedule.split_backward else "B"
        timed_at: dict[int, int] = {}  # played step -> timed step
        before = [-1] * schedule.num_ranks  # each rank's last timed step so far
        send_at: dict[int, tuple[int, int]] = {}  # played send -> (timed before, send number)
        ranks, actions, after, arrived, sends = [], [], [], [], []
        steps_of: list[list] = [[] for _ in range(schedule.num_ranks)]
        compute_of: list[list[int]] = [[] for _ in range(schedule.num_ranks)]
        changes_of: list[list[tuple[int, int, int]]] = [[] for _ in range(schedule.num_ranks)]
        for j, (rank, a, own, sent, timed, send) in enumerate(order):
            if send:
                send_at[j] = (before[rank], len(sends))
                sends.append(a)
            if not timed:
                steps_of[rank].append((a, False, before[rank]))
                continue
            t = timed_at[j] = before[rank] = len(ranks)
            ranks.append(rank)
            actions.append(a)
            after.append(tuple(timed_at[k] for k in own))
            arrived.append(tuple(send_at[k] for k in sent))
            steps_of[rank].append((a, True, t))
            if a.is_compute:
                compute_of[rank].append(t)
                if a.kind in ("F", frees):
                    changes_of[rank].append((t, 1 if a.kind == "F" else -1, a.stage))
        return _Replay(
            tuple(ranks),
            tuple(actions),
            tuple(after),
            tuple(arrived),
            tuple(sends),
            tuple(map(tuple, steps_of)),
            tuple(map(tuple, compute_of)),
            tuple(map(tuple, changes_of)),
        )


def _replayed(schedule: Schedule) -> _Replay:
    """The order in which ranks can run the actions of ``schedule``, each with what it waits
    for; ScheduleError for a dependency out of order or a deadlock. Whether an action can run
    depends only on what ran before it, never on times, so the order is found once per
    schedule (kept in it) and every pricing of it replays the order with its own costs."""
    replay = schedule.found.get("replay")
    if replay is None:
        replay = schedule.found["replay"] = _Replay.of(schedule, _play(schedule))
    return replay


def _play(schedule: Schedule) -> tuple[Played, ...]:
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
            waits = _waits(schedule, rank, a, ends, arrivals, posted)
            if waits is None:
                break
            j, kind = len(order), a.kind
            send = kind == "SEND_F" or kind == "SEND_B"
            if send:
                arrivals[("RECV" + kind[4:], a.peer, a.microbatch)] = j
                ready.append(schedule.placement[a.peer])
            elif kind == "RECV_F" or kind == "RECV_B":
                posted.add((kind, a.stage, a.microbatch))
            else:
                ends[(kind, a.stage, a.microbatch)] = j
            order.append((rank, a, waits[0], waits[1], kind in _TIMED, send))
            position[rank] += 1
    if len(order) < total:
        waiting = [
            f"rank {r} at {schedule.actions[r][position[r]]}"
            for r in range(schedule.num_ranks)
            if position[r] < len(schedule.actions[r])
        ]
        raise ScheduleError(f"{schedule.name} deadlocks: " + "; ".join(waiting))
    return tuple(order)


_TIMED = frozenset(("F", "B", "I", "W", "REDUCE_GRAD"))  # the actions that take their cost


def _waits(
    schedule: Schedule,
    rank: int,
    a: Action,
    ends: dict[Key, int],
    arrivals: dict[tuple[str, int, int], int],
    posted: set[tuple[str, int, int]],
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """What ``a`` waits for: the steps whose ends (on this rank) and the sends whose
    arrivals it needs; None while a send it needs has not run. A dependency that belongs
    earlier on this rank and is not done is a ScheduleError."""
    kind, s, i = a.kind, a.stage, a.microbatch
    if kind == "F":
        return (
            ((), ())
            if s == 0
            else _from(schedule, rank, a, "F", s - 1, "RECV_F", ends, arrivals, posted)
        )
    if kind == "B" or kind == "I":
        own = _own(rank, a, ("F", s, i), ends)
        if s == schedule.num_stages - 1:
            return (own,), ()
        back = "I" if schedule.split_backward else "B"
        other = _from(schedule, rank, a, back, s + 1, "RECV_B", ends, arrivals, posted)
        return None if other is None else ((own, *other[0]), other[1])
    if kind == "W":
        return (_own(rank, a, ("I", s, i), ends),), ()
    if kind == "SEND_F":
        return (_own(rank, a, ("F", s, i), ends),), ()
    if kind == "SEND_B":
        return (_own(rank, a, ("I" if schedule.split_backward else "B", s, i), ends),), ()
    if kind == "REDUCE_GRAD":
        summed = "W" if schedule.split_backward else "B"
        return tuple(_own(rank, a, (summed, s, j), ends) for j in range(schedule.microbatches)), ()
    return (), ()  # a receive is posted: it waits for nothing


def _own(rank: int, a: Action, key: Key, ends: dict[Key, int]) -> int:
    """The step of this rank's ``key`` that ``a`` waits for, which must have run."""
    j = ends.get(key)
    if j is None:
        raise ScheduleError(f"rank {rank} runs {a} before {Action(*key)}, which it needs")
    return j


def _from(schedule, rank, a, kind, stage, recv, ends, arrivals, posted):
    """What ``a`` (on stage ``a.stage``) waits for of the input (kind, stage, a.microbatch)
    makes: its end on this rank, or its arrival, which a receive posted before must be waiting
    for (None: not sent yet)."""
    i, to = a.microbatch, a.stage
    if schedule.placement[stage] == rank:
        return (_own(rank, a, (kind, stage, i), ends),), ()
    if (recv, to, i) not in posted:
        raise ScheduleError(f"rank {rank} runs {a} before it posts {recv}{to}.{i}")
    sent = arrivals.get((recv, to, i))
    return None if sent is None else ((), (sent,))


def _timeline(
    schedule: Schedule,
    replay: _Replay,
    starts: list[float],
    ends: list[float],
    activation_bytes: Callable[[int], float] | None,
) -> Timeline:
    compute = [j for steps in replay.compute_of for j in steps]  # rank by rank, in order
    first = min((starts[j] for j in compute), default=0.0)
    last = max((ends[j] for j in compute), default=0.0)
    span = (last - first) * schedule.num_ranks
    busy = sum(ends[j] - starts[j] for j in compute)
    step = max(ends, default=0.0)  # an untimed step ends on a timed one's end (or at 0)
    # in flight from a forward's start to the end of the backward that frees it
    held_by = [activation_bytes(s) if activation_bytes else 0.0 for s in range(schedule.num_stages)]
    in_flight = [0] * schedule.num_stages
    peak_bytes = [0.0] * schedule.num_ranks
    for rank, changes in enumerate(replay.changes_of):
        held, peak = 0.0, 0.0
        moves = sorted(
            (starts[j] if d > 0 else ends[j], d, s) for j, d, s in changes
        )  # a free at time t comes before a forward starting at t (-1 sorts first)
        counts = [0] * schedule.num_stages
        for _, d, s in moves:
            counts[s] += d
            if counts[s] > in_flight[s]:
                in_flight[s] = counts[s]
            held += d * held_by[s]
            if held > peak:
                peak = held
        peak_bytes[rank] = peak
    return Timeline(
        schedule,
        step,
        1.0 - busy / span if span else 0.0,
        tuple(in_flight),
        tuple(peak_bytes),
        (replay, tuple(starts), tuple(ends)),
    )
