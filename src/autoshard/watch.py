"""The watchdog: every wait in a collective or point-to-point exchange is bounded, and when one
runs out the rank that waited names the ranks that never arrived (docs/failures.md).

``watch.start(timeout_s)`` (``parallelize(timeout_s=)``, ``init_mesh(timeout_s=)``,
``autoshard train --timeout``) starts a thread on each rank. :mod:`autoshard.comm` tells it when
this rank issues a collective on a group (each group's collectives are counted: every member
issues them in the same order) and when it waits for one; the runtime tells it the step and
what the rank is doing outside collectives (reading a batch, the optimizer step). Once a tick
the thread writes that position into the process group's store, under this rank's key.

Under NCCL a collective's ``wait()`` returns once the compute stream is ordered after it,
before the device has run it, so a hang on the device is never a wait of the host. There the
watchdog follows the device instead: after each collective this rank waits for, it records a
CUDA event on the current stream, and a collective whose event has not completed
``timeout_s`` after it was waited for is a wait that ran out, diagnosed as below.

When a wait passes ``timeout_s``, the waiting rank reads its group's positions from the store:
a member that has issued fewer collectives on the group than the one waited for never arrived,
and the message says where that member is instead and for how long. The rank prints it as one
line, marks the job stopped in the store and exits with :data:`EXIT_TIMEOUT`; every other
rank's thread sees the mark within a tick and exits too, so no rank waits for torch's own
timeout, which is set :data:`BACKSTOP_S` later and only bounds waits outside autoshard's
collectives (inside torch.distributed.checkpoint).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "BACKSTOP_S",
    "EXIT_TIMEOUT",
    "Watched",
    "doing",
    "issued",
    "p2p",
    "running",
    "start",
    "step",
    "stop",
    "waiting",
]

#: the exit status of a rank that the watchdog stopped
EXIT_TIMEOUT = 124
#: how much later than the watchdog torch's own process-group timeout fires
BACKSTOP_S = 15.0
_PREFIX = "autoshard/watch/"


class _State:
    """This rank's position: collectives issued per group, the wait it is in, the step."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], int] = {}
        self.wait: tuple[str, tuple[int, ...], int, float] | None = None
        self.doing = ("starting", time.monotonic())
        self.step = 0
        self.beat = 0
        self.p2p: str | None = None  # the point-to-point group running (strict mode)
        #: the collectives waited for whose device has not yet run them, oldest first:
        #: (kind, group, number, since, marker)
        self.on_device: deque[tuple[str, tuple[int, ...], int, float, Any]] = deque()

    def late_on_device(self) -> tuple[str, tuple[int, ...], int, float] | None:
        """The oldest collective the device still runs (markers complete in stream order,
        so those before the first not done are all done)."""
        while self.on_device and self.on_device[0][4].query():
            self.on_device.popleft()
        return self.on_device[0][:4] if self.on_device else None

    def position(self) -> dict[str, Any]:
        now = time.monotonic()
        wait = None
        # on the device: the oldest collective it has not run (a copy: the main thread appends)
        waited = self.wait or next(iter(list(self.on_device)), (None,) * 4)[:4]
        if waited[0] is not None:
            kind, group, seq, since = waited
            wait = [kind, list(group), seq, now - since]
        return {
            # a copy first: the main thread may add a group while this thread reads
            "counts": {",".join(map(str, g)): n for g, n in dict(self.counts).items()},
            "wait": wait,
            "doing": [self.doing[0], now - self.doing[1]],
            "step": self.step,
            "beat": self.beat,
            "p2p": self.p2p,
        }


_state = _State()
_thread: _Watchdog | None = None


def running() -> bool:
    return _thread is not None


def issued(kind: str, ranks: Sequence[int]) -> tuple[str, tuple[int, ...], int]:
    """Count a collective this rank issues on the group ``ranks``; returns what identifies it
    (kind, group, its number on the group) for :func:`waiting`."""
    group = tuple(sorted(ranks))
    seq = _state.counts.get(group, 0) + 1
    _state.counts[group] = seq
    return kind, group, seq


@contextmanager
def waiting(what: tuple[str, tuple[int, ...], int]) -> Iterator[None]:
    """This rank waits for the collective ``what`` (from :func:`issued`) inside the block."""
    kind, group, seq = what
    outer = _state.wait
    _state.wait = (kind, group, seq, time.monotonic())
    try:
        yield
    finally:
        _state.wait = outer
        if _thread is not None and _thread.marker is not None:
            _state.on_device.append((kind, group, seq, time.monotonic(), _thread.marker()))
        if outer is None:
            _state.doing = ("outside any collective", time.monotonic())


class Watched:
    """An async collective's work whose ``wait()`` the watchdog bounds."""

    __slots__ = ("what", "work")

    def __init__(self, work: Any, what: tuple[str, tuple[int, ...], int]) -> None:
        self.work, self.what = work, what

    def wait(self) -> Any:
        with waiting(self.what):
            return self.work.wait()


def step(number: int) -> None:
    """The training step this rank is in (the runtime's count of training forwards)."""
    _state.step = number


def p2p(group: str | None) -> None:
    """The point-to-point group this rank runs now, under strict mode (``autoshard.strict``),
    or None: a rank that waits on another whose every send and receive was issued is then
    seen waiting in a group that holds no match for it."""
    _state.p2p = group


def doing(what: str) -> None:
    """What this rank does outside collectives now ("reading its batch", ...)."""
    _state.doing = (what, time.monotonic())


