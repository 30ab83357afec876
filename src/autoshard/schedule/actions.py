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
  waits for it, and sends are complete before the step ends.
- ``REDUCE_GRAD``: the stage's gradient sums over its data-parallel replicas (and over the
  stages that share a tied weight), after its last backward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
    """The schedule whose ranks run ``compute`` in order, with every send placed right after
    the compute that makes its tensor, every receive posted one compute action before the
    one that reads it (so it arrives while that one runs), and each stage's gradient sums
    after its last backward."""
    last = len(placement) - 1
    lists: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute):
        out: list[Action] = []
        for a in order:
            recv = _receive_for(a, placement, rank, last)
            if recv is not None:  # posted before the compute action before this one
                out.insert(_previous_compute(out), recv)
            out.append(a)
            send = _send_for(a, placement, rank, last)
            if send is not None:
                out.append(send)
        lists.append(tuple(_with_reduce_grad(out)))
    return Schedule(name, microbatches, tuple(placement), tuple(lists), split_backward)


def _with_reduce_grad(out: list[Action]) -> list[Action]:
    """``REDUCE_GRAD`` of each stage after its last backward (and that backward's send)."""
    last_backward = {a.stage: i for i, a in enumerate(out) if a.kind in ("B", "W")}
    for stage, i in sorted(last_backward.items(), key=lambda item: -item[1]):
        at = i + 1
        if at < len(out) and out[at].kind == "SEND_B" and out[at].stage == stage:
            at += 1
        out.insert(at, Action("REDUCE_GRAD", stage))
    return out


def _previous_compute(out: list[Action]) -> int:
    for i in range(len(out) - 1, -1, -1):
        if out[i].is_compute:
            return i
    return 0


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
