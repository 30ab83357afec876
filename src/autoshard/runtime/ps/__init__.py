"""Parameter servers (docs/parallelism/parameter-server.md): server ranks hold a model's tables
split by rows and apply their optimizer to the rows they receive; worker ranks run the model,
pull the unique rows a batch touches before they are used and push those rows' gradients
after backward; the dense part is data parallel among the workers. Synchronous, or with a
bound on staleness."""

from autoshard.runtime.ps.job import TABLE_OPTIMIZERS, PSConfig, PSError, row_ranges
from autoshard.runtime.ps.server import table_optimizer
from autoshard.runtime.ps.training import split_batches, train
from autoshard.runtime.ps.worker import find_tables

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
