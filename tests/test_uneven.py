"""Shapes that do not divide their split (DESIGN.md invariants 1 and 3): a batch, a hidden size,
a head count or a vocabulary smaller than its split, or not a multiple of it, either trains
exactly as plain PyTorch does or is rejected by ``parallelize`` with a ``ValueError`` naming
the op, the dim and the sizes; never a silently different result, never a hang.

A property test: Hypothesis draws a small model (a two-layer MLP, or an embedding, one
attention block and a vocabulary head) with every size from 1 to 17, a batch from 1 to 17, a
mesh of 1, 2, 3 or 4 ranks (or 2 x 2), a ZeRO stage, and how its ops get strategies. Each
example then checks two things:

- a strategy that puts mesh axes on a dim they do not divide (a random op, dim and axes, in
  the tuple or the named form) is rejected, naming that op, a dim, its size and the split;
- the example's strategies (drawn from the rules' own enumeration for those shapes, or a random
  axis on any dim, or none) train as the eager model with ``torch.optim`` does: the loss of
  every step and every parameter after the last, in float64 with ``assert_close`` defaults;
  or they are rejected as clearly (and must be, where a split does not divide).

Each world size is spawned once, all its examples run inside the ranks, and a failure flag is
all-reduced after each example so ranks never diverge into a hang. (It found two bugs, both
fixed: replica groups along two mesh axes made in an order whose group names the members
disagreed on, a hang; and a pairwise swap of a transposed view received into a strided
buffer, which gloo refuses.)
"""

from __future__ import annotations

import copy
import math
import operator
import random
import re
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard import parallelize, shard_inputs
from autoshard.graph.capture import capture_modes
from autoshard.mesh import MeshInfo, mesh_info
from autoshard.ops import FIXED, SpaceRule, rule_for
from autoshard.search.options import options
from autoshard.testing import run_ranks

MESHES: dict[int, list[dict[str, int]]] = {
    1: [{"dp": 1}],
    2: [{"dp": 2}, {"tp": 2}],
    3: [{"dp": 3}, {"tp": 3}],
    4: [{"dp": 4}, {"tp": 4}, {"dp": 2, "tp": 2}],
}
EXAMPLES = {1: 8, 2: 14, 3: 10, 4: 10}
STEPS = 2
#: the chance that an op is left to follow its inputs (the semi-automatic default)
UNCONFIGURED = 0.3
#: the chance that an op gets a random axis in a "raw" example (low, so that some divide)
RAW = 0.3


# -- models ----------------------------------------------------------------------------------------


