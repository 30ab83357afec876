"""A pipeline schedule as data: per pipeline rank, the ordered list of actions it runs.

The same list is what the runtime executes and what the simulator times, so a schedule drawn
is a schedule run. Stages are numbered from the model's input to its loss; ``placement[s]`` is
the pipeline rank (the coordinate on the ``pp`` axis) that holds stage ``s``. A rank may hold
several stages (virtual stages: interleaved 1F1B loops them, ZB-V folds them into a V).

Kinds of action (``Action.kind``):

- ``F``: the forward of one micro-batch through one stage.
- ``B``: its whole backward; or split in two, ``I`` (the gradient of the stage's inputs,
  what the stage before waits for) and ``W`` (the gradient of its weights, which nothing
  waits for until the optimizer).
- ``SEND_F``/``RECV_F``: a stage's output to the next stage's rank, and its arrival there;
  ``SEND_B``/``RECV_B``: the gradient of a stage's input back to the previous stage's rank.
  A send or a receive is posted, not waited for: the compute that reads a received tensor
  waits for it, and sends are complete before the step ends. The sends and receives between
  two other actions are one group, posted together (:func:`p2p_groups`): NCCL runs a rank's
  groups in order and a send waits for its receiver, so both sides of a pair must post
  matching groups in the same order (``simulate.check_p2p_order``).
- ``REDUCE_GRAD``: the stage's gradient sums over its data-parallel replicas (and over the
  stages that share a tied weight), after its last backward.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

COMPUTE = ("F", "B", "I", "W")
COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = (*COMPUTE, *COMM, "REDUCE_GRAD")


class ScheduleError(ValueError):
    """A schedule that cannot run: a missing or repeated action, a dependency out of order,
    sends and receives that do not match, or ranks that would wait for each other forever."""


@dataclass(frozen=True, order=True)
class Action:
    """One action of one rank: ``kind`` on ``stage`` for ``microbatch`` (``-1`` for
    ``REDUCE_GRAD``, which is once per step). ``peer`` is the stage a send goes to or a
    receive comes from."""

    kind: str
    stage: int
    microbatch: int = -1
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"unknown action kind {self.kind!r}; expected one of {KINDS}")

    def __str__(self) -> str:
        if self.kind == "REDUCE_GRAD":
            return f"REDUCE_GRAD{self.stage}"
        text = f"{self.kind}{self.stage}.{self.microbatch}"
        return (
            text if self.peer is None else f"{text}{'>' if 'SEND' in self.kind else '<'}{self.peer}"
        )

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE


@dataclass(frozen=True)
class Schedule:
    """``actions[r]``: what pipeline rank ``r`` runs, in order. ``split_backward``: backwards
    are ``I`` then ``W`` (zero-bubble schedules) instead of ``B``."""

    name: str
    microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    notes: dict[str, str] = field(default_factory=dict, compare=False)
    #: what pricing found of this schedule (the order its ranks can run in), kept with it so
    #: that it lives as long as whoever holds the schedule (a search) and no longer
    found: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_ranks(self) -> int:
        return len(self.actions)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.placement) if r == rank]

    def compute(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def __iter__(self) -> Iterator[tuple[int, Action]]:
        for rank, actions in enumerate(self.actions):
            for action in actions:
                yield rank, action

    def __str__(self) -> str:
        width = len(str(self.num_ranks - 1))
        lines = [
            f"{self.name}: {self.num_stages} stages on {self.num_ranks} ranks, "
            f"{self.microbatches} micro-batches"
        ]
        for rank in range(self.num_ranks):
            lines.append(f"  rank {rank:>{width}}: " + " ".join(map(str, self.compute(rank))))
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "microbatches": self.microbatches,
            "placement": list(self.placement),
            "split_backward": self.split_backward,
            "actions": [[str(a) for a in actions] for actions in self.actions],
        }

    @staticmethod
    def from_json(data: dict) -> Schedule:
        return Schedule(
            data["name"],
            int(data["microbatches"]),
            tuple(data["placement"]),
            tuple(tuple(parse_action(t) for t in actions) for actions in data["actions"]),
            bool(data.get("split_backward", False)),
        )


def parse_action(text: str) -> Action:
    """The action ``str(action)`` wrote: ``F3.1``, ``SEND_F3.1>4``, ``REDUCE_GRAD2``."""
    if text.startswith("REDUCE_GRAD"):
        return Action("REDUCE_GRAD", int(text[len("REDUCE_GRAD") :]))
    for kind in sorted(KINDS, key=len, reverse=True):
        if text.startswith(kind) and text[len(kind) : len(kind) + 1].isdigit():
            rest, peer = text[len(kind) :], None
            for mark in "<>":
                if mark in rest:
                    rest, other = rest.split(mark)
                    peer = int(other)
            stage, microbatch = rest.split(".")
            return Action(kind, int(stage), int(microbatch), peer)
    raise ScheduleError(f"cannot read action {text!r}")


def looped(num_ranks: int, virtual: int) -> tuple[int, ...]:
    """Stage ``s`` on rank ``s % num_ranks``: each rank holds ``virtual`` stages, one per loop
    (interleaved 1F1B)."""
    return tuple(s % num_ranks for s in range(num_ranks * virtual))


def v_shape(num_ranks: int) -> tuple[int, ...]:
    """Two stages a rank: stage ``r`` down and ``2p - 1 - r`` back up, so the first and the
    last stage share rank 0 (ZB-V, DualPipeV)."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def with_communication(
    name: str,
    microbatches: int,
    placement: Sequence[int],
    compute: Sequence[Sequence[Action]],
    split_backward: bool,
) -> Schedule:
    """The schedule whose ranks run ``compute`` in order, each send right after the compute
    that makes its tensor, each stage's gradient sums after the group that follows its last
    backward. A receive is posted where its rank's clock stands when the tensor is sent, the
    pipeline played at nominal costs (:func:`_posted_at`): between two compute actions a rank
    then posts one group, its send (if any) and the receives of the tensors sent meanwhile
    (the one the next compute reads among them: Megatron's ``send_forward_recv_backward``),
    and every pair of ranks meets their sends and receives in the same order of sending
    times, which NCCL's in-order groups need."""
    last = len(placement) - 1
    ends = _compute_ends(placement, compute, split_backward)
    lists: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute):
        played = _played(order, ends)
        posted: dict[int, list[tuple[float, Action]]] = {}
        for k, a in enumerate(order):
            recv = _receive_for(a, placement, rank, last)
            if recv is not None:
                sent = ends.get(_made_by(recv, split_backward))
                at = _posted_at(played, k, sent)
                posted.setdefault(at, []).append((sent or 0.0, recv))
        out = [recv for _, recv in sorted(posted.get(-1, []))]
        for k, a in enumerate(order):
            out.append(a)
            send = _send_for(a, placement, rank, last)
            if send is not None:
                out.append(send)
            out += [recv for _, recv in sorted(posted.get(k, []))]
        lists.append(tuple(_with_reduce_grad(out)))
    return Schedule(name, microbatches, tuple(placement), tuple(lists), split_backward)


