"""The one layer every collective goes through: process groups, ordering, and byte counting.

Groups are given as tuples of global ranks in the order the caller wants chunks in; torch orders
a group's members by ascending global rank, so chunks are permuted here when the two differ.
Groups are created lazily with group-local synchronization, so only members take part in
creating one and ranks outside a pipeline stage never block on it.

Bytes are counted per rank with the ring formulas (from tensor sizes, not wire bytes); the
redistribution planner prices its steps with the same :func:`collective_bytes`, so a test can
assert that what was planned is what was sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard import strict, watch
from autoshard.strict import strict_p2p

__all__ = [
    "all_gather",
    "all_gather_async",
    "all_reduce",
    "all_reduce_",
    "all_reduce_async_",
    "all_to_all",
    "all_to_all_async",
    "all_to_all_v",
    "all_to_all_v_async",
    "all_gather_object",
    "barrier",
    "broadcast_",
    "broadcast_async_",
    "collective_bytes",
    "counters",
    "counting",
    "in_flight",
    "leave",
    "make_groups",
    "OwnGroup",
    "Posted",
    "post_exchange",
    "post_p2p",
    "reduce_scatter",
    "reduce_scatter_async",
    "recording",
    "reset_counters",
    "send_recv",
    "strict_p2p",
]

#: the collectives the counting layer knows
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")

_groups: dict[tuple[int, ...], object] = {}
#: collectives started and not yet waited by what started them (the sum of a loss whose value
#: no one read); :func:`leave` waits them before the process group goes
in_flight: list[dist.Work] = []
_calls: Counter[str] = Counter()
_bytes: Counter[str] = Counter()
_events: list[list] = []  # the open recordings, innermost last


def collective_bytes(kind: str, group_size: int, nbytes: int) -> int:
    """Bytes one rank sends for a collective whose local input has ``nbytes`` (ring formulas)."""
    g = group_size
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}")
    if g <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (g - 1) * nbytes // g
    if kind == "all_gather":
        return (g - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (g - 1) * nbytes // g
    return nbytes  # send_recv, broadcast (the root's bytes, once)


def counters() -> dict[str, dict[str, int]]:
    """Calls and bytes per rank of each collective kind since the last reset, on this rank."""
    return {kind: {"calls": _calls[kind], "bytes": _bytes[kind]} for kind in sorted(_calls)}


def reset_counters() -> None:
    _calls.clear()
    _bytes.clear()


@contextmanager
def counting() -> Iterator[dict[str, dict[str, int]]]:
    """Count the collectives of a block: ``with counting() as c: ...`` then read ``c``."""
    reset_counters()
    result: dict[str, dict[str, int]] = {}
    try:
        yield result
    finally:
        result.update(counters())


@contextmanager
def recording() -> Iterator[list]:
    """The collectives of a block in the order they were issued, as ``(kind, group size,
    bytes sent)`` tuples; the caller may append its own markers to the same list (a test
    interleaves autograd hooks with them to see when a bucket's sum starts)."""
    events: list = []
    _events.append(events)
    try:
        yield events
    finally:
        # by identity: two open recordings may hold equal events
        del _events[next(i for i, e in enumerate(_events) if e is events)]


def _count(kind: str, ranks: Sequence[int], tensor: torch.Tensor, sent: int | None = None) -> tuple:
    """Count the bytes of a collective this rank issues on ``ranks`` (``sent``, else the ring
    formula's for ``tensor``); returns what the watchdog knows it by (:func:`watch.waiting`
    bounds the wait for it)."""
    group_size = len(ranks)
    if sent is None:
        sent = collective_bytes(kind, group_size, tensor.numel() * tensor.element_size())
    _calls[kind] += 1
    _bytes[kind] += sent
    for events in _events:
        events.append((kind, group_size, sent))
    return watch.issued(kind, ranks)


def _group(ranks: Sequence[int]) -> object:
    key = tuple(sorted(ranks))
    if key == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    if key not in _groups:
        with watch.waiting(watch.issued("new_group", key)):  # its members meet in the store
            _groups[key] = dist.new_group(list(key), use_local_synchronization=True)
    return _groups[key]


def make_groups(groups: Sequence[Sequence[int]]) -> None:
    """Make ``groups`` now, every rank of the world calling this with the same list. A group
    made on first use is named by its members and the count of groups each member made before
    it, so members must meet it having made equally many; ranks whose groups are used in an
    order no schedule fixes (a parameter server's pairs of a worker and a server) make them
    all at once here instead."""
    for ranks in groups:
        key = tuple(sorted(ranks))
        if key in _groups or key == tuple(range(dist.get_world_size())):
            continue
        with watch.waiting(watch.issued("new_group", tuple(range(dist.get_world_size())))):
            group = dist.new_group(list(key))
        if dist.get_rank() in key:
            _groups[key] = group


def leave() -> None:
    """Wait what is :data:`in_flight`, then tear down the process group and every group made
    from it, while the interpreter is whole: left to its finalization, gloo's threads can abort
    a process whose run finished (SIGABRT after the last step)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    watch.stop()
    strict.stop()
    while in_flight:
        in_flight.pop(0).wait()
    _groups.clear()
    dist.destroy_process_group()


def _to_sorted(ranks: Sequence[int]) -> list[int] | None:
    """Index permutation from torch's (ascending) member order to ``ranks``; None if the same."""
    ordered = sorted(ranks)
    if list(ranks) == ordered:
        return None
    return [list(ranks).index(r) for r in ordered]


def _from_sorted(ranks: Sequence[int]) -> list[int] | None:
    ordered = sorted(ranks)
    if list(ranks) == ordered:
        return None
    return [ordered.index(r) for r in ranks]


def all_reduce(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Sum of ``x`` over the group, on every member (a new tensor)."""
    what = _count("all_reduce", ranks, x)
    out = x.contiguous().clone()
    group = _group(ranks)
    with watch.waiting(what):
        dist.all_reduce(out, group=group)
    return out


def all_reduce_(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Sum of the contiguous ``x`` over the group, in place."""
    what = _count("all_reduce", ranks, x)
    group = _group(ranks)
    with watch.waiting(what):
        dist.all_reduce(x, group=group)
    return x


def all_reduce_async_(x: torch.Tensor, ranks: Sequence[int]) -> dist.Work:
    """Start the sum of the contiguous ``x`` over the group, in place; ``x`` belongs to the
    collective until the returned work's ``wait()``."""
    what = _count("all_reduce", ranks, x)
    return watch.Watched(dist.all_reduce(x, group=_group(ranks), async_op=True), what)


def broadcast_(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """``ranks[0]``'s contiguous ``x`` on every member of the group, in place."""
    what = _count("broadcast", ranks, x)
    group = _group(ranks)
    with watch.waiting(what):
        dist.broadcast(x, src=ranks[0], group=group)
    return x


def broadcast_async_(x: torch.Tensor, ranks: Sequence[int]) -> dist.Work:
    """Start sending ``ranks[0]``'s contiguous ``x`` to every member, in place; ``x``
    belongs to the collective until the returned work's ``wait()``."""
    what = _count("broadcast", ranks, x)
    return watch.Watched(dist.broadcast(x, src=ranks[0], group=_group(ranks), async_op=True), what)


def all_reduce_max(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Elementwise max of ``x`` over the group, on every member (a new tensor)."""
    what = _count("all_reduce", ranks, x)
    out = x.contiguous().clone()
    group = _group(ranks)
    with watch.waiting(what):
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def all_gather(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Every member's ``x`` stacked along a new leading dim, in the order of ``ranks``."""
    what = _count("all_gather", ranks, x)
    flat = x.contiguous().reshape(-1)
    out = torch.empty(len(ranks) * flat.numel(), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    group = _group(ranks)
    with watch.waiting(what):
        gather(out, flat, group=group)
    out = out.reshape(len(ranks), *x.shape)
    order = _from_sorted(ranks)
    return out if order is None else out[order]


def all_gather_async(out: torch.Tensor, x: torch.Tensor, ranks: Sequence[int]) -> dist.Work:
    """Start gathering every member's contiguous ``x`` into ``out`` (the group size times its
    elements, members in ascending rank order); both belong to the collective until ``wait()``."""
    what = _count("all_gather", ranks, x)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return watch.Watched(gather(out, x, group=_group(ranks), async_op=True), what)


def reduce_scatter_async(out: torch.Tensor, x: torch.Tensor, ranks: Sequence[int]) -> dist.Work:
    """Start summing the contiguous ``x`` (the group size times ``out``'s elements) over the
    group, leaving chunk ``i`` on the ``i``-th member in ascending rank order in ``out``."""
    what = _count("reduce_scatter", ranks, x)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return watch.Watched(scatter(out, x, group=_group(ranks), async_op=True), what)


def all_to_all(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """``x[i]`` goes to ``ranks[i]``; the result's ``[j]`` came from ``ranks[j]``."""
    what = _count("all_to_all", ranks, x)
    order = _to_sorted(ranks)
    x = (x if order is None else x[order]).contiguous()
    out = torch.empty_like(x)
    group = _group(ranks)
    with watch.waiting(what):
        dist.all_to_all_single(out, x, group=group)
    back = _from_sorted(ranks)
    return out if back is None else out[back]


def all_to_all_async(out: torch.Tensor, x: torch.Tensor, ranks: Sequence[int]) -> dist.Work:
    """Start sending the contiguous ``x[i]`` to the ``i``-th member in ascending rank order,
    ``out[j]`` receiving the ``j``-th's; both belong to the collective until ``wait()``."""
    what = _count("all_to_all", ranks, x)
    return watch.Watched(dist.all_to_all_single(out, x, group=_group(ranks), async_op=True), what)


def all_to_all_v(
    x: torch.Tensor, send: Sequence[int], recv: Sequence[int], ranks: Sequence[int]
) -> torch.Tensor:
    """Uneven all-to-all along dim 0 over ``ranks`` (ascending): the first ``send[0]`` rows of
    ``x`` go to ``ranks[0]``, the next ``send[1]`` to ``ranks[1]``...; the result holds
    ``recv[j]`` rows from ``ranks[j]`` in that order. Counted as the bytes this rank sends to
    the others (its own rows stay), which is what the ring formula gives for even parts."""
    return all_to_all_v_async(x, send, recv, ranks)()


def all_to_all_v_async(
    x: torch.Tensor, send: Sequence[int], recv: Sequence[int], ranks: Sequence[int]
) -> Callable[[], torch.Tensor]:
    """``all_to_all_v`` issued now; what returns waits for it and gives the result."""
    ranks = list(ranks)
    assert ranks == sorted(ranks), "all_to_all_v takes its group in ascending rank order"
    me = ranks.index(dist.get_rank())
    row = x[0].numel() * x.element_size() if x.dim() else x.element_size()
    what = _count("all_to_all", ranks, x, (sum(send) - send[me]) * row)
    out = torch.empty((sum(recv), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if len(ranks) == 1:
        out.copy_(x)
        return lambda: out
    x = x.contiguous()  # held by the closure until the wait
    work = dist.all_to_all_single(
        out, x, list(recv), list(send), group=_group(ranks), async_op=True
    )
    watched = watch.Watched(work, what)
    return lambda: (watched.wait(), x, out)[2]


def reduce_scatter(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Sum over the group of ``x[i]``, left on ``ranks[i]``; ``x`` has a leading dim of the
    group size."""
    what = _count("reduce_scatter", ranks, x)
    order = _to_sorted(ranks)
    x = (x if order is None else x[order]).contiguous()
    out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    group = _group(ranks)
    with watch.waiting(what):
        scatter(out, x.reshape(-1), group=group)
    return out.reshape(x.shape[1:])


def send_recv(
    x: torch.Tensor | None,
    send_to: Sequence[int],
    recv_from: int | None,
    recv_like: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Point-to-point moves (a pipeline stage boundary, a pairwise exchange): send ``x`` to each
    rank of ``send_to`` and receive a tensor shaped like ``recv_like`` from ``recv_from``, as
    one group, waited for."""
    me = dist.get_rank()
    sends, recvs = [], []
    out = None
    for peer in send_to:
        if peer == me:
            out = x.clone()
            continue
        sends.append((x, peer))
    if recv_from is not None and recv_from != me:
        assert recv_like is not None, "a receive needs the shape it expects"
        # contiguous whatever ``recv_like``'s strides (a transposed view): gloo needs it
        out = torch.empty(recv_like.shape, dtype=recv_like.dtype, device=recv_like.device)
        recvs.append((out, recv_from))
    if sends or recvs:
        post_p2p(sends, recvs).wait()
    return out


class Posted:
    """Sends and receives posted together; ``wait()`` completes them (the tensors they read
    and write are kept alive until then)."""

    def __init__(self, works: list, whats: list, tensors: list[torch.Tensor]) -> None:
        self._works, self._whats, self._tensors = works, whats, tensors

    def wait(self) -> None:
        for work, what in zip(self._works, self._whats, strict=True):
            with watch.waiting(what):
                work.wait()
        self._works, self._whats, self._tensors = [], [], []


def post_exchange(
    tensors: Sequence[torch.Tensor], to: int, source: int, ranks: Sequence[int]
) -> tuple[Posted, list[torch.Tensor]]:
    """Send each of ``tensors`` to rank ``to`` and receive its like from ``source``, each as one
    all-to-all over ``ranks`` that every member posts in the same order with its own peers (a
    ring's step, a pairwise swap; a rank may be its own peer). Returns them posted, and the
    tensors they receive into. gloo overlaps such an all-to-all with compute better than a
    point-to-point pair (4 MiB each way beside 25 ms of matmuls: 2-4 ms added against 5-9 ms)."""
    me, group = dist.get_rank(), sorted(ranks)
    works, whats, kept, got = [], [], [], []
    for x in tensors:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        got.append(out)
        if len(group) == 1:
            out.copy_(x)
            continue
        send, recv = [0] * len(group), [0] * len(group)
        send[group.index(to)], recv[group.index(source)] = x.numel(), out.numel()
        flat = x.contiguous().reshape(-1)
        whats.append(
            _count("send_recv", (me, to), x) if to != me else watch.issued("send_recv", (me, me))
        )
        works.append(
            dist.all_to_all_single(
                out.reshape(-1), flat, recv, send, group=_group(group), async_op=True
            )
        )
        kept += [flat, out]
    return Posted(works, whats, kept), got


def post_p2p(
    sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
) -> Posted:
    """Post point-to-point sends of each (tensor, peer) and receives into each (tensor, peer)
    as one group (a pipeline step's ``SEND``/``RECV`` actions between two computes); nothing
    waits for them here. Under :func:`strict_p2p` the group keeps NCCL's order
    (``autoshard.strict``). The sender counts a send under the pair and the receiver its
    receive, so both sides number their messages alike."""
    me = dist.get_rank()
    whats = []
    sends = [(x.contiguous(), peer) for x, peer in sends]
    for x, peer in sends:
        whats.append(_count("send_recv", (me, peer), x))
    for _, peer in recvs:
        whats.append(watch.issued("send_recv", (me, peer)))
    kept = [x for x, _ in sends] + [out for out, _ in recvs]
    if whats and strict.enabled():
        return Posted([strict.post(sends, recvs, whats[0])], [whats[0]], kept)
    ops = [dist.P2POp(dist.isend, x, peer) for x, peer in sends]
    ops += [dist.P2POp(dist.irecv, out, peer) for out, peer in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    return Posted(list(works), whats, kept)


def barrier(ranks: Sequence[int] | None = None) -> None:
    """Every member of ``ranks`` (default: the world) has reached this point."""
    ranks = list(range(dist.get_world_size())) if ranks is None else ranks
    what = watch.issued("barrier", ranks)
    group = _group(ranks)
    with watch.waiting(what):
        dist.barrier(group=group)


def all_gather_object(obj: object, ranks: Sequence[int] | None = None) -> list:
    """Every member's picklable ``obj``, in ascending rank order (default group: the world)."""
    ranks = list(range(dist.get_world_size())) if ranks is None else ranks
    what = watch.issued("all_gather_object", ranks)
    everyone: list = [None] * len(ranks)
    group = _group(ranks)
    with watch.waiting(what):
        dist.all_gather_object(everyone, obj, group=group)
    return everyone


class OwnGroup:
    """A gloo group of ``ranks`` made from ``store`` under ``prefix`` by its members alone,
    outside torch's registry of groups: a member that restarts makes it again with its peers
    under a new prefix (a parameter server's worker coming back), which a group of torch's
    world cannot do. ``rank`` is this process's global rank."""

    def __init__(
        self, store: dist.Store, prefix: str, ranks: Sequence[int], rank: int, timeout_s: float
    ) -> None:
        self.ranks = tuple(ranks)
        self.rank = rank
        with watch.waiting(watch.issued("new_group", self.ranks)):
            self.group = dist.ProcessGroupGloo(
                dist.PrefixStore(prefix, store),
                self.ranks.index(rank),
                len(self.ranks),
                timedelta(seconds=timeout_s),
            )

    def broadcast_async_(self, x: torch.Tensor, source: int) -> watch.Watched:
        """Start sending rank ``source``'s contiguous ``x`` to every member, in place."""
        what = _count("broadcast", self.ranks, x)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = self.ranks.index(source), 0
        return watch.Watched(self.group.broadcast([x], options), what)

    def broadcast_(self, x: torch.Tensor, source: int) -> torch.Tensor:
        """Rank ``source``'s contiguous ``x`` on every member, in place."""
        self.broadcast_async_(x, source).wait()
        return x
