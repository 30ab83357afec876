"""The ``autoshard`` command's start, imported first by the package: in that command (its
script, or ``python -m autoshard.cli``) the garbage collector is off from here, before torch
is imported, whose objects a collection would walk (0.1 s of the 3 s a plan takes), to the
end of the package's import (``resume``); anywhere else nothing changes."""

from __future__ import annotations

import gc
import os
import sys


def the_command() -> bool:
    """Whether this process is the ``autoshard`` command, read off the interpreter's own
    arguments."""
    argv = getattr(sys, "orig_argv", [])
    script = len(argv) > 1 and os.path.basename(argv[1]) == "autoshard"
    return script or argv[1:3] == ["-m", "autoshard.cli"]


#: whether the collector is paused here, to the end of the package's import
PAUSED = gc.isenabled() and the_command()
if PAUSED:
    gc.disable()


def resume() -> None:
    """The package imported: where the collector was paused for it, what the import made is
    kept out of every later collection (``gc.freeze``: it lives as long as the process, and
    a first collection would otherwise walk all of it) and the collector is on again."""
    global PAUSED
    if PAUSED:
        gc.freeze()
        gc.enable()
        PAUSED = False
