"""Mixed precision policies (docs/precision.md): the dtype a model computes in, the dtype its
parameters and optimizer state are kept in, and the dtype gradient sums travel in.

``parallelize(model, batch, mesh, precision="bf16")`` captures the model in bfloat16 and runs it
so: each rank keeps its parameter shards in their own dtype (the master copy, float32 for a
float32 model, which the optimizer steps), casts them to bfloat16 where the program reads them,
and casts floating inputs too; autograd casts the gradients back, so ``.grad`` is float32 and is
summed in float32 unless ``reduce`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class PrecisionError(ValueError):
    """A precision policy autoshard cannot run."""


def _dtype(value: Any, what: str) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value in _NAMES:
        dtype = _NAMES[value]
    else:
        raise PrecisionError(
            f"precision {what}={value!r}: expected a torch dtype or one of {', '.join(_NAMES)}"
        )
    if dtype is not None and not dtype.is_floating_point:
        raise PrecisionError(f"precision {what}={dtype}: not a floating dtype")
    return dtype


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype the model is captured and run in (None: the model's own).
    ``reduce``: the dtype gradient sums travel in (None: the parameters' own, float32 for
    master weights). Parameters and optimizer state stay in the model's dtype. float16
    compute needs loss scaling (``autoshard.GradScaler``): its gradients underflow otherwise."""

    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", _dtype(self.compute, "compute"))
        object.__setattr__(self, "reduce", _dtype(self.reduce, "reduce"))

    @property
    def name(self) -> str:
        if self.compute is None and self.reduce is None:
            return "fp32"
        compute = str(self.compute).removeprefix("torch.") if self.compute else "model"
        reduce = str(self.reduce).removeprefix("torch.") if self.reduce else "master"
        return f"compute {compute}, reduce {reduce}"

    def as_dict(self) -> dict[str, str | None]:
        return {
            "compute": str(self.compute).removeprefix("torch.") if self.compute else None,
            "reduce": str(self.reduce).removeprefix("torch.") if self.reduce else None,
        }


#: the named policies: float32 as the model is; bfloat16 or float16 compute with the model's
#: dtype for master weights and gradient sums
PRECISIONS = {
    "fp32": Precision(),
    "bf16": Precision(torch.bfloat16),
    "fp16": Precision(torch.float16),
}


def precision_policy(value: str | Precision | dict | None) -> Precision:
    """A Precision from its name ("fp32", "bf16", "fp16"), a dict of its fields, or itself."""
    if value is None:
        return PRECISIONS["fp32"]
    if isinstance(value, Precision):
        return value
    if isinstance(value, dict):
        unknown = set(value) - {"compute", "reduce"}
        if unknown:
            raise PrecisionError(f"precision has no field {sorted(unknown)[0]!r}")
        return Precision(value.get("compute"), value.get("reduce"))
    if isinstance(value, str) and value in PRECISIONS:
        return PRECISIONS[value]
    raise PrecisionError(
        f"precision={value!r}: expected one of {', '.join(PRECISIONS)} or a Precision"
    )


__all__ = ["PRECISIONS", "Precision", "PrecisionError", "precision_policy"]
