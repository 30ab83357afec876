"""The runtime's entry room: ``parallelize`` under its options (``parallelize``), how it gets
its plans and checks they fit (``planned``; ``check_plan_fits``: a plan file against a model),
and the same with pipeline stages (``staged``)."""

from autoshard.runtime.entry.parallelizing import parallelize
from autoshard.runtime.entry.planned import PlanMismatchError, check_plan_fits

__all__ = ["PlanMismatchError", "check_plan_fits", "parallelize"]
