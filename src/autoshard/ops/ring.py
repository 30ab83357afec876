"""Ring attention: attention over a sequence split across ranks, exact, without gathering it.

Each rank of a ring holds a block of the queries, keys and values. The key/value blocks pass
around the ring, one step per rank; every rank folds each block it sees into its rows' output by
the online softmax (a running row max and sum, rescaled as blocks arrive), and keeps the rows'
log-sum-exp for backward. The next block's send and receive are posted before the current block
is computed, so they overlap it. Backward passes the blocks around again, each with the key and
value gradients accumulated for it so far, which end on the block's owner.

Under a causal mask a plain split leaves the last rank the most work (its rows see every key).
``balanced`` rings give each rank the query rows of two half-blocks of the sequence, chunk ``2i``
(its own first half) and chunk ``2n-1-2i`` of ``2n``, so every rank does the same work: the op
swaps the second half with rank ``n-1-i`` on entry, overlapped with the kept rows' first
products, and the output back on exit, so the layouts outside the op stay a contiguous split
(docs/parallelism/sequence.md); the keys and values travel in their blocks. Chunks of keys
wholly after a chunk of queries are skipped, and on CPU a long causal product is cut in halves
(``LEAF``), which the CPU kernel computes faster than it computes the product whole; CUDA's
kernels skip the masked tiles themselves and take it whole. Every product runs the fused
kernel ``blocks.kernel`` picks, its causal diagonal through the kernel's own flag.

A ``striped`` sequence needs no such move: rank ``r`` holds positions ``r, r + n, r + 2n, ...``
(a layout whose sequence dim is split by its minor factor: the inputs given that layout, every
activation keeps it). Its rows against any rank's keys are a causal product, with the
diagonal (keys of an earlier or the same rank) or below it (a later rank's), so every step
costs every rank half a block. Cut in halves, those products run about as fast as dealt
blocks on CPU; the default split stays in blocks, as users feed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoshard import comm
from autoshard.ops import blocks

__all__ = ["Ring", "causal_rows_attention", "ring_attention"]


@dataclass(frozen=True)
class Ring:
    """The ranks holding the sequence's blocks, in sequence order; this rank's place in it;
    the rows a rank holds; whether chunks are dealt for a causal balance. A ring of one rank
    with ``start`` and ``keys`` set is a rank's rows from ``start`` against all ``keys``
    keys held here (the all-gather method)."""

    ranks: tuple[int, ...]
    index: int
    rows: int
    balanced: bool
    start: int = 0
    keys: int | None = None
    striped: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def steps(self) -> int:
        """Blocks of keys a rank folds in: one per ring position, or one when all are here."""
        return 1 if self.keys is not None else self.size

    def query_chunks(self) -> list[tuple[int, int, int]]:
        """(local row offset, global position, length) of this rank's query rows inside the
        op: its contiguous block, or its two dealt chunks when balanced."""
        if not self.balanced:
            start = self.start if self.keys is not None else self.index * self.rows
            return [(0, start, self.rows)]
        half = self.rows // 2
        mine = sorted({2 * self.index, 2 * self.size - 1 - 2 * self.index})
        return [(i * half, chunk * half, half) for i, chunk in enumerate(mine)]

    def chunks(self, block: int) -> list[tuple[int, int, int]]:
        """The chunks of keys ring position ``block`` holds inside the op; all keys here are
        cut where the query chunks begin and end (before them all seen, beside them causal,
        after them skipped)."""
        if self.keys is None:  # a block's keys in two halves when balanced (rows are dealt)
            if not self.balanced:
                return [(0, block * self.rows, self.rows)]
            half = self.rows // 2
            return [(0, 2 * block * half, half), (half, (2 * block + 1) * half, half)]
        ends = {p for _, pos, n in self.query_chunks() for p in (pos, pos + n)}
        cuts = sorted({0, self.keys} | ends)
        return [(a, a, b - a) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]

    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


# -- moving the halves for balance ----------------------------------------------------------------


class _Swap:
    """Half of a tensor's rows (dim -2) exchanged with the ring's partner, rank ``n-1-i``:
    from the contiguous split (rank ``i`` holds chunks ``2i``, ``2i+1`` of ``2n``) to the
    dealt one (chunks ``2i`` and ``2n-1-2i``, in sequence order), or back when ``inverse``.
    Chunk ``2i`` stays (``kept``, at row ``offset`` of the dealt order); the exchange is
    posted on creation, so work on the kept rows overlaps it, and ``done`` waits for it."""

    def __init__(self, x: torch.Tensor, ring: Ring, inverse: bool) -> None:
        half = x.shape[-2] // 2
        self.offset = 0 if 4 * ring.index < 2 * ring.size - 1 else half
        self.inverse = inverse
        if inverse:
            self.kept = x[..., self.offset : self.offset + half, :]
            given = x[..., half - self.offset : 2 * half - self.offset, :]
        else:
            self.kept, given = x[..., :half, :], x[..., half:, :]
        partner = ring.ranks[ring.size - 1 - ring.index]  # the middle of an odd ring: itself
        self.posted, (self.got,) = comm.post_exchange([given], partner, partner, ring.ranks)

    def holds(self, rows: slice) -> bool:
        """Whether dealt ``rows`` are all kept rows."""
        return self.offset <= rows.start and rows.stop <= self.offset + self.kept.shape[-2]

    def kept_rows(self, rows: slice) -> slice:
        """The kept rows' part of dealt ``rows`` (``holds``), as rows of ``kept``."""
        return slice(rows.start - self.offset, rows.stop - self.offset)

    def done(self) -> torch.Tensor:
        self.posted.wait()
        first = self.inverse or self.offset == 0
        return torch.cat([self.kept, self.got] if first else [self.got, self.kept], dim=-2)


