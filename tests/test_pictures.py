"""Pictures: what each one draws (layout tiles, plan rows, metrics records), that each writes a
PNG, and the errors for what cannot be drawn."""

import json
import re
import sys
from typing import Any

import matplotlib.pyplot as plt
import pytest

from autoshard import Factored, Layout, Plan
from autoshard.pictures import (
    gantt_figure,
    layout_picture,
    layout_tiles,
    metrics_picture,
    metrics_records,
    plan_layers,
    plan_picture,
)

PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path) -> bool:
    data = path.read_bytes()
    return path.exists() and len(data) > len(PNG) and data.startswith(PNG)


def cells(tiles) -> dict[tuple[int, int], list[tuple[int, ...]]]:
    """Every element of the drawn tensor and the rank groups of the tiles covering it."""
    out: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for rows, cols, ranks in tiles:
        for i in range(rows.start, rows.stop):
            for j in range(cols.start, cols.stop):
                out.setdefault((i, j), []).append(ranks)
    return out


def plan_dict() -> dict:
    rows = [
        {"layer": "wte", "blocks": 1, "compute_s": 2e-4, "comm_s": 0.0, "memory_bytes": 3e8},
        {"layer": "layers.*", "blocks": 12, "compute_s": 1.5e-3, "comm_s": 2e-4,
         "memory_bytes": 4e8},
        {"layer": "optimizer step", "blocks": 1, "compute_s": 5e-4, "comm_s": 0.0,
         "memory_bytes": 0.0},
    ]  # fmt: skip
    return {
        "mesh": {"dp": 2, "tp": 2},
        "strategies": {},
        "predicted": {"step_time_s": 0.0216, "peak_memory_bytes": 5.2e9, "layers": rows},
    }


def test_dp_tp_tiles_cover_the_tensor_once(tmp_path):
    layout = Layout.from_named((8, 8), ("dp", "tp"), {"dp": 2, "tp": 2})
    tiles = layout_tiles(layout)
    assert tiles == [
        (slice(0, 4), slice(0, 4), (0,)),
        (slice(0, 4), slice(4, 8), (1,)),
        (slice(4, 8), slice(0, 4), (2,)),
        (slice(4, 8), slice(4, 8), (3,)),
    ]
    covered = cells(tiles)
    assert set(covered) == {(i, j) for i in range(8) for j in range(8)}
    assert all(len(groups) == 1 for groups in covered.values())
    out = layout_picture(layout, tmp_path / "deep" / "dp_tp.png")
    assert out == tmp_path / "deep" / "dp_tp.png" and is_png(out)


def test_replicated_and_partial_tiles_list_every_holder(tmp_path):
    assert layout_tiles(Layout.replicated((4, 6), 4)) == [(slice(0, 4), slice(0, 6), (0, 1, 2, 3))]
    rows_over_dp = Layout.from_named((8, 4), ("dp", None), {"dp": 2, "tp": 2}, partial=("tp",))
    assert [t[2] for t in layout_tiles(rows_over_dp)] == [(0, 1), (2, 3)]
    assert is_png(layout_picture(rows_over_dp, tmp_path / "partial.png", title="x"))


def test_factored_and_leading_dims(tmp_path):
    qkv = Layout.from_named((4, 12), (None, Factored((3, 4), (None, "tp"))), {"tp": 2})
    tiles = layout_tiles(qkv)
    assert len(tiles) == 6  # each rank holds its half of q, k and v
    assert [t[1] for t in tiles if t[2] == (0,)] == [slice(0, 2), slice(4, 6), slice(8, 10)]
    assert all(len(groups) == 1 for groups in cells(tiles).values())
    assert len(cells(tiles)) == 4 * 12
    batch = Layout.from_named((4, 8, 6), ("dp", None, "tp"), {"dp": 2, "tp": 2})
    assert [t[2] for t in layout_tiles(batch)] == [(0,), (1,)]  # the slice [0] is on dp=0
    assert is_png(layout_picture(batch, tmp_path / "three_dims.png"))
    assert layout_tiles(Layout.from_named((8,), ("tp",), {"tp": 2}))[1] == (
        slice(0, 1),
        slice(4, 8),
        (1,),
    )


