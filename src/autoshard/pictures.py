"""Pictures of a layout, a plan and a training run, written as PNG files.

matplotlib (a dependency) is imported only when a picture is drawn, and each
figure is a bare ``matplotlib.figure.Figure`` on an Agg canvas: it never enters pyplot's list of
open figures and never switches the backend of a notebook that calls these functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from autoshard.layout import Layout
from autoshard.schedule import parse_action

DPI = 120
#: the throughput field a metrics record carries, first found wins, with its axis label
#: (``autoshard train`` writes one of them: tokens for a model fed token ids)
THROUGHPUT_FIELDS = (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s"))

Tile = tuple[slice, slice, tuple[int, ...]]


def _figure(**kwargs: Any) -> Any:
    """A figure on its own Agg canvas, outside pyplot."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("pictures need matplotlib: pip install matplotlib") from None
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


# -- layouts --------------------------------------------------------------------------------


def _runs(index: slice | torch.Tensor) -> list[tuple[int, int]]:
    """The contiguous runs ``(start, stop)`` of one dim's part of ``Layout.local_index``: one for
    a slice, one per block of a factored dim's index list."""
    if isinstance(index, slice):
        return [(index.start, index.stop)]
    values = index.tolist()
    runs = []
    for value in values:
        if runs and runs[-1][1] == value:
            runs[-1][1] = value + 1
        else:
            runs.append([value, value + 1])
    return [(start, stop) for start, stop in runs]


def _holds_first(index: slice | torch.Tensor) -> bool:
    if isinstance(index, slice):
        return index.start == 0 and index.stop > 0
    return bool((index == 0).any())


def layout_tiles(layout: Layout) -> list[Tile]:
    """The tiles of ``layout``'s global tensor as ``(rows, cols, ranks)``, ordered by row then
    column: what :func:`layout_picture` draws.

    The tiles cover the last two dims (a 1-D tensor is one row, ``rows`` then ``slice(0, 1)``);
    with more dims, the slice at index 0 of every leading dim, so only ranks holding that slice
    appear. A replicated tile lists every rank holding it; a factored dim gives a rank one tile
    per contiguous block it holds. Read off ``Layout.local_index``, as ``shard_tensor`` does.
    """
    held: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    for rank in layout.ranks:
        index = layout.local_index(rank)
        if not all(_holds_first(i) for i in index[:-2]):
            continue
        rows = _runs(index[-2]) if len(index) > 1 else [(0, 1)]
        cols = _runs(index[-1]) if index else [(0, 1)]
        for row in rows:
            for col in cols:
                held.setdefault((row, col), []).append(rank)
    return [
        (slice(*row), slice(*col), tuple(sorted(ranks)))
        for (row, col), ranks in sorted(held.items())
    ]


