"""The ``autoshard`` command's start, imported first by the package: in that command (its
script, or ``python -m autoshard.cli``) the garbage collector is off from here, before torch
is imported, whose objects a collection would walk (0.1 s of the 3 s a plan takes).
``cli.main`` turns it on again for a command that does not plan and exit; anywhere else
nothing changes."""

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


#: whether the collector was paused here (``cli.main`` reads it, once)
PAUSED = gc.isenabled() and the_command()
if PAUSED:
    gc.disable()
