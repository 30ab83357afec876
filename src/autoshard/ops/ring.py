"""Ring attention: attention over a sequence split across ranks, exact, without gathering it.

Each rank of a ring holds a block of the queries, keys and values. The key/value blocks pass
around the ring, one step per rank; every rank folds each block it sees into its rows' output by
the online softmax (a running row max and sum, rescaled as blocks arrive), and keeps the rows'
log-sum-exp for backward. The next block's send and receive are posted before the current block
is computed, so they overlap it. Backward passes the blocks around again, each with the key and
value gradients accumulated for it so far, which end on the block's owner.

Under a causal mask a plain split leaves the last rank the most work (its rows see every key).
``balanced`` rings give each rank the query rows of two half-blocks of the sequence, chunk ``i``
and chunk ``2n-1-i`` of ``2n``, so every rank does the same work: the op moves those rows there
on entry and their output back on exit, so the layouts outside the op stay a contiguous split
(docs/parallelism/sequence.md); the keys and values travel in their blocks. Chunks of keys
wholly after a chunk of queries are skipped, and a long causal product is cut in halves
(``LEAF``), which the CPU kernel computes faster than it computes the product whole.

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
        return [(0, self.index * half, half), (half, (2 * self.size - 1 - self.index) * half, half)]

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


def _deal(x: torch.Tensor, ring: Ring, inverse: bool) -> torch.Tensor:
    """Move the half-blocks of dim -2 from the contiguous split (rank ``i`` holds chunks ``2i``,
    ``2i+1``) to the balanced one (chunks ``i``, ``2n-1-i``), or back when ``inverse``."""
    n = ring.size

    def contiguous(block: int) -> list[int]:
        return [2 * block, 2 * block + 1]

    def balanced(block: int) -> list[int]:
        return [block, 2 * n - 1 - block]

    have_of, want_of = (balanced, contiguous) if inverse else (contiguous, balanced)
    half = x.shape[-2] // 2
    parts = dict(zip(have_of(ring.index), x.split(half, dim=-2), strict=True))
    owner = {c: b for b in range(n) for c in have_of(b)}
    taker = {c: b for b in range(n) for c in want_of(b)}
    out: dict[int, torch.Tensor] = {}
    sends, recvs = [], []
    for c in sorted(parts):  # both sides list a pair's chunks in ascending order
        if taker[c] == ring.index:
            out[c] = parts[c]
        else:
            sends.append((parts[c], ring.ranks[taker[c]]))
    for c in sorted(want_of(ring.index)):
        if c not in out:
            out[c] = torch.empty_like(parts[next(iter(parts))])
            recvs.append((out[c], ring.ranks[owner[c]]))
    comm.post_p2p(sends, recvs).wait()
    return torch.cat([out[c] for c in want_of(ring.index)], dim=-2)


class _Deal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ring: Ring, inverse: bool) -> torch.Tensor:
        ctx.ring, ctx.inverse = ring, inverse
        return _deal(x, ring, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _deal(grad.contiguous(), ctx.ring, not ctx.inverse), None, None


# -- one block ------------------------------------------------------------------------------------


#: a product: (query rows, key rows, causal diagonal, key positions)
Pair = tuple[slice, slice, bool, slice]


def _pairs(ring: Ring, block: int, causal: bool) -> list[Pair]:
    """The products of this rank's rows against ``block``'s keys, long causal ones halved."""
    out: list[Pair] = []
    for pair in _products(ring, block, causal):
        out.extend(_halved(pair))
    return out


#: the longest causal product given to a kernel whole. The fused CPU kernel skips masked keys
#: only by coarse tiles (a causal 1024 block costs 0.6-0.75 of a whole one, a causal 512 block
#: as much as a whole one), so a longer diagonal is cut in halves: the two diagonals and the
#: whole product below them (2 x 8 heads x 1024 x 32, forward and backward: 119 ms whole, 91 ms
#: cut to 64). The explicit product skips the masked half likewise.
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
                out[-1] = (rows, slice(last[1].start, keys.stop), False,
                           slice(last[3].start, cols.stop))  # fmt: skip
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


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    diagonal: bool,
    mask: torch.Tensor | None,
    cols: slice,
    rows: slice,
) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    if mask is not None:
        m = mask[..., rows, cols]
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    return s


def _exchange(
    ring: Ring, tensors: Sequence[torch.Tensor]
) -> tuple[comm.Posted, list[torch.Tensor]]:
    """Post sending ``tensors`` to the next rank and receiving their like from the previous."""
    sends = [t.contiguous() for t in tensors]
    got = [torch.empty_like(t) for t in sends]
    posted = comm.post_p2p([(t, ring.next()) for t in sends], [(g, ring.prev()) for g in got])
    return posted, got


def _fused(q: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether a product runs the fused CPU kernel (which returns the rows' log-sum-exp): on
    CPU, with no explicit mask."""
    return q.device.type == "cpu" and mask is None


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _pair_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool,
    mask: torch.Tensor | None, cols: slice, rows: slice, acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One product's (output, log-sum-exp), in ``acc``."""
    if _fused(q, mask):
        out, lse = _FLASH_CPU(q, k, v, 0.0, diagonal, scale=scale)
        return out.to(acc), lse.to(acc)
    s = _scores(q.to(acc), k.to(acc), scale, diagonal, mask, cols, rows)
    top = s.amax(dim=-1)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    p = torch.exp(s - top.unsqueeze(-1))
    total = p.sum(dim=-1)
    out = torch.matmul(p, v.to(acc)) / total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)
    return out, top + torch.log(total)