#: nominal costs of the compute actions, which order the sends and receives of a schedule
_NOMINAL = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def _made_by(recv: Action, split_backward: bool) -> tuple[str, int, int]:
    """The compute action whose tensor ``recv`` receives."""
    if recv.kind == "RECV_F":
        return ("F", recv.peer, recv.microbatch)
    return ("I" if split_backward else "B", recv.peer, recv.microbatch)


def _compute_ends(
    placement: Sequence[int], compute: Sequence[Sequence[Action]], split_backward: bool
) -> dict[tuple[str, int, int], float]:
    """When each compute action ends with the ranks running ``compute`` in order at nominal
    costs, tensors arriving at once; an action behind one that can never run is left out
    (the validator names that)."""
    last = len(placement) - 1
    back = "I" if split_backward else "B"
    ends: dict[tuple[str, int, int], float] = {}
    at, clock = [0] * len(compute), [0.0] * len(compute)
    moved = True
    while moved:  # (a rank's needs read inline: this runs for every action of every rank)
        moved = False
        for r, order in enumerate(compute):
            k, now = at[r], clock[r]
            while k < len(order):
                kind, stage, microbatch = order[k].kind, order[k].stage, order[k].microbatch
                if kind == "F":
                    needs = (("F", stage - 1, microbatch),) if stage > 0 else ()
                else:
                    needs = (("I" if kind == "W" else "F", stage, microbatch),)
                    if kind != "W" and stage < last:
                        needs += ((back, stage + 1, microbatch),)
                start = now
                for n in needs:
                    end = ends.get(n)
                    if end is None:
                        break
                    start = max(start, end)
                else:
                    now = ends[(kind, stage, microbatch)] = start + _NOMINAL[kind]
                    k += 1
                    continue
                break
            moved |= k > at[r]
            at[r], clock[r] = k, now
    return ends


