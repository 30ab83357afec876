"""Layouts: the Layout value (MindSpore's tensor layout), its normal form, the common grid of a
set of layouts, and the DTensor boundary (``Layout.to_placements`` / ``from_placements``)."""

from autoshard.layout.grid import Grid, GridState, common_grid, suffix_products
from autoshard.layout.layout import Factored, Layout
from autoshard.layout.normal import NOT_SPLIT, LayoutError, is_block_split
from autoshard.layout.views import resplit

__all__ = [
    "NOT_SPLIT",
    "Factored",
    "Grid",
    "GridState",
    "Layout",
    "LayoutError",
    "common_grid",
    "is_block_split",
    "resplit",
    "suffix_products",
]