def _pair_backward(
    g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, scale: float, diagonal: bool, mask: torch.Tensor | None, cols: slice,
    rows: slice, acc: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One product's (dq, dk, dv) in ``acc``, from the whole rows' output and log-sum-exp."""
    if _fused(q, mask):
        grads = _FLASH_CPU_BACKWARD(
            g, q, k, v, out, lse.to(torch.promote_types(q.dtype, torch.float32)), 0.0,
            diagonal, scale=scale,
        )  # fmt: skip
        return tuple(t.to(acc) for t in grads)  # type: ignore[return-value]
    qa, ka, va, ga = (t.to(acc) for t in (q, k, v, g))
    s = _scores(qa, ka, scale, diagonal, mask, cols, rows)
    p = torch.exp(s - lse.unsqueeze(-1))
    delta = (ga * out.to(acc)).sum(dim=-1, keepdim=True)
    dv = torch.matmul(p.transpose(-2, -1), ga)
    ds = p * (torch.matmul(ga, va.transpose(-2, -1)) - delta) * scale
    return torch.matmul(ds, ka), torch.matmul(ds.transpose(-2, -1), qa), dv


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward. The kernels read the blocks in place (strided views:
    no copies); keys and values travel as two tensors, each block's gradients likewise."""

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
        kb, vb = k, v
        written: list[slice] = []  # rows holding a product's output (the rest: none yet)
        for step in range(ring.steps):
            block = (ring.index - step) % ring.size
            posted = got = None
            if step < ring.steps - 1:
                posted, got = _exchange(ring, [kb, vb])
            for r, c, diagonal, cols in _pairs(ring, block, causal):
                part, part_lse = _pair_forward(
                    q[..., r, :], kb[..., c, :], vb[..., c, :], scale, diagonal, mask, cols, r,
                    acc,
                )  # fmt: skip
                if any(r.start < w.stop and w.start < r.stop for w in written):
                    _merge(total, lse, r, part, part_lse)
                else:
                    total[..., r, :], lse[..., r] = part, part_lse
                    written.append(r)
            if posted is not None:
                posted.wait()
                kb, vb = got
        result = total.to(q.dtype)
        ctx.save_for_backward(q, k, v, mask, result, lse)
        ctx.ring, ctx.scale, ctx.causal = ring, scale, causal
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, mask, out, lse = ctx.saved_tensors
        ring, scale, causal = ctx.ring, ctx.scale, ctx.causal
        acc = lse.dtype
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kb, vb = k, v
        carried: list[torch.Tensor] = []  # the gradients of the block held, from before
        for step in range(ring.steps):
            block = (ring.index - step) % ring.size
            sends = ([kb, vb] if step < ring.steps - 1 else []) + carried
            posted, got = _exchange(ring, sends) if sends else (None, [])
            dk = torch.zeros(kb.shape, dtype=acc, device=kb.device)
            dv = torch.zeros(vb.shape, dtype=acc, device=vb.device)
            for r, c, diagonal, cols in _pairs(ring, block, causal):
                gq, gk, gv = _pair_backward(
                    grad[..., r, :], q[..., r, :], kb[..., c, :], vb[..., c, :],
                    out[..., r, :], lse[..., r].contiguous(), scale, diagonal, mask, cols, r,
                    acc,
                )  # fmt: skip
                dq[..., r, :] += gq
                dk[..., c, :] += gk
                dv[..., c, :] += gv
            if posted is not None:
                posted.wait()
            if step < ring.steps - 1:
                kb, vb = got[:2]
            if carried:
                dk += got[-2]  # this block's gradients from the ranks before
                dv += got[-1]
            carried = [dk, dv]
        # the last block's gradients go on to its owner; this rank's own arrive
        if ring.steps > 1:
            posted, carried = _exchange(ring, carried)
            posted.wait()
        dk, dv = carried
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _merge(
    total: torch.Tensor, lse: torch.Tensor, r: slice, part: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Fold one product's rows ``r`` (output and log-sum-exp) into the running ones: the part's
    share of the rows' softmax is ``sigmoid(part_lse - lse)``, so one interpolation in place
    (rows no key has reached yet: -inf on both sides, nothing taken)."""
    held = lse[..., r]
    share = torch.sigmoid(part_lse - held).nan_to_num_(0.0)
    total[..., r, :].lerp_(part, share.unsqueeze(-1))
    lse[..., r] = torch.logaddexp(held, part_lse)


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
    if not balanced:
        return _RingAttention.apply(query, key, value, mask, ring, scale, causal)
    query = _Deal.apply(query.contiguous(), ring, False)  # the keys travel in their blocks
    out = _RingAttention.apply(query, key, value, mask, ring, scale, causal)
    return _Deal.apply(out, ring, True)


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
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rows, n = query.shape[-2], len(ranks)
    if striped and n > 1:
        query = _own(query)  # the gathered keys and values replace the local ones
        return _striped_rows(query, key, value, n, index, scale)
    balanced = n > 1 and rows % 2 == 0
    ring = Ring(tuple(ranks), index, rows, balanced, index * rows, key.shape[-2])
    if balanced:
        query = _Deal.apply(query.contiguous(), ring, False)
    out = _RingAttention.apply(query, key, value, None, ring, scale, True)
    return _Deal.apply(out, ring, True) if balanced else out


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
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale
        )

    ring = Ring(tuple(range(n)), index, rows, False, 0, keys, striped=True)
    return _RingAttention.apply(query, key, value, None, ring, scale, True)