def _played(order: Sequence[Action], ends: dict[tuple[str, int, int], float]) -> list[float]:
    """When each of ``order``'s compute actions ends, as far as the rank played them: a rank
    plays its actions in order, so the played ones are a prefix and their ends increase."""
    played = []
    for a in order:
        end = ends.get((a.kind, a.stage, a.microbatch))
        if end is None:
            break
        played.append(end)
    return played


def _posted_at(played: Sequence[float], k: int, sent: float | None) -> int:
    """After which of a rank's compute actions (-1: before the first) the receive that its
    ``k``-th action reads is posted: the last to end by the time its tensor is ``sent``, or,
    the ``k``-th unplayed, the one before it. ``played`` (:func:`_played`) increases, so a
    bisection finds it: a scan from the start made a schedule of 512 micro-batches on 64
    ranks cost a minute."""
    if sent is None or k >= len(played):
        return k - 1
    return min(k, bisect.bisect_right(played, sent)) - 1


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone (an evaluation, a step without gradients): each
    rank's stages in order for one micro-batch after another, with their sends and
    receives."""
    compute = [
        [Action("F", s, i) for i in range(schedule.microbatches) for s in schedule.stages_of(r)]
        for r in range(schedule.num_ranks)
    ]
    return with_communication(
        f"{schedule.name} forwards", schedule.microbatches, schedule.placement, compute, False
    )


def p2p_groups(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
    """``actions`` as the runtime posts them: every action that is not a send or a receive
    alone, and each run of sends and receives between two others as one group (a tuple)."""
    out: list[Action | tuple[Action, ...]] = []
    group: list[Action] = []
    for a in actions:
        if a.kind in COMM:
            group.append(a)
            continue
        if group:
            out.append(tuple(group))
            group = []
        out.append(a)
    if group:
        out.append(tuple(group))
    return out


def _with_reduce_grad(out: list[Action]) -> list[Action]:
    """``REDUCE_GRAD`` of each stage after its last backward and the group after it (a sum
    between a send and a receive would cut their group in two)."""
    last_backward = {a.stage: i for i, a in enumerate(out) if a.kind in ("B", "W")}
    for stage, i in sorted(last_backward.items(), key=lambda item: -item[1]):
        at = i + 1
        while at < len(out) and out[at].kind in COMM:
            at += 1
        out.insert(at, Action("REDUCE_GRAD", stage))
    return out


def _receive_for(a: Action, placement: Sequence[int], rank: int, last: int) -> Action | None:
    if a.kind == "F" and a.stage > 0 and placement[a.stage - 1] != rank:
        return Action("RECV_F", a.stage, a.microbatch, a.stage - 1)
    if a.kind in ("B", "I") and a.stage < last and placement[a.stage + 1] != rank:
        return Action("RECV_B", a.stage, a.microbatch, a.stage + 1)
    return None


def _send_for(a: Action, placement: Sequence[int], rank: int, last: int) -> Action | None:
    if a.kind == "F" and a.stage < last and placement[a.stage + 1] != rank:
        return Action("SEND_F", a.stage, a.microbatch, a.stage + 1)
    if a.kind in ("B", "I") and a.stage > 0 and placement[a.stage - 1] != rank:
        return Action("SEND_B", a.stage, a.microbatch, a.stage - 1)
    return None
