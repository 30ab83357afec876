"""A capture that failed, told in one line: the user's source line, the op and the remedy.

torch.export reports a failure with pages of its own traceback and log (the partial graph,
its symbols); the user needs the line of their model that stopped it. :func:`describe_failure`
finds it in the traceback (the innermost frame outside torch and autoshard), names the op the
partial graph ended on and what to do, and writes the whole report to a log file whose path
the message gives. :func:`torch_logs_held` keeps torch's log records of the capture out of the
output until it is known whether the capture failed.
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import torch
import torch.nn as nn


@dataclass
class Held:
    """What torch printed during a capture, held back from the output: its log records, each
    with the handler that would have printed it, and what it wrote to ``sys.stderr``."""

    records: list[tuple[logging.Handler, logging.LogRecord]] = field(default_factory=list)
    stderr: io.StringIO = field(default_factory=io.StringIO)

    def text(self) -> str:
        lines = [handler.format(record) for handler, record in self.records]
        return "\n".join([*lines, self.stderr.getvalue()])


_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what a data-dependent guard means to the user, and what to do about it
_DATA_DEPENDENT = (
    "a tensor's value decides Python control flow (an `if` on a tensor, `.item()`, `bool()`), "
    "so the captured ops would depend on the data; compute both branches with torch.where or "
    "torch.cond, or move the branch out of the model"
)


#: the errors every rank raises alike: capturing and planning are the same on every rank
ONE_LINE_ERRORS = frozenset({"CaptureError", "PlanningError", "StrategyError"})


def log_path() -> Path:
    """Where this rank writes a failed capture's full report."""
    rank = os.environ.get("RANK", "0")
    return Path(tempfile.gettempdir()) / "autoshard" / f"capture-rank{rank}.log"


@contextmanager
def torch_logs_held(held: Held) -> Iterator[None]:
    """torch's log records made in the block, and what it prints to ``sys.stderr`` (the
    partial graph of a failed export), go to ``held`` instead of the output; the caller
    prints or files them."""
    handlers = {
        handler
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if type(handler) is logging.StreamHandler  # not torch's structured trace
    }
    filters = {}
    for handler in handlers:

        def hold(record: logging.LogRecord, handler: logging.Handler = handler) -> bool:
            if record.levelno >= handler.level:
                held.records.append((handler, record))
            return False

        filters[handler] = hold
        handler.addFilter(hold)
    try:
        with redirect_stderr(held.stderr):
            yield
    finally:
        for handler, hold in filters.items():
            handler.removeFilter(hold)


def replay(held: Held) -> None:
    """Print held records as torch would have (a capture that succeeded)."""
    for handler, record in held.records:
        handler.handle(record)
    sys.stderr.write(held.stderr.getvalue())


def user_frame(tb: TracebackType | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``tb`` in the user's code: not torch's, not autoshard's."""
    found = None
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith((_TORCH_DIR, _OWN_DIR)):
            continue
        found = frame
    return found


def failed_op(err: BaseException) -> str | None:
    """The op the partial graph of a failed export ended on (``aten.item``), if it has one
    (torch keeps that graph as its printed code)."""
    graph = getattr(err, "partial_fx_graph", None)
    ops = re.findall(r"torch\.ops\.(\w+\.\w+)(?:\.(\w+))?\(", str(graph or ""))
    if not ops:
        return None
    name, overload = ops[-1]
    return name if overload in ("", "default") else f"{name}.{overload}"


def describe_failure(
    model: nn.Module,
    err: BaseException,
    held: Held = (),  # type: ignore[assignment]
) -> str:
    """One line: the module, the user's source line, the op, what it means; the full report
    (traceback and torch's log) goes to :func:`log_path`."""
    names = {id(m): name for name, m in model.named_modules()}
    where = None
    tb = err.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if isinstance(module, nn.Module) and id(module) in names:
            where = names[id(module)] or type(model).__name__
        tb = tb.tb_next
    module = f"module '{where}'" if where is not None else f"model {type(model).__name__}"
    frame = user_frame(err.__traceback__)
    line = f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame else ""
    if frame and frame.line:
        line += f": `{frame.line.strip()}`"
    op = failed_op(err)
    line += f" (op {op})" if op else ""
    if "data-dependent" in str(err) or type(err).__name__.startswith("GuardOnDataDependent"):
        cause = _DATA_DEPENDENT
    else:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        cause = f"{type(err).__name__}: {first}"
    path = _write_log(err, held or Held())
    logged = f"; full log: {path}" if path else ""
    return f"cannot capture {module}{line}: {cause}{logged}"


def one_line_on_rank_zero() -> None:
    """Under a launcher of several ranks (``WORLD_SIZE`` > 1), an error of the model or the
    plan that reaches the top (:data:`ONE_LINE_ERRORS`: every rank captures and plans the
    same, so every rank has the same one) prints one line on rank 0 and nothing on the
    others; a capture's full log is in its file. ``AUTOSHARD_DEBUG=1`` keeps Python's
    tracebacks. Other exceptions go to the hook that was there before."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("AUTOSHARD_DEBUG"):
        return
    previous = sys.excepthook
    if getattr(previous, "autoshard", False):
        return

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        ours = kind.__module__.startswith("autoshard.") and kind.__name__ in ONE_LINE_ERRORS
        if not ours:
            previous(kind, err, tb)
        elif os.environ.get("RANK", "0") == "0":
            print(f"autoshard: error: {err}", file=sys.stderr)

    hook.autoshard = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _write_log(err: BaseException, held: Held) -> Path | None:
    """The whole report in the log file; None when it cannot be written."""
    path = log_path()
    text = "".join(traceback.format_exception(err))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{text}\n-- torch's log during the capture --\n{held.text()}\n")
    except OSError:
        return None
    return path


__all__ = [
    "ONE_LINE_ERRORS",
    "Held",
    "describe_failure",
    "failed_op",
    "log_path",
    "one_line_on_rank_zero",
    "replay",
    "torch_logs_held",
    "user_frame",
]
