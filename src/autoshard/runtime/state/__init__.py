"""The runtime's state room: checkpoints through DCP (``checkpoint``; the rank's boxes of each
tensor, ``chunks``; DCP's planners and writer, imported only when a checkpoint is saved or
loaded, ``dcp_io``), their manifest of files, sizes and checksums (``manifest``), a run going
on from the newest whole one (``resuming``), and models built on the meta device
(``materialize``). The rooms above use this face only."""

from autoshard.runtime.state.checkpoint import (
    CheckpointDamaged,
    CheckpointError,
    latest,
    load,
    save,
)
from autoshard.runtime.state.manifest import damaged
from autoshard.runtime.state.meta import check_init, fill, materialize, meta_init
from autoshard.runtime.state.resuming import resume, unresumable

__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "check_init",
    "damaged",
    "fill",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "resume",
    "save",
    "unresumable",
]
