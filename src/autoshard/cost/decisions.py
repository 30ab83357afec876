"""What the cost model reads of a plan: a typed view of its decisions, defined here, below the
searches that make plans (``search.Plan`` has every member, so a Plan is one), so that
``cost/`` names what it prices without importing the layer above it or reading it through
``Any``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from autoshard.layout import Layout
from autoshard.mesh import MeshInfo
from autoshard.ops import Strategy
from autoshard.precision import Precision


class OpDecisions(Protocol):
    """One op's: its strategy, the moves of its inputs (index -> (from, to)), the sums of
    its inputs' gradients it runs (index -> (partial, whole)) and the moves it takes from an
    earlier reader of the same value (index -> that reader), which cost it nothing."""

    @property
    def strategy(self) -> Strategy: ...

    @property
    def moves(self) -> Mapping[int, tuple[Layout, Layout]]: ...

    @property
    def grad_reduce(self) -> Mapping[int, tuple[Layout, Layout]]: ...

    @property
    def reuses(self) -> Mapping[int, str]: ...


class ParamDecisions(Protocol):
    """One parameter's or buffer's: its stored layout, its gradient before its one sum (None:
    summed by its readers, or no gradient), and whether that sum was moved to it from the
    activation looked up from it."""

    @property
    def layout(self) -> Layout: ...

    @property
    def grad_partial(self) -> Layout | None: ...

    @property
    def from_value(self) -> bool: ...


class PlanDecisions(Protocol):
    """A whole plan's decisions, as ``estimate`` prices them."""

    @property
    def mesh(self) -> MeshInfo: ...

    @property
    def nodes(self) -> Mapping[str, OpDecisions]: ...

    @property
    def params(self) -> Mapping[str, ParamDecisions]: ...

    @property
    def inputs(self) -> Mapping[str, Layout]: ...

    @property
    def outputs(self) -> Sequence[tuple[Layout, Layout]]: ...

    @property
    def shared_reduce(self) -> Mapping[str, tuple[Layout, Layout]]: ...

    @property
    def precision(self) -> Precision | None: ...

    def zero_level(self, fqn: str) -> int: ...


__all__ = ["OpDecisions", "ParamDecisions", "PlanDecisions"]
