"""The overlap mechanism of the cost model: communication the runtime runs beside compute,
and the time the in-line work waits for it on a timeline of one compute and one communication
stream. Gradient buckets use it today; ZeRO's prefetches and pipeline sends price their
overlap through the same two names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Overlapped:
    """Communication the runtime runs beside compute: ``seconds`` on the communication stream,
    started once ``ready`` seconds of the step's in-line work have run (a bucket's last
    gradient is made), and waited for at ``due`` (the optimizer reads the gradients)."""

    seconds: float
    ready: float
    due: float


def exposed(overlapped: list[Overlapped], efficiency: float = 1.0) -> float:
    """Seconds the in-line work waits for overlapped communication: one communication stream
    runs the transfers in the order they become ready; the in-line work stalls when it reaches
    a transfer's due point before the transfer ends, which delays everything after it. Of what
    that timeline hides, only the ``efficiency`` share is really hidden (``ClusterSpec.
    overlap_efficiency``: below 1 where transfers take the cores the compute runs on)."""
    delay = stream = 0.0
    for item in sorted(overlapped, key=lambda o: o.ready):
        start = max(stream, item.ready + delay)
        stream = start + item.seconds
        delay = max(delay, stream - item.due)
    hidden = sum(o.seconds for o in overlapped) - delay
    return delay + (1.0 - efficiency) * hidden


__all__ = ["Overlapped", "exposed"]