def _cuda_marker() -> Any:
    """A CUDA event on the current stream: done once the device has run what came before."""
    event = torch.cuda.Event()
    event.record()
    return event


def start(timeout_s: float, tick_s: float | None = None, marker: Any = None) -> None:
    """Bound every wait of this rank's collectives by ``timeout_s`` (a later call sets a new
    bound); needs an initialised process group. Without one (a single process) it does
    nothing. ``marker``: made after each collective waited for, its ``query()`` says whether
    the device has run it (default: a CUDA event under NCCL, none under gloo, whose waits
    return only once the collective is done)."""
    global _thread
    if marker is None and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        marker = _cuda_marker
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if not timeout_s or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
    tick = tick_s or min(1.0, timeout_s / 10)
    if _thread is not None:
        _thread.timeout_s, _thread.tick_s = float(timeout_s), tick
        _thread.marker = marker or _thread.marker
        return
    _thread = _Watchdog(float(timeout_s), tick, marker)
    _thread.start()


def stop() -> None:
    """Stop the watchdog (the process group is about to go)."""
    global _thread
    if _thread is not None:
        _thread.stopped.set()
        _thread.join(timeout=5)
        _thread = None


class _Watchdog(threading.Thread):
    def __init__(self, timeout_s: float, tick_s: float, marker: Any) -> None:
        super().__init__(name="autoshard-watchdog", daemon=True)
        self.timeout_s, self.tick_s, self.marker = timeout_s, tick_s, marker
        self.rank = dist.get_rank()
        # a torchrun restart of the same job shares the store: its attempt has keys of its own
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(
            f"{_PREFIX}{attempt}/", dist.distributed_c10d._get_default_store()
        )
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.tick_s):
            try:
                self._publish()
            except Exception:  # the store is gone (its host rank died): nothing to publish
                pass
            wait = _state.wait
            if wait is not None and time.monotonic() - wait[3] > self.timeout_s:
                self._give_up(wait)
            late = _state.late_on_device() if self.marker is not None else None
            if late is not None and time.monotonic() - late[3] > self.timeout_s:
                self._give_up(late, "'s device")

    def _publish(self) -> None:
        _state.beat += 1
        self.store.set(f"rank/{self.rank}", json.dumps(_state.position()))
        if self.store.check(["stopped"]):
            told = self.store.get("stopped").decode()
            _exit(f"autoshard: rank {self.rank} stopped: {told}")

    def _give_up(self, wait: tuple[str, tuple[int, ...], int, float], who: str = "") -> None:
        try:
            message = self._diagnose(wait, who)
            self.store.set("stopped", message)
        except Exception as err:  # no store to ask: say what this rank knows
            kind, group, seq, _ = wait
            message = (
                f"rank {self.rank}{who} waited {self.timeout_s:g} s in {kind} #{seq} over "
                f"ranks {list(group)} (step {_state.step}); the job's store could not be asked "
                f"which rank is missing ({type(err).__name__}: the rank hosting it may have died)"
            )
        _exit(f"autoshard: error: {message}")

    def _positions(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        found = {}
        for r in ranks:
            key = f"rank/{r}"
            if self.store.check([key]):
                found[r] = json.loads(self.store.get(key))
        return found

    def _diagnose(self, wait: tuple[str, tuple[int, ...], int, float], who: str = "") -> str:
        """One line: the wait that ran out (``who``: "'s device" where the device waits),
        and where each member that never arrived is."""
        kind, group, seq, _ = wait
        others = [r for r in group if r != self.rank]
        first = self._positions(others)
        time.sleep(2 * self.tick_s)  # a second look tells a stuck process from a live one
        second = self._positions(others)
        key = ",".join(map(str, group))
        missing = []
        for r in others:
            now = second.get(r)
            if now is None or now["counts"].get(key, 0) < seq:
                frozen = now is not None and first.get(r, {}).get("beat") == now["beat"]
                missing.append((r, _where(now, frozen)))
        running = f", its point-to-point group {_state.p2p} running" if _state.p2p else ""
        what = (
            f"rank {self.rank}{who} waited {self.timeout_s:g} s in {kind} #{seq} over ranks "
            f"{list(group)} (step {_state.step}{running})"
        )
        if missing:
            names = ", ".join(str(r) for r, _ in missing)
            ranks = "rank" if len(missing) == 1 else "ranks"
            where = "; ".join(f"rank {r} {w}" for r, w in missing)
            return f"{what}: {ranks} {names} never arrived ({where})"
        return (
            f"{what}: every member issued it, so they disagree on what it is or the network "
            f"lost it ({'; '.join(f'rank {r} {_where(second.get(r), False)}' for r in others)})"
        )


def _where(position: dict[str, Any] | None, frozen: bool) -> str:
    if position is None:
        return "never checked in"
    if frozen:
        return f"stopped responding at step {position['step']}, {_activity(position)}"
    return f"is at step {position['step']}, {_activity(position)}"


def _activity(position: dict[str, Any]) -> str:
    running = position.get("p2p")
    p2p = f", its point-to-point group {running} running" if running else ""
    if position["wait"] is not None:
        kind, group, seq, seconds = position["wait"]
        return f"waiting in {kind} #{seq} over ranks {group} for {seconds:.0f} s{p2p}"
    what, seconds = position["doing"]
    return f"{what} for {seconds:.0f} s{p2p}"


def _exit(line: str) -> None:
    """Leave now: the main thread may be blocked in native code that never returns. The line
    goes out in one write: the other ranks' watchdogs write theirs to the same stream at once."""
    sys.stdout.flush()
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    os._exit(EXIT_TIMEOUT)
