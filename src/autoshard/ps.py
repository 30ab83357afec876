"""Parameter servers (docs/parallelism/parameter-server.md) as users import them:
``import autoshard.ps`` or ``autoshard.ps.train``; the runtime's ``ps`` room does the work."""

from autoshard.runtime.ps import (
    TABLE_OPTIMIZERS,
    PSConfig,
    PSError,
    find_tables,
    row_ranges,
    split_batches,
    table_optimizer,
    train,
)

__all__ = [
    "TABLE_OPTIMIZERS",
    "PSConfig",
    "PSError",
    "find_tables",
    "row_ranges",
    "split_batches",
    "table_optimizer",
    "train",
]
