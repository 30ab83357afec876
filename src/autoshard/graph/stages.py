"""Pipeline stages of a captured graph: contiguous runs of its ops, each with the values it
receives from the stages before and the values it hands on to the stages after.

A stage begins at an op; ``cut_at_modules`` takes the module paths where stages 2, 3, ...
begin (``parallelize(stages=[...])``), ``cut_balanced`` puts the cuts between repeated blocks
so the stages' model FLOPs are as even as they can be (the first stage keeps what comes
before the blocks, the embedding; the last what comes after, the head and the loss). The
model's inputs reach every stage (each rank is given the batch); parameters live on the
stages that read them (a weight tied between the embedding and the head on both).

A value made from the model's inputs, buffers and constants only (rotary tables, masks,
positions: no gradient, no randomness, no parameter) is not sent: each stage that reads it
computes it again (``again``), which is cheaper than a message per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.graph.opgraph import OpGraph


class StageError(ValueError):
    """Stages that cannot be cut as asked: a module no op runs in, paths out of order, more
    stages than the model has places to cut."""


@dataclass(frozen=True)
class StageCut:
    """``stage_of``: each op's (and getitem's) stage by node name; ``receives[s]`` the values
    made before stage ``s`` that it or a later stage reads, in graph order (what its program
    takes after the model's inputs); ``sends[s] == receives[s + 1]``; ``params[s]`` the
    parameters and buffers its ops read; ``starts[s]`` the op it begins with; ``again[s]``
    the ops (and getitems) of earlier stages it runs again itself instead of receiving their
    values (made from inputs, buffers and constants only)."""

    num_stages: int
    stage_of: dict[str, int]
    receives: tuple[tuple[str, ...], ...]
    params: tuple[frozenset[str], ...]
    starts: tuple[str, ...]
    again: tuple[frozenset[str], ...] = ()

    def runs(self, name: str, stage: int) -> bool:
        """Whether ``stage``'s program computes the op (or getitem) ``name``."""
        return self.stage_of.get(name) == stage or (bool(self.again) and name in self.again[stage])

    def sends(self, stage: int) -> tuple[str, ...]:
        return self.receives[stage + 1] if stage + 1 < self.num_stages else ()

    def holders(self, fqn: str) -> list[int]:
        """The stages that hold parameter ``fqn`` (two for a tied weight)."""
        return [s for s in range(self.num_stages) if fqn in self.params[s]]


def _op_nodes(og: OpGraph) -> list[fx.Node]:
    return [n for n in og.graph.nodes if og[n].kind == "op"]


def cut_at_modules(og: OpGraph, starts: list[str]) -> StageCut:
    """Stages beginning at the first op run inside each module path of ``starts``."""
    ops = _op_nodes(og)
    begin = [0]
    for path in starts:
        at = next(
            (
                i
                for i, n in enumerate(ops)
                if og[n].path == path or og[n].path.startswith(path + ".")
            ),
            None,
        )
        if at is None:
            raise StageError(f"stages: no op of the model runs in module {path!r}")
        if at <= begin[-1]:
            raise StageError(
                f"stages: module {path!r} runs before the stage that should come before it; "
                "give the paths in the order the model runs them"
            )
        begin.append(at)
    return _cut(og, ops, begin)


def cut_balanced(og: OpGraph, num_stages: int) -> StageCut:
    """``num_stages`` stages cut at the starts of repeated blocks, the largest stage's model
    FLOPs as small as it can be (the blocks before the first cut go with the embedding, after
    the last with the head)."""
    ops = _op_nodes(og)
    if num_stages == 1:
        return _cut(og, ops, [0])
    candidates = _block_starts(og, ops)
    if len(candidates) < num_stages - 1:
        raise StageError(
            f"{num_stages} pipeline stages: the model has {len(candidates) + 1} runs of repeated "
            "blocks to cut into; give fewer stages or cut by hand with stages=[module paths]"
        )
    weights = [max(og[n].flops, 1.0) for n in ops]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    points = [0, *candidates, len(ops)]
    begin = _min_max_cut(points, prefix, num_stages)
    return _cut(og, ops, begin)


def _block_starts(og: OpGraph, ops: list[fx.Node]) -> list[int]:
    """Positions of the first op of every repeated block but the first of its list."""
    starts, seen = [], set()
    for i, n in enumerate(ops):
        block = og[n].block
        if block is None or block[0] not in og.repeated or block in seen:
            continue
        seen.add(block)
        if block[1] != og.repeated[block[0]][0]:
            starts.append(i)
    return starts


def _min_max_cut(points: list[int], prefix: list[float], k: int) -> list[int]:
    """The begins of ``k`` stages, cut at ``points[1:-1]``, with the least largest stage."""
    n = len(points) - 1  # segments between consecutive points
    inf = float("inf")
    # best[j][c]: the least largest stage covering points[0]..points[j] in c stages
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    back = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, n + 1):
        for c in range(1, k + 1):
            for i in range(c - 1, j):
                cost = max(best[i][c - 1], prefix[points[j]] - prefix[points[i]])
                if cost < best[j][c]:
                    best[j][c], back[j][c] = cost, i
    begin, j = [], n
    for c in range(k, 0, -1):
        j = back[j][c]
        begin.append(points[j])
    return sorted(begin)