class TwoLayer(nn.Module):
    """linear -> gelu -> linear -> cross-entropy: the batch, features, hidden and classes."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))), target)


class TinyAttention(nn.Module):
    """embedding -> fused qkv -> heads -> attention -> projection + residual -> layer norm ->
    vocabulary head -> cross-entropy (ignoring the last position when there are several)."""

    def __init__(self, vocab: int, heads: int, head_dim: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.hidden, self.causal = heads, heads * head_dim, causal
        self.wte = nn.Embedding(vocab, self.hidden)
        self.qkv = nn.Linear(self.hidden, 3 * self.hidden)
        self.proj = nn.Linear(self.hidden, self.hidden)
        self.norm = nn.LayerNorm(self.hidden)
        self.head = nn.Linear(self.hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        B, S = idx.shape
        x = self.wte(idx)
        q, k, v = self.qkv(x).split(self.hidden, dim=-1)
        q, k, v = (t.view(B, S, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(B, S, self.hidden))
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(B * S, -1), target.view(-1))


@dataclass(frozen=True)
class Case:
    """One example: the model and its sizes, the batch, the mesh, how strategies are drawn."""

    model: str  # "mlp" | "attention"
    sizes: tuple[int, ...]  # (features, hidden, classes) | (vocab, heads, head_dim, seq, causal)
    batch: int
    mesh: dict[str, int]
    how: str  # "enumerated" (the rules' enumeration), "raw" (may not divide), "default"
    zero: int  # the ZeRO stage over each parameter's data-parallel replicas
    seed: int


def build(case: Case) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The float64 model and ``STEPS`` batches for ``case``."""
    torch.manual_seed(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    data = []
    if case.model == "mlp":
        features, hidden, classes = case.sizes
        model = TwoLayer(features, hidden, classes)
        for _ in range(STEPS):
            x = torch.randn(case.batch, features, generator=gen, dtype=torch.float64)
            data.append((x, torch.randint(0, classes, (case.batch,), generator=gen)))
    else:
        vocab, heads, head_dim, seq, causal = case.sizes
        model = TinyAttention(vocab, heads, head_dim, bool(causal))
        for _ in range(STEPS):
            idx = torch.randint(0, vocab, (case.batch, seq), generator=gen)
            target = torch.randint(0, vocab, (case.batch, seq), generator=gen)
            if seq > 1:
                target[:, -1] = -100
            data.append((idx, target))
    return model.to(torch.float64), data


# -- strategies ------------------------------------------------------------------------------------


def _op_nodes(captured: Any) -> list[Any]:
    """The nodes with an iteration space: those a strategy configures."""
    return [
        node
        for node in captured[True].graph.nodes
        if node.op == "call_function"
        and node.target is not operator.getitem
        and isinstance(rule_for(node), SpaceRule)
    ]


def enumerated(captured: Any, info: MeshInfo, rng: random.Random) -> dict[str, Any]:
    """A strategy per op from the rule's enumeration (or the search's options) for its shapes;
    some ops left unconfigured."""
    out: dict[str, Any] = {}
    for node in _op_nodes(captured):
        if rng.random() < UNCONFIGURED:
            continue
        if rng.random() < 0.5:
            choices = rule_for(node).enumerate(node, info)
        else:
            choices = [option.strategy for option in options(node, info)]
        if choices:
            out[node.name] = rng.choice(choices)
    return out


def raw(captured: Any, info: MeshInfo, rng: random.Random) -> tuple[dict[str, Any], list[str]]:
    """Some ops with every mesh axis on a random dim (any dim the op may split, whatever its
    size) or on none; and the ops whose splits do not divide their dims."""
    axes = [(name, size) for name, size in zip(info.names, info.sizes, strict=True) if size > 1]
    out: dict[str, Any] = {}
    indivisible = []
    for node in _op_nodes(captured):
        if rng.random() > RAW:
            continue
        space = rule_for(node).space(node)
        splittable = [d for d, kind in enumerate(space.kinds) if kind != FIXED]
        on: dict[int, list[tuple[str, int]]] = {}
        for axis in axes:
            d = rng.choice([None, *splittable])
            if d is not None:
                on.setdefault(d, []).append(axis)
        if any(space.sizes[d] % math.prod(s for _, s in a) for d, a in on.items()):
            indivisible.append(node.name)
        out[node.name] = user_form(space, on, named=rng.random() < 0.5)
    return out, indivisible


@dataclass(frozen=True)
class NotDividing:
    """A strategy for one op that puts mesh axes on a dim whose size they do not divide: what
    its rejection must name."""

    strategies: dict[str, Any]
    op: str  # the node's name
    split: int
    axes: str | None  # "dp" or "dp*tp" when the strategy names its axes


def not_dividing(captured: Any, info: MeshInfo, rng: random.Random) -> NotDividing | None:
    """A random op, dim and mesh axes that do not divide its size, in a random form; None
    where every size divides."""
    axes = [(name, size) for name, size in zip(info.names, info.sizes, strict=True) if size > 1]
    groups = [[a] for a in axes] + ([axes] if len(axes) > 1 else [])
    candidates = []
    for node in _op_nodes(captured):
        space = rule_for(node).space(node)
        for d, (size, kind) in enumerate(zip(space.sizes, space.kinds, strict=True)):
            if kind != FIXED:
                candidates += [(node, d, g) for g in groups if size % math.prod(s for _, s in g)]
    if not candidates:
        return None
    node, d, group = rng.choice(candidates)
    named = rng.random() < 0.5
    strategy = user_form(rule_for(node).space(node), {d: group}, named)
    axes = "*".join(name for name, _ in group) if named else None
    return NotDividing({node.name: strategy}, node.name, math.prod(s for _, s in group), axes)


def user_form(space: Any, on: dict[int, list[tuple[str, int]]], named: bool) -> tuple:
    """The strategy that puts mesh axes ``on`` iteration dims, as a user writes it: the named
    form (axis names per input dim) or MindSpore's tuple form (parts per input dim)."""
    if not named:
        return tuple(
            tuple(math.prod(s for _, s in on.get(d, [])) if d is not None else 1 for d in dims)
            for dims in space.ins
        )
    return tuple(
        tuple(_named(on.get(d, [])) if d is not None else None for d in dims) for dims in space.ins
    )


def _named(axes: list[tuple[str, int]]) -> Any:
    if not axes:
        return None
    return axes[0][0] if len(axes) == 1 else tuple(name for name, _ in axes)


# -- one example, inside the ranks -----------------------------------------------------------------


def check_rejection(err: ValueError, expected: NotDividing | None = None) -> str | None:
    """A rejection names the op (its node), the dim, a size and the split; for a strategy
    that does not divide, that op, that split (over its axes, in the named form) and a size
    the split does not divide. An error text, or None."""
    text = str(err)
    if re.match(r"input \w+ dim \d+ \((batch|sequence), size \d+\): not divisible by its split "
                r"\d+ over axis \w+", text):  # fmt: skip
        return None  # a batch the mesh's dp axes cannot split: found before any op's strategy
    wanted = {"the op": r" \(aten\.", "the dim": r"dim \d+", "its size": r"size \d+"}
    wanted["the split"] = r"split \d+"
    if expected is not None:
        wanted["the op"] = rf"\b{expected.op} \(aten\."
        wanted["the split"] = rf"split {expected.split}" + (
            rf" over {re.escape(expected.axes)}\b" if expected.axes else r"\b"
        )
    missing = [what for what, pattern in wanted.items() if not re.search(pattern, text)]
    sizes = [int(s) for s in re.findall(r"size (\d+)", text)]
    if expected is not None and not any(size % expected.split for size in sizes):
        missing.append(f"a size that {expected.split} does not divide")
    return f"unclear rejection (names no {', '.join(missing)}): {text}" if missing else None


def run_example(case: Case) -> list[tuple[str, str | None]]:
    """Each check of one case: ("trained" | "rejected", an error text or None),
    the same on every rank. First a strategy that does not divide must be rejected; then the
    case's strategies train as PyTorch does or are rejected clearly."""
    model, data = build(case)
    captured = capture_modes(model, data[0])
    info = mesh_info(case.mesh)
    rng = random.Random(case.seed)
    outcomes = []
    bad = not_dividing(captured, info, rng)
    if bad is not None:
        try:
            parallelize(model, data[0], case.mesh, bad.strategies, captured=captured)
            outcomes.append(("trained", f"accepted {bad}: the split does not divide"))
        except ValueError as err:
            outcomes.append(("rejected", check_rejection(err, bad)))
    strategies, indivisible = {}, []
    if case.how == "raw":
        strategies, indivisible = raw(captured, info, rng)
    elif case.how == "enumerated":
        strategies = enumerated(captured, info, rng)
    return [*outcomes, train_or_reject(case, model, data, captured, strategies, indivisible)]


def train_or_reject(
    case: Case, model: nn.Module, data: list, captured: Any, strategies: Any, indivisible: list
) -> tuple[str, str | None]:
    """``STEPS`` SGD steps of the parallel model against plain PyTorch in float64: the loss of
    every step and every parameter after the last must be equal."""
    reference = copy.deepcopy(model)
    try:
        pm = parallelize(model, data[0], case.mesh, strategies, captured=captured, zero=case.zero)
    except ValueError as err:
        return "rejected", check_rejection(err)
    if indivisible:
        return "trained", f"accepted splits that do not divide: {indivisible} of {strategies}"
    opt = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    problems = []
    for step, batch in enumerate(data):
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_ref = reference(*batch)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        try:
            torch.testing.assert_close(loss, loss_ref)
        except AssertionError as err:
            problems.append(f"loss of step {step}: {err}")
    full = pm.full_state_dict()  # a collective: every rank calls it
    for name, want in reference.state_dict().items():
        try:
            torch.testing.assert_close(full[name], want)
        except AssertionError as err:
            problems.append(f"{name}: {err}")
    return "trained", "\n".join(problems) or None


def cases(world: int) -> Any:
    from hypothesis import strategies as st

    size = st.integers(1, 17)
    mlp = st.tuples(st.just("mlp"), st.tuples(size, size, size))
    attention = st.tuples(
        st.just("attention"), st.tuples(size, size, st.integers(1, 3), size, st.integers(0, 1))
    )
    return st.builds(
        lambda model, *rest: Case(model[0], model[1], *rest),
        st.one_of(mlp, attention),
        size,
        st.sampled_from(MESHES[world]),
        st.sampled_from(
            ["enumerated", "raw", "default"] if world > 1 else ["enumerated", "default"]
        ),
        st.integers(0, 3),
        st.integers(0, 2**31),
    )


def run_world(world: int, num_examples: int) -> dict[str, int]:
    """Every example on this rank: how many examples, and how many checks trained or were
    rejected."""
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings

    counts = {"examples": 0, "trained": 0, "rejected": 0}
    failed: list[BaseException] = []

    @settings(
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        max_examples=num_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(world))
    def example(case: Case) -> None:
        if failed:  # Hypothesis replays a failing example: fail again without a collective
            raise failed[0]
        try:
            outcomes = run_example(case)
        except BaseException as err:  # a crash: this rank leaves, run_ranks stops the others
            failed.append(RuntimeError(f"{case}: {traceback.format_exc()}"))
            raise failed[0] from err
        errors = [error for _, error in outcomes if error]
        rejected = sum(outcome == "rejected" for outcome, _ in outcomes)
        counts["examples"] += 1
        for outcome, _ in outcomes:
            counts[outcome] += 1
        flags = torch.tensor([float(len(errors)), float(rejected)])
        if dist.is_initialized():
            dist.all_reduce(flags)  # every rank learns of a failure before the next example
        if flags[0] or flags[1] != rejected * world:
            failed.append(AssertionError(f"{case}: {errors or 'another rank failed'}"))
            raise failed[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's, once per capture
        example()
    return counts


@pytest.mark.parametrize("world", sorted(MESHES))
def test_uneven_shapes_train_as_pytorch_or_are_rejected(world: int) -> None:
    if world == 1:
        counts = [run_world(1, EXAMPLES[1])]
    else:
        counts = run_ranks(run_world, world, world, EXAMPLES[world], timeout=300)
    assert all(c == counts[0] for c in counts), counts
    assert counts[0]["examples"] == EXAMPLES[world], counts
    assert counts[0]["trained"] > 0, counts
    if world > 1:
        assert counts[0]["rejected"] > 0, counts
