"""The named schedules: the compute order of every rank, made into a Schedule with its sends,
receives and gradient sums by ``with_communication``.

``gpipe``, ``1f1b`` and ``interleaved-1f1b`` are written out by their rules (all forwards then
all backwards; at most ``p - r`` micro-batches in flight on rank ``r``; Megatron's interleaved
order over ``v`` looped stages). The zero-bubble schedules (``zb-h1``, ``zbv``) are made the way
their paper makes them: a list scheduler plays the pipeline with nominal costs (a forward, a
backward for inputs and one for weights each one unit) and each rank, when it is free, runs the
first ready action of: backward for inputs, forward (while the micro-batches it holds stay under
a bound: 1F1B's peak), backward for weights. Weight gradients, which nothing waits for, fill
what would be bubbles. Under ZB-H1 the first stage's backward runs whole at the weights' turn
(nothing waits for its inputs' half), which gives torch's ZB-H1 order.
"""

from __future__ import annotations

from collections.abc import Callable

from autoshard.schedule.actions import (
    Action,
    Schedule,
    ScheduleError,
    looped,
    v_shape,
    with_communication,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")


def make_schedule(name: str, num_ranks: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule ``name`` for ``num_ranks`` pipeline ranks and ``microbatches`` micro-
    batches; ``virtual``: stages per rank for ``interleaved-1f1b`` (``zbv`` always has 2)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    if num_ranks < 1 or microbatches < 1:
        raise ScheduleError(
            f"schedule {name}: {num_ranks} pipeline ranks and {microbatches} micro-batches; "
            "both must be at least 1"
        )
    if virtual != 1 and name != "interleaved-1f1b":
        raise ScheduleError(f"schedule {name} has no virtual stages (virtual={virtual})")
    builders: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: _gpipe(num_ranks, microbatches),
        "1f1b": lambda: _one_f_one_b(num_ranks, microbatches),
        "interleaved-1f1b": lambda: _interleaved(num_ranks, microbatches, virtual),
        "zb-h1": lambda: _zero_bubble("zb-h1", num_ranks, microbatches, looped(num_ranks, 1)),
        "zbv": lambda: _zero_bubble("zbv", num_ranks, microbatches, v_shape(num_ranks)),
    }
    return builders[name]()


def _gpipe(p: int, m: int) -> Schedule:
    compute = [
        [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]
        for r in range(p)
    ]
    return with_communication("gpipe", m, looped(p, 1), compute, False)


def _one_f_one_b(p: int, m: int) -> Schedule:
    compute = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", r, warmup + i), Action("B", r, i)]
        order += [Action("B", r, i) for i in range(m - warmup, m)]
        compute.append(order)
    return with_communication("1f1b", m, looped(p, 1), compute, False)


def _interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's order: forwards go over the looped stages ``p`` micro-batches at a time,
    backwards the same way from the last loop; rank ``r`` warms up with
    ``2 (p - r - 1) + (v - 1) p`` forwards."""
    if v < 2:
        raise ScheduleError(f"interleaved-1f1b needs at least 2 virtual stages a rank, not {v}")
    if m % p:
        raise ScheduleError(
            f"interleaved-1f1b: {m} micro-batches is not a multiple of the {p} pipeline ranks; "
            f"use {m + p - m % p} (its forwards go over the loops {p} micro-batches at a time)"
        )
    total = m * v

    def action(kind: str, k: int, r: int) -> Action:
        loop = (k // p) % v
        if kind == "B":
            loop = v - 1 - loop
        return Action(kind, loop * p + r, (k // (p * v)) * p + k % p)

    compute = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [action("F", k, r) for k in range(warmup)]
        for j in range(total - warmup):
            order += [action("F", warmup + j, r), action("B", j, r)]
        order += [action("B", j, r) for j in range(total - warmup, total)]
        compute.append(order)
    return with_communication("interleaved-1f1b", m, looped(p, v), compute, False)


def _zero_bubble(name: str, p: int, m: int, placement: tuple[int, ...]) -> Schedule:
    # 1F1B holds p - r micro-batches on rank r. ZB-H1 lets every rank but the first hold one
    # more (a backward for inputs frees most of what a micro-batch keeps, and no rank holds
    # more than the first's p, 1F1B's peak), so a weight half waits behind the next input
    # half; on a V every rank holds p
    admit = [p] * p if name == "zbv" else [p] + [p - r + 1 for r in range(1, p)]
    # on a V the first stage's rank also receives the last stage's forwards from rank 1:
    # moving its backward there would cross them on that link
    compute = list_schedule(p, m, placement, admit, first_whole=name == "zb-h1")
    return with_communication(name, m, placement, compute, True)


def list_schedule(
    p: int, m: int, placement: tuple[int, ...], admit: list[int], first_whole: bool = False
) -> list[list[Action]]:
    """Each rank's order of F, I and W when the pipeline is played with unit costs and every
    free rank takes the first ready of: I, F (the latest stage first; a new micro-batch
    enters the rank only while fewer than ``admit[r]`` are in it), W. ``first_whole``: the
    first stage's inputs need no gradient, so nothing waits for its I (the runtime leaves it
    empty and runs the whole backward in W): its I and W run together, two units, with W's
    rank, and the rank runs a forward meanwhile rather than wait for the gradient that
    backward needs (torch's ZB-H1 order)."""
    stages = len(placement)
    last = stages - 1
    done: dict[tuple[str, int, int], int] = {}  # action -> the tick it ends
    busy_until = [0] * p
    next_mb = {(kind, s): 0 for kind in "FIW" for s in range(stages)}
    held: list[set[int]] = [set() for _ in range(p)]  # micro-batches in the rank, not finished
    own = [[s for s in range(stages) if placement[s] == r] for r in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = 3 * stages * m

    def ready(kind: str, s: int, tick: int) -> int | None:
        i = next_mb[(kind, s)]
        if i >= m:
            return None
        if kind == "F":
            ok = s == 0 or done.get(("F", s - 1, i), tick + 1) <= tick
        elif kind == "I":
            ok = done.get(("F", s, i), tick + 1) <= tick and (
                s == last or done.get(("I", s + 1, i), tick + 1) <= tick
            )
        else:
            ok = done.get(("I", s, i), tick + 1) <= tick
        return i if ok else None

    tick = 0
    while len(done) < total:
        for r in range(p):
            if busy_until[r] > tick:
                continue
            choice = _choose(r, tick, own[r], held[r], admit[r], ready, first_whole)
            if choice is None:
                continue
            kinds, s, i = choice
            for kind in kinds:
                busy_until[r] = tick + 1 if kind == kinds[0] else busy_until[r] + 1
                done[(kind, s, i)] = busy_until[r]
                next_mb[(kind, s)] += 1
                orders[r].append(Action(kind, s, i))
            if kinds == "F" and s == own[r][0]:
                held[r].add(i)
            if kinds[-1] == "W" and s == own[r][0]:  # its backward is through the rank
                held[r].discard(i)
        tick += 1
        if tick > 4 * total + 4 * stages:
            raise ScheduleError(f"list schedule of {p} ranks, {m} micro-batches is stuck")
    return orders


def _choose(
    r: int,
    tick: int,
    own: list[int],
    held: set[int],
    admit: int,
    ready: Callable[[str, int, int], int | None],
    first_whole: bool,
) -> tuple[str, int, int] | None:
    for s in reversed(own):
        i = ready("I", s, tick)
        if i is not None and not (first_whole and s == 0):
            return "I", s, i
    for s in reversed(own):
        i = ready("F", s, tick)
        if i is not None and (s != own[0] or len(held) < admit):
            return "F", s, i
    for s in reversed(own):
        kind = "IW" if first_whole and s == 0 else "W"  # the first stage's whole backward
        i = ready(kind[0], s, tick)
        if i is not None:
            return kind, s, i
    return None