def test_plan_picture(tmp_path):
    data = plan_dict()
    assert [r["layer"] for r in plan_layers(data)[1]] == ["wte", "layers.*", "optimizer step"]
    assert is_png(plan_picture(data, tmp_path / "plan.png"))
    plan = Plan(
        mesh=None, nodes={}, params={}, inputs={}, outputs=[], warnings=[], json=data, searched=True
    )
    assert is_png(plan_picture(plan, tmp_path / "from_plan.png"))
    with pytest.raises(ValueError, match="json is None"):
        plan_picture(Plan(None, {}, {}, {}, [], []), tmp_path / "none.png")
    del data["predicted"]["layers"]
    with pytest.raises(ValueError, match="'layers'"):
        plan_picture(data, tmp_path / "missing.png")
    assert not (tmp_path / "missing.png").exists()


def test_metrics_picture(tmp_path):
    log = tmp_path / "train.jsonl"
    lines = [
        {"step": s, "loss": 5.0 / s, "step_s": 0.1, "samples_per_s": 80.0 + s, "bytes_sent": 0}
        for s in range(1, 6)
    ]
    log.write_text("\n".join(json.dumps(r) for r in lines) + '\n{"note": "resumed"}\n\n')
    assert [r["step"] for r in metrics_records(log)] == [1, 2, 3, 4, 5]
    # a run killed at step 5 (its last line cut), resumed from step 3's checkpoint: steps 4
    # and 5 are the resumed run's
    resumed = [{"step": s, "loss": 0.5, "samples_per_s": 90.0} for s in (4, 5, 6)]
    with log.open("a") as f:
        f.write('{"step": 6, "lo\n' + "\n".join(json.dumps(r) for r in resumed) + "\n")
    got = metrics_records(log)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in got[3:]] == [0.5, 0.5, 0.5] and got[2]["loss"] == 5.0 / 3
    assert is_png(metrics_picture(log, tmp_path / "from_file.png"))
    tokens = [{"step": s, "loss": 1.0, "tokens_per_s": 1e4} for s in range(3)]
    assert is_png(metrics_picture(tokens, tmp_path / "from_list.png"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"note": "no losses here"}\n')
    with pytest.raises(ValueError, match="empty.jsonl"):
        metrics_picture(empty, tmp_path / "empty.png")
    with pytest.raises(ValueError, match="no metrics records"):
        metrics_picture([], tmp_path / "empty.png")


def test_no_figure_stays_open(tmp_path):
    before = plt.get_fignums()
    layout_picture(Layout.replicated((2, 2), 2), tmp_path / "a.png")
    plan_picture(plan_dict(), tmp_path / "b.png")
    assert plt.get_fignums() == before


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pictures need matplotlib: pip install matplotlib"):
        plan_picture(plan_dict(), tmp_path / "plan.png")


def test_the_readme_install_line_brings_what_pictures_need():
    """``pip install -e .`` (no extras) must be enough for ``autoshard train --picture``: the
    README's own example ended in an ImportError when matplotlib was an extra."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    needed = {re.split(r"[<>=!~ ]", d)[0] for d in project["project"]["dependencies"]}
    assert "matplotlib" in needed
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "pip install -e . && autoshard demo" in readme and "--picture metrics.png" in readme


def _gantt_texts(microbatches: int) -> tuple[Any, list[list[Any]]]:
    from autoshard.schedule import make_schedule, simulate, unit_cost

    timeline = simulate(make_schedule("zb-h1", 4, microbatches), unit_cost)
    events = [[(str(e.action), e.start, e.end) for e in rank] for rank in timeline.events]
    fig = gantt_figure([("zb-h1", events)], scale=1.0, unit="units")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    rows: dict[float, list] = {}
    for text in fig.axes[0].texts:
        rows.setdefault(text.get_position()[1], []).append(text.get_window_extent(renderer))
    return fig, [sorted(boxes, key=lambda b: b.x0) for boxes in rows.values()]


def test_gantt_charts_have_a_legend_and_labels_that_never_overlap() -> None:
    """The kinds' colours were named nowhere, and at 96 micro-batches the bars' numbers ran
    into each other."""
    for microbatches in (4, 100):
        fig, rows = _gantt_texts(microbatches)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["F forward", "I backward for inputs", "W backward for weights"]
        labels = sum(len(r) for r in rows)
        for boxes in rows:
            assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:], strict=False)), microbatches
        if microbatches == 4:
            assert labels == 4 * 4 * 3  # every F, I and W of every rank numbered
        else:
            assert labels < 4 * 100 * 3  # only those that fit
            assert "(micro-batch numbers where they fit)" in fig.axes[0].get_title(loc="left")
