"""What ``autoshard train`` checks in the launching process, before torchrun starts a rank:
each mistake is a ValueError of one line (status 2), not a failure of every rank seconds
later (docs/failures.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autoshard.cli.train import TrainConfig, check_checkpoints
from autoshard.cli.user_fn import global_rows, parts_of, train_example, user_function

#: the pipeline and parallel settings a plan file fixes (a run under one leaves them out)
_PLANNED = ("pp", "microbatches", "schedule", "virtual_stages", "recompute", "tp", "cp")
_PLANNED += ("attention", "ep", "sequence_parallel")


def check(cfg: TrainConfig, nproc: int = 1, nnodes: str | None = None) -> None:
    """The settings, the launcher's arguments, the cluster, the parallel degrees, the plan
    file, the checkpoint directory, the target (imported and called: a missing module or
    function, or a result that is no model and data, is a ValueError naming it) and a first
    global batch of its data."""
    world = _world(nproc, nnodes)
    if cfg.servers or cfg.staleness is not None:
        _check_servers(cfg, world)
    if cfg.plan is not None:
        _check_plan_flags(cfg)
    cfg.options(per_node=nproc)  # every option in range, each error naming it
    _check_cluster(cfg, world, nproc)
    cfg.mesh(world)  # the degrees given divide the ranks together
    check_checkpoints(cfg)
    torch.manual_seed(cfg.seed)
    parts = parts_of(user_function(cfg.target), cfg.target)
    if cfg.servers:
        _check_server_model(parts)
    example = train_example(parts, cfg.batch_size)
    global_rows(example, cfg.microbatches)  # micro-batches that divide the batch
    if cfg.plan is not None:
        _check_plan(cfg, parts, example, world)


def _world(nproc: int, nnodes: str | None) -> int:
    """The ranks of the job (torchrun's elastic ``MIN:MAX`` nodes: the most)."""
    if nproc < 1:
        raise ValueError(f"--nproc-per-node {nproc}: at least 1 rank a node")
    nodes = nnodes or "1"
    try:
        count = int(nodes.rpartition(":")[2])
    except ValueError:
        raise ValueError(f"--nnodes {nodes!r}: a number of nodes, or MIN:MAX") from None
    if count < 1:
        raise ValueError(f"--nnodes {nodes}: at least 1 node")
    return nproc * count


def _check_cluster(cfg: TrainConfig, world: int, nproc: int) -> None:
    """A preset or spec file that exists and holds the job: part of one node, or whole
    nodes of it, as many ranks on each (the ``cpu`` preset's nodes are this run's ranks,
    any count of them)."""
    from autoshard.cost import cluster_spec

    spec = cluster_spec(cfg.run_cluster(per_node=nproc))
    if world > nproc and nproc != spec.devices_per_node:
        raise ValueError(
            f"--cluster {cfg.cluster}: its nodes have {spec.devices_per_node} devices, "
            f"--nproc-per-node {nproc} on {world // nproc} nodes uses {nproc} of each"
        )
    try:
        cluster_spec(spec, world)
    except ValueError as err:
        raise ValueError(f"--cluster {cfg.cluster}: {err}") from None


def _check_servers(cfg: TrainConfig, world: int) -> None:
    """Servers and workers among the ranks, a global batch they split, and none of the
    settings a worker's data-parallel float32 AdamW does not take."""
    if not cfg.servers:
        raise ValueError(f"--staleness {cfg.staleness} is for parameter servers: give --servers")
    if cfg.servers >= world:
        raise ValueError(f"--servers {cfg.servers} leaves no worker of this run's {world} ranks")
    workers = world - cfg.servers
    if cfg.batch_size % workers:
        raise ValueError(f"--batch-size {cfg.batch_size} does not split over the {workers} workers")
    given = _given(
        cfg, ("plan", *_PLANNED, "clip", "checkpoint_dir", "zero", "precision", "copies")
    )
    if given:
        raise ValueError(
            "--servers trains the dense part data parallel in float32 among the workers; "
            f"leave out {given}"
        )


def _given(cfg: TrainConfig, names: tuple[str, ...]) -> str:
    """The flags among ``names`` that ``cfg`` sets to other than their defaults."""
    default = TrainConfig(cfg.target)
    changed = [n for n in names if getattr(cfg, n) != getattr(default, n)]
    return ", ".join(f"--{n.replace('_', '-')}" for n in changed)


def _check_server_model(parts: dict[str, Any]) -> None:
    """A model with tables for servers, which returns its loss."""
    from autoshard.ps import find_tables

    if parts.get("loss_fn") is not None:
        raise ValueError("--servers trains a model that returns its loss: return no loss_fn")
    find_tables(parts["model"])


def _check_plan_flags(cfg: TrainConfig) -> None:
    if not Path(cfg.plan).is_file():
        raise ValueError(f"plan {cfg.plan!r}: no such file")
    fixed = _given(cfg, _PLANNED)
    if fixed:
        raise ValueError(
            f"--plan {cfg.plan} carries its own pipeline and parallel settings; leave out {fixed}"
        )


def _check_plan(cfg: TrainConfig, parts: dict[str, Any], example: tuple, world: int) -> None:
    """A plan file autoshard wrote, for this many ranks and for this model: its input
    layouts and strategies fit the model's captured graph."""
    from autoshard.graph import capture
    from autoshard.mesh import mesh_info
    from autoshard.runtime import check_plan_fits
    from autoshard.search import load_plan

    data = load_plan(cfg.plan)
    pipeline = data.get("pipeline") or {}
    stages = int(pipeline.get("pp", 1))
    devices = mesh_info(data["mesh"]).num_devices * stages
    if devices != world:
        raise ValueError(
            f"plan {cfg.plan!r} is for {devices} devices; this run has {world} ranks "
            "(--nproc-per-node x --nnodes); plan again for them"
        )
    if pipeline:  # a stage's plan fits a stage's graph, which only the ranks cut
        return
    graph = capture(parts["model"], example, {}, loss_fn=parts.get("loss_fn"), train=True)
    check_plan_fits(graph, cfg.plan)


__all__ = ["check"]
