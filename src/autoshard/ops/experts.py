"""A mixture-of-experts layer as one op, ``autoshard::experts`` (docs/parallelism/expert.md).

``experts(x, index, weight, gate_up, down, activation)``: each token ``x[t]`` goes through the
experts ``index[t, :]`` picked for it and their outputs are summed with ``weight[t, :]``. Expert
``e`` is the gated feed-forward ``down[e] @ (act(gate) * up)`` with ``(gate; up) = gate_up[e] @
x[t]`` (transformers' experts layout: ``gate_up [E, 2F, H]``, ``down [E, H, F]``). Capture puts
this op where a model has an experts module, so the routing, data-dependent as it is, is one
node whose rule knows what a split of its experts means.

The rule (``ExpertsRule``) splits the tokens ``t`` like any free dim and the experts ``e`` like a
contracted one: experts split over axes that do not split the tokens leave each rank its experts'
share of every token's output (a partial sum). Experts split over axes that also split the
tokens are expert parallelism proper: each rank's tokens go to the ranks of their experts by an
all-to-all whose counts are exchanged first, each rank computes its experts on the tokens it
received, and a second all-to-all brings the outputs back in token order.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autoshard import comm
from autoshard.devices import host_ints
from autoshard.layout import Factored, Layout, LayoutError
from autoshard.mesh import MeshInfo
from autoshard.ops.base import FIXED, FREE, SUM, Space, SpaceRule, Strategy, StrategyError
from autoshard.ops.grouped import ACTIVATIONS, counts_of, expert_ffn, grouped_ffn
from autoshard.ops.nodes import dtype_of, node_title, shape_of, tensor_inputs
from autoshard.ops.work import Cost, Exchange


def experts_math(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    first: int = 0,
) -> torch.Tensor:
    """The experts ``first .. first + len(gate_up)`` on every token that picked them, weighted
    and summed per token (the other experts' share is left out: a partial sum). The token
    slots go sorted by expert, those of other experts last, through one grouped product
    (``grouped.grouped_ffn``), and are summed back into their tokens by one ``index_add``."""
    num_experts, top_k = gate_up.shape[0], index.shape[1]
    flat = index.reshape(-1) - first
    mine = (flat >= 0) & (flat < num_experts)
    key = torch.where(mine, flat, num_experts)  # other ranks' experts: a last group, left out
    order = torch.argsort(key, stable=True)
    counts = counts_of(key, num_experts + 1)[:num_experts]
    tokens = order // top_k
    y = grouped_ffn(x[tokens], counts, gate_up, down, activation)
    weighted = y * torch.where(mine, weight.reshape(-1), 0.0)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, tokens, weighted.to(x.dtype))


@torch.library.custom_op("autoshard::experts", mutates_args=())
def experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """Every token through its experts, weighted and summed (see the module's docstring)."""
    return experts_math(x, index, weight, gate_up, down, activation)


@experts.register_fake
def _(x, index, weight, gate_up, down, activation):  # noqa: ANN001, ANN202
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.activation = inputs[5]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # the op's math again under autograd: the op is run eagerly only outside autoshard's
    # programs (which call the rule's local form instead)
    x, index, weight, gate_up, down = ctx.saved_tensors
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (x, weight, gate_up, down)]
        out = experts_math(leaves[0], index, leaves[1], leaves[2], leaves[3], ctx.activation)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return grads[0], None, grads[1], grads[2], grads[3], None


experts.register_autograd(_backward, setup_context=_setup)

EXPERTS_OP = torch.ops.autoshard.experts.default


# -- the exchange ------------------------------------------------------------------------------


class _AllToAllV(torch.autograd.Function):
    """Rows to the group's ranks by counts; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: list[int]):
        ctx.plan = (send, recv, group)
        return comm.all_to_all_v(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        send, recv, group = ctx.plan
        return comm.all_to_all_v(grad.contiguous(), recv, send, group), None, None, None


def dispatched(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    group: list[int],
    blocks: list[int],
) -> torch.Tensor:
    """Expert parallelism on this rank's tokens: ``group`` (ascending) holds the experts in
    blocks of ``len(gate_up)``, member ``i`` block ``blocks[i]``. The assignments go, sorted
    by expert, to their experts' ranks (the counts per rank and expert exchanged first), each
    rank runs its experts on what it received, and the outputs come back in the same order."""
    turns = dispatch_turns(x, index, weight, gate_up, down, activation, group, blocks, _now)
    while True:
        try:
            next(turns)
        except StopIteration as done:
            return done.value


def _now(x: torch.Tensor, send: list[int], recv: list[int], group: list[int]) -> Callable:
    y = _AllToAllV.apply(x, send, recv, group)
    return lambda: y


#: how ``dispatch_turns`` sends rows: ``(rows, send, recv, group)`` -> what gives the
#: received rows when called (an all-to-all issued now and waited there, differentiably)
RowExchange = Callable[[torch.Tensor, list[int], list[int], list[int]], Callable[[], torch.Tensor]]


def dispatch_turns(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str,
    group: list[int],
    blocks: list[int],
    exchange: RowExchange,
) -> Generator[None, None, torch.Tensor]:
    """``dispatched`` in turns: it yields while the dispatch and the combine travel (the
    turn of another copy of the batch, ``runtime/program/copies.py``) and returns the
    output; ``exchange`` issues each all-to-all."""
    per, size = gate_up.shape[0], len(group)
    top_k = index.shape[1]
    flat = index.reshape(-1)
    device = index.device
    member = torch.empty(size, dtype=torch.long, device=device)
    member[torch.tensor(blocks, device=device)] = torch.arange(size, device=device)
    key = member[flat // per] * per + flat % per  # (the member holding it, its expert there)
    order = torch.argsort(key, stable=True)
    counts = counts_of(key, per * size).view(size, per)  # [member, expert]
    got = comm.all_to_all_v(counts, [1] * size, [1] * size, group)  # [source, my expert]
    # the exchange's one host sync: the all-to-all's sizes and the experts' segments
    send, flat = host_ints([counts.sum(1), got.reshape(-1)])
    table = [flat[i * per : (i + 1) * per] for i in range(size)]
    recv = [sum(row) for row in table]
    arriving = exchange(x[order // top_k], send, recv, group)
    yield
    rows = arriving()
    # the received rows come by source, each source's by expert: sorted by expert for one
    # grouped product, and back in the order they came
    expert_of = torch.repeat_interleave(
        torch.arange(per, device=device).repeat(size), got.reshape(-1), output_size=sum(recv)
    )
    by_expert = torch.argsort(expert_of, stable=True)
    sizes = [sum(col) for col in zip(*table, strict=True)]
    ys = grouped_ffn(rows[by_expert], got.sum(0), gate_up, down, activation, sizes)
    y = ys[torch.argsort(by_expert)]
    returning = exchange(y, recv, send, group)
    yield
    back = returning()
    weighted = back * weight.reshape(-1)[order].unsqueeze(-1)
    return torch.zeros_like(x).index_add(0, order // top_k, weighted.to(x.dtype))


class LocalExperts(nn.Module):
    """What a rank's program runs for the experts op: its experts on its tokens (a partial sum
    over the ranks holding the other experts), or, dispatching, the exchange with ``group``."""

    def __init__(self, activation: str, first: int, group: list[int], blocks: list[int]):
        super().__init__()
        self.activation, self.first, self.group, self.blocks = activation, first, group, blocks

    def forward(self, x, index, weight, gate_up, down) -> torch.Tensor:  # noqa: ANN001
        if len(self.group) > 1:
            return dispatched(
                x, index, weight, gate_up, down, self.activation, self.group, self.blocks
            )
        return experts_math(x, index, weight, gate_up, down, self.activation, self.first)

    def turns(self, x, index, weight, gate_up, down, exchange: RowExchange) -> Any:  # noqa: ANN001
        """``forward`` in turns around its all-to-alls (``dispatch_turns``); None when the
        experts are not dispatched."""
        if len(self.group) == 1:
            return None
        args = (self.activation, self.group, self.blocks, exchange)
        return dispatch_turns(x, index, weight, gate_up, down, *args)

    def extra_repr(self) -> str:
        if len(self.group) > 1:
            return f"{self.activation}, dispatched over ranks {self.group}"
        return f"{self.activation}, experts from {self.first}"


# -- the rule ----------------------------------------------------------------------------------

T, K, E, H, FF = range(5)  # the iteration dims: tokens, top-k slots, experts, hidden, ffn

#: expert parallelism's load imbalance as the cost model states it: the busiest rank of a
#: dispatch group receives this many times the mean of the rows (routing a balance loss keeps
#: near even still leaves some experts busier), and every rank waits for it
IMBALANCE = 1.1


def axes_of(layout: Layout, dim: int) -> tuple[str, ...]:
    """The mesh axis names splitting ``dim`` of ``layout``, major first (a merged axis is its
    names joined by ``*``)."""
    out: list[str] = []
    for _, a in layout.factors[dim]:
        if a >= 0:
            out.extend(layout.axis_names[a].split("*"))
    return tuple(out)


class ExpertsRule(SpaceRule):
    """``autoshard::experts``: tokens free, experts summed over (or dispatched to, see the
    module's docstring), the top-k slots, hidden and ffn dims whole."""

    def make_space(self, node: fx.Node) -> Space:
        x, index, _, gate_up, down = tensor_inputs(node)
        (num_tokens, hidden), top_k = shape_of(x), shape_of(index)[1]
        num_experts, ffn = shape_of(gate_up)[0], shape_of(down)[2]
        return Space(
            (num_tokens, top_k, num_experts, hidden, ffn),
            (FREE, FIXED, SUM, FIXED, FIXED),
            ((T, H), (T, K), (T, K), (E, None, H), (E, H, FF)),
            ((T, H),),
            ("t", "k", "e", "h", "f"),
        )

    def from_space(self, node: fx.Node, spec: Sequence[Any], mesh: MeshInfo) -> Strategy:
        """A named space strategy: experts over axes that also split the tokens dispatch, an
        ffn split is expert tensor parallelism (both built by :meth:`by_hand`)."""
        token_axes, expert_axes = _names(spec[T]), _names(spec[E])
        if spec[FF] is not None or (expert_axes and set(expert_axes) <= set(token_axes)):
            return self.by_hand(node, spec, mesh)
        if set(expert_axes) & set(token_axes):
            raise StrategyError(
                f"{node_title(node)}: experts split over {expert_axes} and tokens over "
                f"{token_axes}: the experts' axes must all split the tokens (expert "
                "parallelism) or none of them (a sum over the experts)"
            )
        return super().from_space(node, spec, mesh)

    def by_hand(self, node: fx.Node, spec: Sequence[Any], mesh: MeshInfo) -> Strategy:
        """Tokens over ``spec[t]``, experts over ``spec[e]`` (all of them axes of the tokens:
        dispatched; none: summed over), each expert's ffn over ``spec[f]`` (expert tensor
        parallelism: ``gate_up``'s gate and up rows split alike, the output a partial sum)."""
        tokens, experts, ffn = _names(spec[T]), _names(spec[E]), _names(spec[FF])
        where = node_title(node)
        if spec[K] is not None or spec[H] is not None:
            raise StrategyError(f"{where}: the top-k slots and the hidden dim stay whole")
        if set(ffn) & set(tokens + experts):
            raise StrategyError(f"{where}: the ffn's axes {ffn} also split tokens or experts")
        if set(experts) & set(tokens) and not set(experts) <= set(tokens):
            raise StrategyError(
                f"{where}: experts split over {experts} and tokens over {tokens}: the experts' "
                "axes must all split the tokens (expert parallelism) or none of them"
            )
        summed = () if set(experts) <= set(tokens) else experts
        replicas = tuple(a for a in tokens if a not in experts)
        x, index, weight, gate_up, down = tensor_inputs(node)
        axes = mesh.as_dict()
        t, e, f = _entry(tokens), _entry(experts), _entry(ffn)
        num_ffn = shape_of(down)[2]
        halves = Factored((2, num_ffn), (None, f)) if ffn else None

        def layout(inp: fx.Node, named: tuple, partial: tuple = ()) -> Layout:
            try:
                return Layout.from_named(
                    shape_of(inp), named, axes, partial=partial, dtype=dtype_of(inp)
                )
            except LayoutError as err:
                raise StrategyError(f"{where}: {err}") from None

        rows = (t, None)
        ins = (
            layout(x, rows),
            layout(index, rows),
            layout(weight, rows),
            layout(gate_up, (e, halves, None)),
            layout(down, (e, None, f)),
        )
        out = layout(node, rows, ffn + summed)
        grads = (
            layout(x, rows, ffn + summed),
            ins[1],
            layout(weight, rows, ffn + summed),
            layout(gate_up, (e, halves, None), replicas),
            layout(down, (e, None, f), replicas),
        )
        return Strategy(ins, (out,), grads)

    def joint_options(self, node: fx.Node, mesh: MeshInfo) -> list[tuple[Any, Strategy]]:
        """The dispatching strategies (an axis on both the tokens and the experts), for the
        search: tokens over any set of axes, experts over a non-empty subset of them, as
        (named space spec, strategy)."""
        space = self.space(node)
        names = [n for n, s in zip(mesh.names, mesh.sizes, strict=True) if s > 1]
        out = []
        for mask in range(1, 2 ** len(names)):
            tokens = tuple(n for i, n in enumerate(names) if mask >> i & 1)
            if space.sizes[T] % mesh.size_of(tokens):
                continue
            for sub in range(1, 2 ** len(tokens)):
                experts = tuple(n for i, n in enumerate(tokens) if sub >> i & 1)
                if space.sizes[E] % mesh.size_of(experts):
                    continue
                spec = [None] * len(space.sizes)
                spec[T], spec[E] = _entry(tokens), _entry(experts)
                try:
                    out.append((tuple(spec), self.by_hand(node, spec, mesh)))
                except StrategyError:
                    continue
        return out

    def follow(self, node: fx.Node, ins: Sequence[Layout | None], mesh: MeshInfo) -> Strategy:
        """The tokens as they come; the experts over the mesh's ``ep`` axes where those split
        the tokens (expert parallelism), else on every rank."""
        base = super().follow(node, ins, mesh)
        token_axes = axes_of(base.space, T)
        expert_axes = tuple(a for a in token_axes if a == "ep" or a.startswith("ep_"))
        if not expert_axes:
            return base
        spec: list[Any] = [None] * 5
        spec[T], spec[E] = _entry(token_axes), _entry(expert_axes)
        return self.by_hand(node, spec, mesh)

    def lower(self, low: Any, node: fx.Node, strategy: Strategy, args: list, kwargs: dict) -> Any:
        weights = strategy.ins[3]
        group = dispatch_group(strategy, low.rank)
        blocks = [weights.local_index(r)[0].start // weights.local_shape()[0] for r in group]
        first = weights.local_index(low.rank)[0].start
        module = LocalExperts(args[5], first, list(group), blocks)
        return low.module(module, tuple(args[:5]), "experts")

    def exchanges(self, node: fx.Node, strategy: Strategy) -> tuple[Exchange, ...]:
        """Dispatching: the counts (an int64 a rank and expert), then in forward the rows out
        and back, in backward their gradients the other way; on average ``(g - 1) / g`` of a
        rank's rows leave it and as many arrive (the assignments spread over the experts, as
        the balance loss drives routing to), the busiest rank ``IMBALANCE`` times that."""
        group = dispatch_group(strategy, strategy.ins[0].ranks[0])
        if len(group) < 2:
            return ()
        x, weights, g = strategy.ins[0], strategy.ins[3], len(group)
        rows = x.local_shape()[0] * strategy.ins[1].shape[1] * (g - 1) / g
        moved = rows * x.shape[1] * x.dtype.itemsize
        counts = (g - 1) * weights.local_shape()[0] * 8
        skew = IMBALANCE
        return (
            Exchange("all_to_all", group, counts),
            Exchange("all_to_all", group, moved, skew=skew),
            Exchange("all_to_all", group, moved, skew=skew),
            Exchange("all_to_all", group, moved, backward=True, skew=skew),
            Exchange("all_to_all", group, moved, backward=True, skew=skew),
        )

    def flops(
        self, node: fx.Node, sizes: Sequence[int], needs_grad: Sequence[bool]
    ) -> tuple[float, float]:
        """Model FLOPs: each of the ``t k`` assignments through one expert's three ``h x f``
        products; backward one product per operand needing a gradient (tokens, weights)."""
        num_tokens, top_k, _, hidden, ffn = sizes
        forward = 2.0 * 3 * num_tokens * top_k * hidden * ffn
        needs = tuple(needs_grad) or (True,) * 5
        return forward, forward * (int(needs[0]) + int(needs[3] or needs[4]))

    def cost(self, node: fx.Node, strategy: Strategy, needs_grad: Sequence[bool] = ()) -> Cost:
        """Each token's top-k experts: three products of ``H x F`` per assignment, on the
        rank's tokens (dispatching: the busiest rank's, ``IMBALANCE`` times the mean), over the
        share of the experts this rank holds when they are summed over; one grouped product
        (``grouped_mm``) at the efficiency of one expert's product, each expert's rows its
        own tiles of the grouped kernel."""
        x, index, weights = strategy.ins[0], strategy.ins[1], strategy.ins[3]
        num_tokens, top_k = x.local_shape()[0], index.shape[1]
        hidden, ffn = x.shape[1], strategy.ins[4].local_shape()[2]
        held = weights.local_shape()[0]
        share = held / weights.shape[0]
        expert_axes = axes_of(weights, 0)
        if expert_axes and set(expert_axes) <= set(axes_of(x, 0)):
            share = IMBALANCE  # dispatched: the busiest rank's experts, which all wait for
        forward, backward = self.flops(
            node, (num_tokens * share, top_k, 1, hidden, ffn), needs_grad
        )
        base = super(SpaceRule, self).cost(node, strategy, needs_grad)
        rows = num_tokens * top_k * share / held  # one expert's product, as each is run
        return Cost(
            forward,
            base.bytes,
            backward,
            base.backward_bytes,
            "grouped_mm",
            3 / (1 / rows + 1 / hidden + 1 / ffn) if rows else 0.0,
        )


def dispatch_group(strategy: Strategy, rank: int) -> tuple[int, ...]:
    """The ranks ``rank`` exchanges tokens with (ascending): those that differ from it only on
    the axes splitting the experts, when those axes also split the tokens; else itself."""
    x, weights = strategy.ins[0], strategy.ins[3]
    expert_axes = axes_of(weights, 0)
    if not expert_axes or not set(expert_axes) <= set(axes_of(x, 0)):
        return (rank,)
    split = {a for _, a in weights.factors[0] if a >= 0}
    mine = weights.coordinates(rank)

    def same_replica(r: int) -> bool:
        theirs = weights.coordinates(r)
        return all(theirs[a] == mine[a] for a in range(len(mine)) if a not in split)

    return tuple(sorted(r for r in weights.ranks if same_replica(r)))


def _entry(axes: tuple[str, ...]) -> Any:
    """The named form's entry for ``axes``: None, one name, or a tuple of names."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


__all__ = [
    "ACTIVATIONS",
    "IMBALANCE",
    "EXPERTS_OP",
    "ExpertsRule",
    "RowExchange",
    "LocalExperts",
    "dispatch_turns",
    "dispatch_group",
    "dispatched",
    "expert_ffn",
    "experts",
    "experts_math",
]
