"""The captured model: torch.export of a model into an aten graph (``capture``)."""

from autoshard.graph.capture import Captured, CaptureError, capture, capture_modes

__all__ = ["CaptureError", "Captured", "capture", "capture_modes"]
