"""Mixed precision policies (docs/precision.md): the dtype a model computes in, the dtype its
parameters and optimizer state are kept in, and the dtype gradient sums travel in.

``parallelize(model, batch, mesh, precision="bf16")`` captures the model in bfloat16 and runs it
so: each rank keeps its parameter shards in their own dtype (the master copy, float32 for a
float32 model, which the optimizer steps), casts them to bfloat16 where the program reads them,
and casts floating inputs too; autograd casts the gradients back, so ``.grad`` is float32 and is
summed in float32 unless ``reduce`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    ``reduce``: the dtype gradient sums travel in (None: the master weights'). ``master``: the
    dtype the parameters (the master weights), their gradients and the optimizer state are
    kept in, which is the model's own: None until a run or a plan resolves it from the model
    (``resolve``); the planner prices it. float16 compute needs loss scaling
    (``autoshard.GradScaler``): its gradients underflow otherwise."""

    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None
    master: torch.dtype | None = None

    def __post_init__(self) -> None:
        for what in ("compute", "reduce", "master"):
            object.__setattr__(self, what, _dtype(getattr(self, what), what))

    @property
    def name(self) -> str:
        if self.compute is None and self.reduce is None:
            return "fp32"
        compute = str(self.compute).removeprefix("torch.") if self.compute else "model"
        reduce = str(self.reduce).removeprefix("torch.") if self.reduce else "master"
        return f"compute {compute}, reduce {reduce}"

    def as_dict(self) -> dict[str, str | None]:
        names = ("compute", "reduce", "master")
        return {
            n: str(getattr(self, n)).removeprefix("torch.") if getattr(self, n) else None
            for n in names
        }

    def resolve(self, model: Any) -> Precision:
        """This policy with ``master`` set to the dtype of ``model``'s floating parameters
        (a module, or that dtype itself), which is what a run keeps; an error where a
        ``master`` given differs from it (cast the model instead)."""
        dtype = model if isinstance(model, torch.dtype) else _model_dtype(model)
        if self.master is not None and dtype is not None and self.master != dtype:
            raise PrecisionError(
                f"precision master={self.master}: the model's parameters are {dtype}, and a run "
                "keeps the model's own as its master weights; cast the model to "
                f"{self.master} instead"
            )
        if self.compute is None or dtype is None:
            return self
        return replace(self, master=dtype)


def _model_dtype(model: Any) -> torch.dtype | None:
    """The dtype most of ``model``'s floating parameters have (None: none floating)."""
    dtypes = [p.dtype for p in model.parameters() if p.is_floating_point()]
    return max(set(dtypes), key=dtypes.count) if dtypes else None


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
        unknown = set(value) - {"compute", "reduce", "master"}
        if unknown:
            raise PrecisionError(f"precision has no field {sorted(unknown)[0]!r}")
        return Precision(value.get("compute"), value.get("reduce"), value.get("master"))
    if isinstance(value, str) and value in PRECISIONS:
        return PRECISIONS[value]
    raise PrecisionError(
        f"precision={value!r}: expected one of {', '.join(PRECISIONS)} or a Precision"
    )


__all__ = ["PRECISIONS", "Precision", "PrecisionError", "precision_policy"]
