"""The cost model (docs/cost.md): cluster specs and presets (``cluster``), calibration
(``calibrate``), collectives (``collectives``), compute (``compute``) and a whole plan's step
time and memory (``estimate``)."""

from autoshard.cost.cluster import PRESETS, ClusterSpec, cluster_spec
from autoshard.cost.collectives import Transfer, collective_time, grad_sync, transition
from autoshard.cost.compute import op_time
from autoshard.cost.estimate import ADAM_STATES, Estimate, Overlapped, estimate

__all__ = [
    "ADAM_STATES",
    "PRESETS",
    "ClusterSpec",
    "Estimate",
    "Overlapped",
    "Transfer",
    "cluster_spec",
    "collective_time",
    "estimate",
    "grad_sync",
    "op_time",
    "transition",
]