def _ranks_label(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 4 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"r{ranks[0]}-r{ranks[-1]}"
    if len(ranks) > 6:
        return ",".join(f"r{r}" for r in ranks[:3]) + f",… ({len(ranks)} ranks)"
    return ",".join(f"r{r}" for r in ranks)


def _layout_notes(layout: Layout) -> str:
    """The subtitle: the mesh, the slice shown of a tensor with leading dims, pending sums."""
    mesh = " x ".join(f"{n}={s}" for n, s in zip(layout.axis_names, layout.mesh, strict=True))
    notes = [f"mesh {mesh} over {len(layout.ranks)} ranks" if mesh else "on one rank"]
    if len(layout.shape) > 2:
        lead = len(layout.shape) - 2
        notes.append(f"showing [{'0, ' * lead}:, :] of shape {list(layout.shape)}")
    if layout.partial:
        notes.append("pending sum over " + ",".join(layout.axis_names[a] for a in layout.partial))
    return "; ".join(notes)


def layout_picture(layout: Layout, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``layout``'s global tensor as a grid of tiles, each coloured and labelled by the
    rank(s) holding it (:func:`layout_tiles`); the title defaults to the layout's ``str``."""
    tiles = layout_tiles(layout)
    num_rows = layout.shape[-2] if len(layout.shape) > 1 else 1
    num_cols = layout.shape[-1] if layout.shape else 1
    ratio = min(max(num_rows / max(num_cols, 1), 0.15 if len(layout.shape) < 2 else 0.35), 1.2)
    fig = _figure(figsize=(7.0, 1.8 + 5.0 * ratio))
    from matplotlib import colormaps
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator

    groups = list(dict.fromkeys(ranks for _, _, ranks in tiles))
    colours = colormaps["tab10" if len(groups) <= 10 else "tab20"]
    ax = fig.add_subplot()
    size = max(6.0, 12.0 - 0.1 * len(tiles))
    for rows, cols, ranks in tiles:
        colour = colours(groups.index(ranks) % colours.N)
        ax.add_patch(
            Rectangle(
                (cols.start, rows.start),
                cols.stop - cols.start,
                rows.stop - rows.start,
                facecolor=colour,
                edgecolor="black",
                linewidth=1.0,
            )
        )
        middle = ((cols.start + cols.stop) / 2, (rows.start + rows.stop) / 2)
        ax.text(*middle, _ranks_label(ranks), ha="center", va="center", fontsize=size)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, num_cols)
    ax.set_ylim(num_rows, 0)  # row 0 on top, as a matrix is printed
    ax.set_xlabel(f"dim {len(layout.shape) - 1} (size {num_cols})")
    if len(layout.shape) > 1:
        ax.set_ylabel(f"dim {len(layout.shape) - 2} (size {num_rows})")
    else:
        ax.set_yticks([])
    ax.set_title(_layout_notes(layout), fontsize=9)
    fig.suptitle(str(layout) if title is None else title)
    fig.tight_layout()
    return _save(fig, path)


# -- plans ----------------------------------------------------------------------------------


def plan_layers(plan: Mapping[str, Any] | Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A plan's JSON dict and its per-layer rows (``plan["predicted"]["layers"]``); ``plan`` is
    that dict or an :class:`autoshard.Plan` whose ``.json`` holds it. A ValueError names the
    missing field."""
    data = plan if isinstance(plan, Mapping) else getattr(plan, "json", None)
    if data is None:
        raise ValueError(
            "plan has no searched JSON (its .json is None): draw a plan from autoshard.plan(...) "
            "or the dict `autoshard plan --json` writes"
        )
    if "predicted" not in data:
        raise ValueError("plan has no 'predicted' field: it was not priced by the search")
    if "one_stage_one_microbatch" in data.get("pipeline", {}):  # a stage plan's layers
        data = {**data, "predicted": data["pipeline"]["one_stage_one_microbatch"]}
    if "layers" not in data["predicted"]:
        raise ValueError(
            "plan['predicted'] has no 'layers' field (the per-layer breakdown): replan with an "
            "autoshard that writes it"
        )
    rows = list(data["predicted"]["layers"])
    if not rows:
        raise ValueError("plan['predicted']['layers'] is empty: no layer to draw")
    return data, rows


def _bytes_unit(nbytes: float) -> tuple[str, float]:
    return ("GiB", 2.0**30) if nbytes >= 2**30 else ("MiB", 2.0**20)


def plan_picture(plan: Mapping[str, Any] | Any, path: str | Path) -> Path:
    """Draw a searched plan layer by layer: compute and exposed communication time per row
    (stacked bars, ms) beside its memory. A repeated block's row (``layers.* ×12``) counts all
    its blocks, so the bars add up to the predicted step and memory."""
    data, rows = plan_layers(plan)
    labels = [r["layer"] + (f" ×{r['blocks']}" if r["blocks"] != 1 else "") for r in rows]
    compute = [r["blocks"] * r["compute_s"] * 1e3 for r in rows]
    comm = [r["blocks"] * r["comm_s"] * 1e3 for r in rows]
    memory = [r["blocks"] * r["memory_bytes"] for r in rows]
    unit, scale = _bytes_unit(max(memory))
    fig = _figure(figsize=(11.0, 1.6 + 0.38 * len(rows)))
    time_ax, memory_ax = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    where = range(len(rows))
    time_ax.barh(where, compute, color="C0", label="compute")
    time_ax.barh(where, comm, left=compute, color="C1", label="communication (exposed)")
    time_ax.set_yticks(where, labels)
    time_ax.invert_yaxis()  # the first row on top, as the plan lists them
    time_ax.set_xlabel("time (ms)")
    time_ax.legend(loc="lower right", fontsize=8)
    memory_ax.barh(where, [m / scale for m in memory], color="C2")
    memory_ax.set_xlabel(f"memory per rank ({unit})")
    for ax in (time_ax, memory_ax):
        ax.grid(axis="x", alpha=0.3)
    pred = data["predicted"]
    mesh = " x ".join(f"{axis}={size}" for axis, size in data["mesh"].items())
    peak_unit, peak_scale = _bytes_unit(pred["peak_memory_bytes"])
    fig.suptitle(
        f"mesh {mesh}: predicted step {pred['step_time_s'] * 1e3:.2f} ms, "
        f"peak memory {pred['peak_memory_bytes'] / peak_scale:.2f} {peak_unit} per rank"
    )
    fig.tight_layout()
    return _save(fig, path)


# -- training runs --------------------------------------------------------------------------


def metrics_records(metrics: str | Path | Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records with a loss, from a JSONL file (what ``autoshard train --log`` writes) or a
    list of dicts, one per step in step order: the log is appended to, so a step logged again
    (a run resumed from a checkpoint before it, or run afresh) keeps its latest record, and a
    line cut short by a killed run is left out. A ValueError names the file when none has a
    loss."""
    if isinstance(metrics, str | Path):
        lines = Path(metrics).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip().endswith("}")]
        where = str(metrics)
    else:
        records, where = list(metrics), "the metrics list"
    latest = {r.get("step", k): r for k, r in enumerate(records) if r.get("loss") is not None}
    if not latest:
        raise ValueError(f"{where}: no metrics records with a loss")
    return [latest[step] for step in sorted(latest)]


def metrics_picture(metrics: str | Path | Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Draw a training run's loss and throughput over its steps, two panels sharing the step
    axis. Throughput is the records' ``tokens_per_s``, else ``samples_per_s`` (what
    ``autoshard train`` writes)."""
    records = metrics_records(metrics)
    field, label = next(
        ((f, name) for f, name in THROUGHPUT_FIELDS if any(f in r for r in records)),
        THROUGHPUT_FIELDS[-1],
    )
    marker = "o" if len(records) <= 50 else None
    fig = _figure(figsize=(8.0, 6.0))
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    loss_ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=marker)
    loss_ax.set_ylabel("loss")
    fast = [r for r in records if r.get(field) is not None]
    speed_ax.plot([r["step"] for r in fast], [r[field] for r in fast], color="C1", marker=marker)
    if not fast:
        speed_ax.text(
            0.5,
            0.5,
            "no throughput in the records",
            ha="center",
            va="center",
            transform=speed_ax.transAxes,
        )
    speed_ax.set_ylabel(label)
    speed_ax.set_xlabel("step")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
    steps = f"steps {records[0]['step']}-{records[-1]['step']}"
    fig.suptitle(f"training run, {steps}: last loss {records[-1]['loss']:.4f}")
    fig.tight_layout()
    return _save(fig, path)


# -- pipeline schedules --------------------------------------------------------------------------

#: a schedule action's colour by kind
ACTION_COLOURS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "I": "#8fd19e",
    "W": "#c4ad66",
    "REDUCE_GRAD": "#8c8c8c",
}
#: the legend's words for each kind of action
ACTION_NAMES = {
    "F": "forward",
    "B": "backward",
    "I": "backward for inputs",
    "W": "backward for weights",
    "REDUCE_GRAD": "gradient sum",
}
_LABEL_POINTS = 3.8  # a digit's width at the labels' font size (6 pt), with a margin


def gantt_figure(
    timelines: Sequence[tuple[str, Sequence[Sequence[tuple[str, float, float]]]]],
    scale: float = 1e3,
    unit: str = "ms",
) -> Any:
    """The figure ``gantt_picture`` draws: the kinds' legend on top, and a micro-batch's
    number only in a bar wide enough to hold it (at 100 micro-batches most are not)."""
    width = 11.0
    fig = _figure(figsize=(width, 1.5 + 0.45 * sum(len(t) for _, t in timelines)))
    axes = fig.subplots(len(timelines), 1, squeeze=False, sharex=True)[:, 0]
    ends = [e for _, ranks in timelines for rank in ranks for _, _, e in rank]
    points = (width - 1.6) * 72 / (max(ends, default=1.0) * scale or 1.0)  # per unit, ~
    kinds: set[str] = set()
    for ax, (title, ranks) in zip(axes, timelines, strict=True):
        hidden = _gantt_bars(ax, ranks, scale, points, kinds)
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
        ax.invert_yaxis()
        note = " (micro-batch numbers where they fit)" if hidden else ""
        ax.set_title(title + note, fontsize=9, loc="left")
    axes[-1].set_xlabel(unit)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=colour, label=f"{kind} {ACTION_NAMES[kind]}")
        for kind, colour in ACTION_COLOURS.items()
        if kind in kinds
    ]
    if handles:
        fig.legend(
            handles=handles, loc="upper right", ncols=len(handles), fontsize=8, frameon=False
        )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    return fig


def _gantt_bars(ax: Any, ranks: Sequence, scale: float, points: float, kinds: set) -> int:
    """Each rank's actions as bars, labelled where the label fits (``points``: a unit of
    time's width in points); the kinds drawn are added to ``kinds``; the labels left out
    are counted."""
    hidden = 0
    for rank, events in enumerate(ranks):
        for text, start, end in events:
            action = parse_action(text)
            if action.kind not in ACTION_COLOURS or end <= start:
                continue
            kinds.add(action.kind)
            ax.barh(
                rank,
                (end - start) * scale,
                left=start * scale,
                height=0.8,
                color=ACTION_COLOURS[action.kind],
                edgecolor="white",
                linewidth=0.3,
            )
            if action.microbatch < 0:
                continue
            label = str(action.microbatch)
            if (end - start) * scale * points < _LABEL_POINTS * (len(label) + 1):
                hidden += 1
                continue
            ax.text(
                (start + end) / 2 * scale,
                rank,
                label,
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    return hidden


def gantt_picture(
    timelines: Sequence[tuple[str, Sequence[Sequence[tuple[str, float, float]]]]],
    path: str | Path,
    scale: float = 1e3,
    unit: str = "ms",
) -> Path:
    """A Gantt chart per timeline, one above the other on one time axis (predicted beside
    measured): each is (title, per rank its (action, start, end)), times drawn times
    ``scale`` in ``unit``; a compute action is a bar in its kind's colour (the legend names
    them) with its micro-batch written in it where it fits."""
    return _save(gantt_figure(timelines, scale, unit), path)


__all__ = [
    "ACTION_NAMES",
    "gantt_figure",
    "gantt_picture",
    "DPI",
    "THROUGHPUT_FIELDS",
    "layout_picture",
    "layout_tiles",
    "metrics_picture",
    "metrics_records",
    "plan_layers",
    "plan_picture",
]
