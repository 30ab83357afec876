"""The captured model: torch.export of a model (``capture``) into an OpGraph whose every node
carries what the later stages ask about it (``opgraph``)."""

from autoshard.graph.blocks import BlocksDiffer, blocks_cut, check_depth, like_block_lists
from autoshard.graph.capture import (
    CaptureError,
    call_inputs,
    capture,
    capture_modes,
    tied_names,
)
from autoshard.graph.experts import ExpertsError, experts_activation, mark_experts
from autoshard.graph.opgraph import NodeInfo, OpGraph, node_info
from autoshard.graph.stages import StageCut, StageError, cut_at_modules, cut_balanced

__all__ = [
    "BlocksDiffer",
    "CaptureError",
    "ExpertsError",
    "NodeInfo",
    "OpGraph",
    "StageCut",
    "StageError",
    "blocks_cut",
    "call_inputs",
    "capture",
    "capture_modes",
    "check_depth",
    "cut_at_modules",
    "cut_balanced",
    "experts_activation",
    "like_block_lists",
    "mark_experts",
    "node_info",
    "tied_names",
]
