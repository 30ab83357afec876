"""What a searched plan leaves undone, in words: devices that only repeat each other's work
and inputs every rank is fed whole. The search may choose both (a batch of 8 cannot keep 64
devices busy); the plan says so rather than pass them without a word."""

from __future__ import annotations

import dataclasses

from autoshard.graph import OpGraph
from autoshard.search.plans import Plan


def busy_devices(plan: Plan, og: OpGraph) -> float:
    """How many devices do distinct work, FLOPs-weighted over the ops: an op whose iteration
    space is cut into k parts on N devices has N / k devices computing each part."""
    useful = spent = 0.0
    for info in og.ops():
        chosen = plan.nodes.get(info.node.name)
        if chosen is None or not info.flops:
            continue
        space = chosen.strategy.space or chosen.strategy.outs[0]
        parts = space.global_numel // max(space.local_numel, 1) if space is not None else 1
        useful += info.flops
        spent += info.flops * plan.mesh.num_devices / max(parts, 1)
    return plan.mesh.num_devices * useful / spent if spent else float(plan.mesh.num_devices)


def plan_notes(plan: Plan, og: OpGraph) -> list[str]:
    """The plan's idle devices (when fewer than half do distinct work) and the inputs it
    feeds whole to every rank."""
    n = plan.mesh.num_devices
    notes = []
    busy = busy_devices(plan, og)
    if n > 1 and busy < n / 2:
        notes.append(
            f"only about {busy:.0f} of the {n} devices do distinct work (the rest repeat it): "
            "the shapes cannot be split further; a bigger batch or fewer devices would use them"
        )
    for name, layout in plan.inputs.items():
        if n > 1 and layout.shape and layout.global_numel == layout.local_numel:
            notes.append(f"input {name} {list(layout.shape)} is fed whole to every rank")
    return notes


def with_notes(plan: Plan, og: OpGraph) -> Plan:
    """``plan`` with its notes among its warnings and, for a plan with JSON, its JSON's
    ``warnings``."""
    notes = plan_notes(plan, og)
    if plan.json is not None and notes:
        plan.json["warnings"] = notes
    return dataclasses.replace(plan, warnings=[*plan.warnings, *notes])


__all__ = ["busy_devices", "plan_notes", "with_notes"]
