"""Which optimizers offload steps (docs/parallelism/offload.md, "Which optimizers"): those whose
update of an element reads only that element, as offload steps each tensor in parts."""

from __future__ import annotations

import inspect

import torch

#: torch.optim's optimizers whose update of an element reads only that element's parameter,
#: gradient and state (and the step count): a tensor cut in a head and a tail, its tail
#: stepped in a chunk beside others, is stepped as torch steps it whole. Adafactor (row and
#: column means), Muon (whole matrices orthogonalized), LBFGS (one flat direction), LAMB and
#: Shampoo (norms and factors of whole tensors) read more, and SparseAdam takes only sparse
#: gradients.
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """A ValueError naming ``optimizer``'s class unless it is one of ``ELEMENTWISE`` (or a
    subclass that keeps its update, ``step``): offload cuts tensors and steps their parts
    apart, which only an update element by element allows."""
    cls = type(optimizer)
    if cls in ELEMENTWISE:
        return
    base = next((b for b in ELEMENTWISE if issubclass(cls, b)), None)
    if base is not None and inspect.unwrap(cls.step) is inspect.unwrap(base.step):
        return
    names = ", ".join(b.__name__ for b in ELEMENTWISE)
    kind = f"{cls.__name__} (a subclass of {base.__name__} with its own step)" if base else None
    raise ValueError(
        f"offload['optimizer']: {kind or cls.__name__} is not an elementwise optimizer: "
        "offload steps each tensor in parts (a head on the device, a tail on the host beside "
        "other tensors' tails), which is the whole tensor's update only where each element's "
        "update reads that element alone. Offload runs torch.optim's "
        f"{names}; give one of them, or leave offload['optimizer'] out"
    )


__all__ = ["ELEMENTWISE", "check_elementwise"]
