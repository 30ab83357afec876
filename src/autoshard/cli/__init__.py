"""The ``autoshard`` command line."""

from autoshard.cli.main import main

__all__ = ["main"]
