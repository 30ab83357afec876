"""Which offload a search plans with (docs/parallelism/offload.md, "Planning"): the one given, or
where asked to search it (``autoshard.plan`` without ``offload=``), none where a plan fits without,
else the first of a ladder of offloads that fits, from the least moved to the most: the whole
optimizer on the host, then with ZeRO 3's parameter shards too, then the host's state in NVMe files,
each only on a cluster that gives the numbers it is priced by. The device tier is the search's
memory limit; the host and NVMe tiers are checked on the plan's estimate (a node's host memory and
drives shared by its devices)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from autoshard.cost import ClusterSpec
from autoshard.cost.offload import Offload, check_cluster, ladder, tiers_fit
from autoshard.search.plans import Plan, PlanningError


def offloaded(
    searched: Callable[[Offload, int | None], Any],
    given: Mapping[str, Any] | str | None,
    zero: int | None,
    built: Callable[[Any], Plan] | None,
    cluster: ClusterSpec,
    staged: bool = False,
) -> Any:
    """The search's result under ``given`` (``"auto"``: searched as above; None: nothing
    offloaded); ``searched(offload, zero)`` runs the search, ``built(result)`` its plan (None:
    a pipeline's stage plan, whose tiers its pipeline judges); ``staged``: a pipeline's."""
    if given != "auto":
        choice = Offload.of(given)
        if choice:
            check_cluster(choice, cluster)
        level = 3 if choice.parameters and zero is None else zero
        if choice.parameters and level != 3:
            raise PlanningError(f"offload parameters with zero={zero}: it offloads ZeRO 3 shards")
        result = searched(choice, level)
        over = tiers_fit(built(result).predicted, cluster) if choice and built else None
        if over:
            raise PlanningError(f"offload {choice.describe()}: over the cluster's {over}")
        return result
    try:
        return searched(Offload(), zero)
    except PlanningError as err:
        nothing = err
    tried = []
    for choice in ladder(cluster, zero, staged):
        try:
            result = searched(choice, 3 if choice.parameters else zero)
        except PlanningError:
            tried.append(f"{choice.describe()}: over the device")
            continue
        over = tiers_fit(built(result).predicted, cluster)
        if over is None:
            return result
        tried.append(f"{choice.describe()}: over the {over}")
    raise PlanningError(f"{nothing}; nor with offload ({'; '.join(tried) or 'none priced'})")


__all__ = ["offloaded"]
