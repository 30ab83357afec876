"""Print the signature part of docs/api.md from the code.

    python docs/make_api.py

For every public name, in the page's order: its section, its heading and, for a callable, a
code block with its signature as ``inspect.signature`` gives it (a method's without ``self``;
one parameter per line when the one-line form is long). The sentences that describe each name
on the page are written by hand between these blocks; tests/test_docs.py fails when a
signature on the page differs from the code's or a public name has no heading.
"""

from __future__ import annotations

import inspect
from typing import Any

import autoshard

#: the page's sections: (title, names under ``autoshard``); ``Class.method`` is one of the
#: class's methods, shown as a signature block under the class's heading
SECTIONS: list[tuple[str, list[str]]] = [
    (
        "Parallelizing a model",
        [
            "parallelize",
            "Options",
            "Options.replace",
            "shard_inputs",
            "single_device",
            "capture_modes",
            "ParallelModule",
            "ParallelModule.no_sync",
            "ParallelModule.program",
            "ParallelModule.local_tensors",
            "ParallelModule.holders",
            "ParallelModule.layout_of",
            "ParallelModule.state_bytes",
            "ParallelModule.full_state_dict",
            "ParallelModule.load_full_state_dict",
            "ParallelModule.state_dict",
            "ParallelModule.load_state_dict",
        ],
    ),
    (
        "Planning",
        [
            "plan",
            "Plan",
            "Plan.save",
            "Plan.zero_level",
            "Plan.digests",
            "ClusterSpec",
            "ClusterSpec.load",
            "ClusterSpec.save",
            "ClusterSpec.with_devices",
            "PRESETS",
        ],
    ),
    (
        "Training",
        [
            "clip_grad_norm_",
            "Precision",
            "GradScaler",
            "GradScaler.scale",
            "GradScaler.unscale_",
            "GradScaler.step",
            "GradScaler.update",
            "GradScaler.get_scale",
            "GradScaler.state_dict",
            "GradScaler.load_state_dict",
        ],
    ),
    (
        "Data",
        [
            "data",
            "data.loader",
            "data.ShardLoader",
            "data.ShardLoader.set_epoch",
            "data.ShardLoader.state_dict",
            "data.ShardLoader.load_state_dict",
            "data.ShardSampler",
            "data.ShardSampler.order",
            "data.ShardSampler.batches",
            "data.batch_shard",
            "data.END_OF_EPOCH",
        ],
    ),
    (
        "Checkpoints and models built on meta",
        ["save", "load", "latest", "meta_init", "materialize"],
    ),
    (
        "Meshes, layouts and redistribution",
        [
            "init_mesh",
            "Layout",
            "Layout.from_named",
            "Layout.from_strategy",
            "Layout.replicated",
            "Layout.from_placements",
            "Layout.to_placements",
            "Layout.local_shape",
            "Layout.local_index",
            "Layout.without_partial",
            "Layout.view",
            "Layout.permute",
            "Layout.transpose",
            "Layout.chunk",
            "Factored",
            "redistribution_plan",
            "RedistributionPlan",
            "RedistributionPlan.bytes_on",
            "Step",
            "Step.bytes_on",
            "redistribute",
            "shard_tensor",
            "gather_tensor",
        ],
    ),
    (
        "Errors",
        [
            "CaptureError",
            "CheckpointError",
            "CheckpointDamaged",
            "LayoutError",
            "MeshError",
            "NonFiniteGradientError",
            "PlanMismatchError",
            "PlanningError",
            "StrategyError",
        ],
    ),
]

#: longest one-line signature; a longer one is shown one parameter per line
WIDTH = 96


def resolve(name: str) -> tuple[Any, bool]:
    """The object ``autoshard.<name>`` and whether it is a method called on an instance
    (its first parameter, ``self``, is not shown)."""
    parent: Any = autoshard
    obj: Any = autoshard
    for part in name.split("."):
        parent, obj = obj, getattr(obj, part)
    method = inspect.isclass(parent) and inspect.isfunction(inspect.getattr_static(parent, part))
    return obj, method


def _signature(name: str) -> inspect.Signature | None:
    obj, method = resolve(name)
    if not callable(obj):
        return None
    try:
        sig = inspect.signature(obj)
    except ValueError:  # an exception class: a constructor implemented in C
        return None
    if method:
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def signature(name: str) -> str | None:
    """``str(inspect.signature(...))`` of ``autoshard.<name>``, or None where it has none."""
    sig = _signature(name)
    return None if sig is None else str(sig)


def _top_level_parts(text: str) -> list[str]:
    """``text`` cut at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def signature_block(name: str) -> str | None:
    """The code shown for ``autoshard.<name>``: its name and signature, wrapped when long."""
    sig = _signature(name)
    if sig is None:
        return None
    full = f"autoshard.{name}"
    if len(full) + len(str(sig)) <= WIDTH:
        return full + str(sig)
    params = str(sig.replace(return_annotation=inspect.Signature.empty))
    returns = str(sig)[len(params) :]
    lines = "".join(f"    {p},\n" for p in _top_level_parts(params[1:-1]))
    return f"{full}(\n{lines}){returns}"


def missing() -> list[str]:
    """Public names (``autoshard.__all__``, ``autoshard.data.__all__``) the sections leave out."""
    listed = {name for _, names in SECTIONS for name in names}
    public = list(autoshard.__all__) + [f"data.{n}" for n in autoshard.data.__all__]
    return [name for name in public if name not in listed]


def main() -> None:
    if missing():
        raise SystemExit(f"docs/make_api.py: add to SECTIONS: {', '.join(missing())}")
    for title, names in SECTIONS:
        print(f"## {title}\n")
        for name in names:
            owner = name.rpartition(".")[0]
            if not (owner and inspect.isclass(resolve(owner)[0])):
                print(f"### `autoshard.{name}`\n")
            block = signature_block(name)
            if block is not None:
                print(f"```python\n{block}\n```\n")


if __name__ == "__main__":
    main()
