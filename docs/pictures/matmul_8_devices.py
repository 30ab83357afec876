"""Draw the seeds' MatMul example from autoshard's own planner: ``Y = X @ W`` on 8 devices with
strategy ((2, 1), (1, 4)). Run: ``python docs/pictures/matmul_8_devices.py``."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from autoshard.graph.capture import capture  # noqa: E402
from autoshard.mesh import mesh_info  # noqa: E402
from autoshard.search.semi import plan_graph  # noqa: E402


class MatMul(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, w)


def main() -> None:
    graph = capture(MatMul(), (torch.randn(4, 6), torch.randn(6, 8)))
    plan = plan_graph(graph, mesh_info(8), {"mm": ((2, 1), (1, 4))})
    x_layout, w_layout = plan.nodes["mm"].strategy.ins
    y_layout = plan.nodes["mm"].strategy.outs[0]
    fig, axes = plt.subplots(2, 4, figsize=(10, 4.6))
    for rank, ax in enumerate(axes.flat):
        rows = x_layout.local_index(rank)[0]
        cols = w_layout.local_index(rank)[1]
        x_part = rows.start // (x_layout.shape[0] // 2)
        w_part = cols.start // (w_layout.shape[1] // 4)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.add_patch(plt.Rectangle((0.05, 0.35), 0.4, 0.5, color=f"C{x_part}", alpha=0.35))
        ax.add_patch(plt.Rectangle((0.55, 0.35), 0.4, 0.5, color=f"C{2 + w_part}", alpha=0.35))
        ax.text(0.25, 0.6, f"X$_{x_part}$", ha="center", va="center", fontsize=14)
        ax.text(0.75, 0.6, f"W$_{w_part}$", ha="center", va="center", fontsize=14)
        ax.text(0.5, 0.15, f"Y$_{{{x_part}{w_part}}}$ = X$_{x_part}$ W$_{w_part}$", ha="center")
        ax.set_title(f"device {rank}  coords {x_layout.coordinates(rank)}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        "MatMul X[4,6] @ W[6,8], strategy ((2, 1), (1, 4)) on 8 devices\n"
        f"X {x_layout}   W {w_layout}   Y {y_layout}   (device matrix {x_layout.mesh})",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(__file__).with_suffix(".png")
    fig.savefig(out, dpi=90)
    print(out)


if __name__ == "__main__":
    main()
