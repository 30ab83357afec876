"""Offload priced per pipeline stage (docs/parallelism/offload.md, "Planning").

A pipeline's stage plan is priced for the whole model and one micro-batch on one stage's
sub-mesh (``cost.pipeline``); with offload that estimate is an ``OffloadEstimate``: its device
tier already lacks what the offload moved, and its host and NVMe tiers, and the seconds of each
kind of transfer and of the host's update, are the whole model's. A stage takes its share of
them, by its parameters' bytes (``Piece.share``) for the state and by what it keeps for
backward for the activations, placed on the pipeline's timeline:

- once a step, after the stage's last micro-batch's backward: the gradients' way to the host,
  the host's update and the copy back, the NVMe stream, the embedding rows' update (what the
  one-program estimate leaves exposed of them, the stage's share); the step ends when the
  slowest stage's update does;
- each micro-batch: ZeRO 3's shards fetched ahead of forward and backward, the activations
  sent during forward and brought back during backward, the embedding rows in and their
  gradients out: they lengthen each ``F`` and ``B`` the simulator plays;
- memory: each stage's state tiers are its share of the estimate's; the activations offloaded
  are those of every micro-batch the stage holds at once (``Timeline.in_flight``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.cost.offload import OffloadEstimate

STATE_KINDS = ("parameters", "gradients", "optimizer")
#: the one-program estimate's offload terms that run once a micro-batch, by pass; the others
#: (the gradients' way to the host, the host's update, NVMe) once a step
FORWARD_PARTS = {"parameters_forward": 1.0, "activations_to_host": 1.0, "embedding_rows": 0.5}
BACKWARD_PARTS = {"parameters_backward": 1.0, "activations_back": 1.0, "embedding_rows": 0.5}
ACTIVATION_PARTS = ("activations_to_host", "activations_back")


@dataclass(frozen=True)
class StagedOffload:
    """An offloaded stage plan's offload over its pipeline stages: each stage's share of the
    state (``shares``) and of the activations kept for backward (``kept``)."""

    est: OffloadEstimate
    shares: tuple[float, ...]
    kept: tuple[float, ...]

    @classmethod
    def of(cls, est: Any, pieces: Sequence[Any]) -> StagedOffload | None:
        """The offload of ``est`` over the stages ``pieces`` (``cost.pipeline.Piece``); None
        where ``est`` offloads nothing."""
        if not isinstance(est, OffloadEstimate) or not est.offloaded:
            return None
        off = est.offloaded
        # the runtime runs both under stages; which stage holds a table and each stage's
        # share of the files are not priced yet
        if off.embeddings or (off.parameters and off.nvme):
            raise ValueError(
                f"offload={off.as_json()}: host embedding tables and ZeRO 3's shards in files "
                "are not yet planned with pipeline stages (the optimizer's, NVMe's, parameters' "
                "and activations' offload are)"
            )
        kept = sum(p.kept for p in pieces) or 1.0
        return cls(est, tuple(p.share for p in pieces), tuple(p.kept / kept for p in pieces))

    def _share(self, s: int, name: str) -> float:
        return self.kept[s] if name in ACTIVATION_PARTS else self.shares[s]

    def seconds(self, stage_seconds: Sequence[Sequence[float]]) -> tuple[tuple[float, float], ...]:
        """Each stage's (forward, backward) seconds a micro-batch with its transfers."""
        parts = self.est.offload_parts
        out = []
        for s, (forward, backward) in enumerate(stage_seconds):
            fwd = sum(k * parts.get(n, 0.0) * self._share(s, n) for n, k in FORWARD_PARTS.items())
            bwd = sum(k * parts.get(n, 0.0) * self._share(s, n) for n, k in BACKWARD_PARTS.items())
            out.append((forward + fwd, backward + bwd))
        return tuple(out)

    def after(self, s: int) -> float:
        """Seconds stage ``s`` waits after its last backward: its share of the host's step."""
        once = set(self.est.offload_parts) - set(FORWARD_PARTS) - set(BACKWARD_PARTS)
        return self.shares[s] * sum(self.est.offload_parts[n] for n in once)

    def tiers(
        self,
        memory: list[dict[str, float]],
        in_flight: Sequence[int],
        per_rank: Callable[[list[dict[str, float]]], list[dict[str, float]]],
    ) -> dict[str, Any]:
        """The fields ``cost.pipeline.OffloadPipelineEstimate`` adds: ``memory`` (each
        stage's device bytes) less the activations offloaded, each rank's host and NVMe
        tiers, what is offloaded and the offload's terms for the stage holding the most state."""
        est, host, nvme = self.est, [], []
        for s, mem in enumerate(memory):
            moved = min(self.kept[s] * est.host["activations"] * in_flight[s], mem["activations"])
            mem["activations"] -= moved
            host.append({k: self.shares[s] * est.host[k] for k in STATE_KINDS})
            host[-1]["activations"] = moved
            nvme.append({k: self.shares[s] * v for k, v in est.nvme.items()})  # no activations
        busiest = max(range(len(memory)), key=lambda s: self.shares[s])
        return {
            "memory": tuple(per_rank(memory)),
            "offloaded": est.offloaded,
            "host_by_rank": tuple(per_rank(host)),
            "nvme_by_rank": tuple(per_rank(nvme)),
            "offload_parts": {n: self._share(busiest, n) * v for n, v in est.offload_parts.items()},
        }


__all__ = ["StagedOffload"]