# -- one block ------------------------------------------------------------------------------------


#: a product: (query rows, key rows, causal diagonal, key positions)
Pair = tuple[slice, slice, bool, slice]


def _pairs(ring: Ring, block: int, causal: bool, device: torch.device) -> list[Pair]:
    """The products of this rank's rows against ``block``'s keys, long causal ones halved
    on CPU."""
    out: list[Pair] = []
    for pair in _products(ring, block, causal):
        out.extend(_halved(pair) if device.type == "cpu" else [pair])
    return out


#: the longest causal product given to a kernel whole. The fused CPU kernel skips masked keys
#: only by coarse tiles (a causal 1024 block costs 0.6-0.75 of a whole one, a causal 512 block
#: as much as a whole one), so a longer diagonal is cut in halves: the two diagonals and the
#: whole product below them (2 x 8 heads x 1024 x 32, forward and backward: 119 ms whole, 91 ms
#: cut to 64). The explicit product skips the masked half likewise. CUDA's flash kernels skip
#: masked tiles of their own, so there a product stays whole.
LEAF = 64


def _halved(pair: Pair) -> list[Pair]:
    """A square causal product cut down to ``LEAF`` rows: diagonal, below, diagonal."""
    rows, keys, diagonal, cols = pair
    n = _length(rows)
    if not diagonal or n <= LEAF or _length(keys) != n:
        return [pair]
    m = n // 2
    top = (_cut(rows, 0, m), _cut(keys, 0, m), True, _cut(cols, 0, m))
    below = (_cut(rows, m, n), _cut(keys, 0, m), False, _cut(cols, 0, m))
    bottom = (_cut(rows, m, n), _cut(keys, m, n), True, _cut(cols, m, n))
    return [*_halved(top), below, *_halved(bottom)]


def _length(s: slice) -> int:
    return len(range(s.start or 0, s.stop, s.step or 1))


def _cut(s: slice, a: int, b: int) -> slice:
    """Elements ``a`` to ``b`` of the (possibly strided) slice ``s``."""
    start, step = s.start or 0, s.step or 1
    return slice(start + a * step, start + b * step, s.step)


def _products(ring: Ring, block: int, causal: bool) -> list[Pair]:
    """The products of this rank's rows against ``block``'s keys, as (query rows, key rows,
    diagonal, key positions): ``diagonal`` when a causal mask cuts the product, aligned to its
    first row and key; key positions index the sequence (an explicit mask's columns). Key
    chunks wholly after the query chunk are left out; a query chunk's whole products over
    adjacent key chunks are one product."""
    if ring.striped:
        return _striped_pairs(ring, block, causal)
    out: list[Pair] = []
    for q_off, q_pos, q_len in ring.query_chunks():
        for k_off, k_pos, k_len in ring.chunks(block):
            rows, keys = slice(q_off, q_off + q_len), slice(k_off, k_off + k_len)
            if causal and k_pos > q_pos + q_len - 1:
                continue
            diagonal = causal and k_pos + k_len - 1 > q_pos
            if diagonal and (k_pos, k_len) != (q_pos, q_len):
                raise AssertionError("a causal product cut off its diagonal")
            cols = slice(k_pos, k_pos + k_len)
            if out and _joins(out[-1], rows, keys, cols) and not diagonal:
                # one product of these rows over both runs of keys, seen whole
                last = out[-1]
                out[-1] = (
                    rows,
                    slice(last[1].start, keys.stop),
                    False,
                    slice(last[3].start, cols.stop),
                )
            else:
                out.append((rows, keys, diagonal, cols))
    return out


