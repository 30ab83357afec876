"""The parameters' terms of a cost graph, apart from the rest: a parameter's bytes, optimizer
step and gradient sum are all that its ZeRO stage changes (docs/zero.md), so a mesh's graph is
priced once without them and once more per stage for them alone (``ParamTerms``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch.fx as fx

from autoshard.cost import ClusterSpec
from autoshard.graph import node_info
from autoshard.search import pricing
from autoshard.search.pricing import ParamUse


class _Priced(NamedTuple):
    seconds: float  # optimizer step and gradient sum
    memory: float
    bucketed: float  # the bucketed part of the gradient sum


class ParamTerms:
    """The parameters' terms of every (node, option) of a graph in the making: ``add`` one
    use, ``at`` a ZeRO stage their seconds, bytes and bucketed sums per option (flat, in the
    graph's option order). Uses alike (same layouts, same kind of parameter) are priced once."""

    def __init__(self, cluster: ClusterSpec, optimizer_states: int, leading: set[fx.Node]):
        self.cluster, self.optimizer_states, self.leading = cluster, optimizer_states, leading
        self.keys: dict[tuple, int] = {}
        self.uses: list[ParamUse] = []
        self.where: list[int] = []  # flat option index of each use
        self.which: list[int] = []  # its key
        self.factor: list[float] = []  # how many copies the real model has, per captured copy
        self.share: list[float] = []  # the weight of what runs once a step (``step_share``)

    def add(self, where: int, use: ParamUse, factor: float, share: float) -> None:
        info = node_info(use.param)
        leading = use.param in self.leading
        key = (info.kind, info.requires_grad, leading, use.whole, use.grad, use.want)
        if key not in self.keys:
            self.keys[key] = len(self.uses)
            self.uses.append(use)
        self.where.append(where)
        self.which.append(self.keys[key])
        self.factor.append(factor)
        self.share.append(share)

    def at(self, zero: int, num_options: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seconds, bytes, bucketed seconds) per option, flat, of the parameters under ZeRO
        stage ``zero``."""
        priced = np.array([self._price(use, zero) for use in self.uses]).reshape(-1, 3)
        which, where = np.asarray(self.which, np.intp), np.asarray(self.where, np.intp)
        factor, share = np.asarray(self.factor), np.asarray(self.share)
        out = []
        for column, scaled in ((0, share), (1, 1.0), (2, share)):
            values = np.zeros(num_options)
            np.add.at(values, where, factor * scaled * priced[which, column])
            out.append(values)
        return out[0], out[1], out[2]

    def _price(self, use: ParamUse, zero: int) -> _Priced:
        p, whole, grad, cluster = use.param, use.whole, use.grad, self.cluster
        zp = pricing.zero_terms(p, whole, grad, zero, self.optimizer_states, cluster)
        memory = pricing.param_bytes(p, whole, self.optimizer_states, zp)
        seconds = pricing.param_time(p, whole, cluster, zp)
        in_line, in_bucket = pricing.grad_reduce_parts(
            p, grad, use.want, cluster, zp, p in self.leading
        )
        return _Priced(seconds + in_line + in_bucket, memory, in_bucket)


__all__ = ["ParamTerms"]
