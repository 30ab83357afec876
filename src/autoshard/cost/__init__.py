"""The cost model: cluster specs (``cluster``), calibration (``calibrate``) and the estimator of
time and memory (``model``)."""

from autoshard.cost.cluster import PRESETS, ClusterSpec, cluster_spec
from autoshard.cost.model import Estimate, Transfer, estimate, grad_sync, op_time, transition

__all__ = [
    "PRESETS",
    "ClusterSpec",
    "Estimate",
    "Transfer",
    "cluster_spec",
    "estimate",
    "grad_sync",
    "op_time",
    "transition",
]