def _joins(last: Pair, rows: slice, keys: slice, cols: slice) -> bool:
    """Whether ``last`` is a whole product of ``rows`` whose keys end where ``keys`` begin."""
    return (
        last[0] == rows and not last[2] and (last[1].stop, last[3].stop) == (keys.start, cols.start)
    )


def _striped_pairs(ring: Ring, block: int, causal: bool) -> list[Pair]:
    """The products of a striped ring: rows ``index + n*i`` against the keys ``s + n*j`` of
    stripe ``s`` (the block's, or every stripe when all keys are here, read strided). Under a
    causal mask row ``i`` sees key ``j <= i`` of an earlier or its own stripe and ``j < i`` of
    a later one: rows from 1 against keys to ``rows - 1``, aligned causal."""
    n, rows = ring.size, ring.rows
    here = ring.keys is not None
    out = []
    for s in range(n) if here else (block,):
        if not causal or s <= ring.index:
            cols = slice(s, s + n * rows, n)
            out.append((slice(0, rows), cols if here else slice(0, rows), causal, cols))
        elif rows > 1:
            cols = slice(s, s + n * (rows - 1), n)
            out.append((slice(1, rows), cols if here else slice(0, rows - 1), True, cols))
    return out


def _exchange(
    ring: Ring, tensors: Sequence[torch.Tensor]
) -> tuple[comm.Posted, list[torch.Tensor]]:
    """Post sending ``tensors`` to the next rank and receiving their like from the previous."""
    return comm.post_exchange(tensors, ring.next(), ring.prev(), ring.ranks)


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward. The kernels read the blocks in place (strided views:
    no copies); keys and values travel as two tensors, each block's gradients likewise. A
    balanced ring takes the query and gives the output in the contiguous split and deals
    the rows inside (``_Swap``): the first block's products of the kept rows overlap the
    exchange, and backward's last one the key and value gradients' last step."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        ring: Ring,
        scale: float,
        causal: bool,
    ) -> torch.Tensor:
        acc = torch.promote_types(q.dtype, torch.float32)
        lead, rows = q.shape[:-2], q.shape[-2]
        lse = q.new_full((*lead, rows), float("-inf"), dtype=acc)
        total = q.new_zeros((*lead, rows, v.shape[-1]), dtype=acc)
        swap = _Swap(q, ring, False) if ring.balanced else None
        kb, vb = k, v
        written: list[slice] = []  # rows holding a product's output (the rest: none yet)

        def fold(rows_of: torch.Tensor, pair: Pair, r: slice) -> None:
            c, diagonal, cols = pair[1:]
            part, part_lse = blocks.pair_forward(
                rows_of[..., r, :],
                kb[..., c, :],
                vb[..., c, :],
                scale,
                diagonal,
                mask,
                cols,
                pair[0],
                acc,
            )
            r = pair[0]
            if any(r.start < w.stop and w.start < r.stop for w in written):
                blocks.merge(total, lse, r, part, part_lse)
            else:
                total[..., r, :], lse[..., r] = part, part_lse
                written.append(r)

        for step in range(ring.steps):
            block = (ring.index - step) % ring.size
            posted = got = None
            if step < ring.steps - 1:
                posted, got = _exchange(ring, [kb, vb])
            pairs = _pairs(ring, block, causal, q.device)
            if swap is not None:  # the kept rows first, while the others arrive
                for pair in [p for p in pairs if swap.holds(p[0])]:
                    fold(swap.kept, pair, swap.kept_rows(pair[0]))
                pairs = [p for p in pairs if not swap.holds(p[0])]
                q, swap = swap.done(), None
            for pair in pairs:
                fold(q, pair, pair[0])
            if posted is not None:
                posted.wait()
                kb, vb = got
        result = total.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, result, lse)
        ctx.ring, ctx.scale, ctx.causal = ring, scale, causal
        return _Swap(result, ring, True).done() if ring.balanced else result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        acc = lse.dtype
        grad = grad.contiguous()
        swap = _Swap(grad, ring, False) if ring.balanced else None
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kb, vb = k, v
        carried: list[torch.Tensor] = []  # the gradients of the block held, from before
        for step in range(ring.steps):
            block = (ring.index - step) % ring.size
            sends = ([kb, vb] if step < ring.steps - 1 else []) + carried
            posted, got = _exchange(ring, sends) if sends else (None, [])
            dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
            dv = torch.zeros(vb.shape, dtype=acc, device=vb.device)
            pairs = _pairs(ring, block, causal, q.device)
            if swap is not None:  # the kept rows first, while the others' gradients arrive
                for pair in [p for p in pairs if swap.holds(p[0])]:
                    grads = _unfold(
                        swap.kept,
                        swap.kept_rows(pair[0]),
                        q,
                        kb,
                        vb,
                        out,
                        lse,
                        pair,
                        scale,
                        mask,
                        acc,
                    )
                    _accumulate((dq, dk, dv), pair, grads)
                pairs = [p for p in pairs if not swap.holds(p[0])]
                grad, swap = swap.done(), None
            for pair in pairs:
                grads = _unfold(grad, pair[0], q, kb, vb, out, lse, pair, scale, mask, acc)
                _accumulate((dq, dk, dv), pair, grads)
            if posted is not None:
                posted.wait()
            if step < ring.steps - 1:
                kb, vb = got[:2]
            if carried:
                dk += got[-2]  # this block's gradients from the ranks before
                dv += got[-1]
            carried = [dk, dv]
        dq = dq.to(q.dtype)
        back = _Swap(dq, ring, True) if ring.balanced else None
        # the last block's gradients go on to its owner; this rank's own arrive
        if ring.steps > 1:
            posted, carried = _exchange(ring, carried)
            posted.wait()
        dk, dv = carried
        dq = back.done() if back is not None else dq
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _unfold(
    g: torch.Tensor,
    g_rows: slice,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    pair: Pair,
    scale: float,
    mask: torch.Tensor | None,
    acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One product's (dq, dk, dv): its rows' output gradient ``g[g_rows]``."""
    r, c, diagonal, cols = pair
    return blocks.pair_backward(
        g[..., g_rows, :],
        q[..., r, :],
        k[..., c, :],
        v[..., c, :],
        out[..., r, :],
        lse[..., r].contiguous(),
        scale,
        diagonal,
        mask,
        cols,
        r,
        acc,
    )


def _accumulate(into: tuple[torch.Tensor, ...], pair: Pair, grads: tuple) -> None:
    dq, dk, dv = into
    r, c = pair[:2]
    dq[..., r, :] += grads[0]
    dk[..., c, :] += grads[1]
    dv[..., c, :] += grads[2]


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    ranks: Sequence[int],
    index: int,
    scale: float | None,
    causal: bool,
    striped: bool = False,
) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence, whose blocks (in sequence order)
    ``ranks`` hold, this one at ``index``: ``mask`` (rows this rank's, keys all) or ``causal``
    as ``scaled_dot_product_attention`` takes them. ``striped``: the ranks hold the sequence's
    positions round-robin, not in blocks. A causal ring of even blocks is balanced."""
    rows = query.shape[-2]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    balanced = causal and mask is None and len(ranks) > 1 and rows % 2 == 0 and not striped
    ring = Ring(tuple(ranks), index, rows, balanced, striped=striped and len(ranks) > 1)
    key, value = _own(key.contiguous()), _own(value.contiguous())  # sent and kept as they are
    return _RingAttention.apply(query, key, value, mask, ring, scale, causal)


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its own storage where it is part of a larger one (a fused projection's output),
    so that keeping it for backward does not keep the rest."""
    if t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


def causal_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ranks: Sequence[int],
    index: int,
    scale: float | None = None,
    enable_gqa: bool = False,
    striped: bool = False,
) -> torch.Tensor:
    """This rank's block of query rows (``index`` of the blocks ``ranks`` hold, in order; or
    its stripe when ``striped``) of a causal attention whose keys are all here, by the ring's
    online softmax on one rank: backward keeps the rows' log-sum-exp, never an ``L x S`` mask
    or probabilities. Block rows are dealt as a balanced ring deals them, so every rank
    computes as many products; striped rows are balanced as they stand."""
    grouped = blocks.kernel(query, key, None) == "flash_cpu"  # grouped heads taken as they are
    if enable_gqa and key.shape[-3] != query.shape[-3] and not grouped:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rows, n = query.shape[-2], len(ranks)
    if striped and n > 1:
        query = _own(query)  # the gathered keys and values replace the local ones
        return _striped_rows(query, key, value, n, index, scale)
    balanced = n > 1 and rows % 2 == 0
    ring = Ring(tuple(ranks), index, rows, balanced, index * rows, key.shape[-2])
    return _RingAttention.apply(query, key, value, None, ring, scale, True)


def _striped_rows(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n: int, index: int, scale: float
) -> torch.Tensor:
    """Stripe ``index`` of ``n`` of the query rows against every key, causal: each stripe of
    the keys (read strided) is one causal product. Keys that are not ``n`` stripes as
    long as the rows take an explicit mask of the rows' positions."""
    rows, keys = query.shape[-2], key.shape[-2]
    if keys != n * rows:
        at = torch.arange(rows, device=query.device) * n + index
        mask = at.unsqueeze(-1) >= torch.arange(keys, device=query.device)
        gqa = key.shape[-3] != query.shape[-3]
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa
        )

    ring = Ring(tuple(range(n)), index, rows, False, 0, keys, striped=True)
    return _RingAttention.apply(query, key, value, None, ring, scale, True)
