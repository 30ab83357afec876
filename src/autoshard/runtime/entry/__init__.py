"""The runtime's entry room: ``parallelize`` under its options (``parallelize``), how it gets
its plans and checks they fit (``planned``), and the same with pipeline stages (``staged``)."""

from autoshard.runtime.entry.parallelizing import parallelize
from autoshard.runtime.entry.planned import PlanMismatchError

__all__ = ["PlanMismatchError", "parallelize"]