def _cut(og: OpGraph, ops: list[fx.Node], begin: list[int]) -> StageCut:
    stage_at = {n.name: 0 for n in ops}
    for s, b in enumerate(begin):
        for n in ops[b:]:
            stage_at[n.name] = s
    stage_of: dict[str, int] = {}
    for n in og.graph.nodes:
        info = og[n]
        if info.kind == "op":
            stage_of[n.name] = stage_at[n.name]
        elif info.kind == "getitem":  # with the op whose tuple it reads
            stage_of[n.name] = stage_of[n.args[0].name]
    num = len(begin)
    free = _input_made(og)
    again: list[set[str]] = [set() for _ in range(num)]
    last_use: dict[str, int] = {}
    params: list[set[str]] = [set() for _ in range(num)]
    for n in og.graph.nodes:
        user_stage = num - 1 if n.op == "output" else stage_of.get(n.name)
        if user_stage is None:
            continue
        for arg in n.all_input_nodes:
            info = og[arg]
            if arg.op == "placeholder" and info.kind != "input":  # parameter, buffer, constant
                params[user_stage].add(info.fqn)
            elif arg.name in free and stage_of[arg.name] < user_stage and n.op != "output":
                _again(og, arg, free, again[user_stage], params[user_stage])
            elif arg.name in stage_of and stage_of[arg.name] < user_stage:
                last_use[arg.name] = max(last_use.get(arg.name, 0), user_stage)
    receives = tuple(
        tuple(
            n.name
            for n in og.graph.nodes
            if n.name in last_use and stage_of[n.name] < s <= last_use[n.name]
        )
        for s in range(num)
    )
    starts = tuple(ops[b].name for b in begin)
    return StageCut(
        num,
        stage_of,
        receives,
        tuple(frozenset(p) for p in params),
        starts,
        tuple(frozenset(a) for a in again),
    )


def _input_made(og: OpGraph) -> set[str]:
    """The ops and getitems whose values come from the model's inputs, buffers and constants
    only, with no gradient and no randomness (any stage can make them again)."""
    free: set[str] = set()
    for n in og.graph.nodes:
        info = og[n]
        if info.kind not in ("op", "getitem") or info.requires_grad:
            continue
        tags = getattr(n.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            continue
        if all(
            a.name in free or og[a].kind in ("input", "buffer") or og[a].constant is not None
            for a in n.all_input_nodes
        ):
            free.add(n.name)
    return free


def _again(og: OpGraph, node: fx.Node, free: set[str], ops: set[str], params: set[str]) -> None:
    """Add ``node`` and the free ops it is made from to ``ops``, the buffers and constants
    they read to ``params``."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.name in ops:
            continue
        ops.add(n.name)
        for a in n.all_input_nodes:
            if a.name in free:
                todo.append(a)
            elif og[a].kind != "input":
                params.add(og[a].fqn)


__all__ = ["StageCut", "StageError", "cut_at_modules", "cut_balanced"]
