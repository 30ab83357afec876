"""The one launcher for multi-rank tests: CPU processes joined by a gloo process group.

Distributed tests fail in unhelpful ways: one rank dies and the others sit in a collective until
gloo's timeout, stray processes outlive pytest, and the only error left is some other rank's
"connection closed". Keeping the spawning, rendezvous, result collection and cleanup in one place
gives every test fail-fast behaviour and a report of what each rank actually did.

Ranks are forked from a fork server that imported torch and autoshard once, the first time this
process ran ranks (multiprocessing's "forkserver"; "spawn" where there is none): a rank starts in
milliseconds instead of seconds of imports. Each rank is given the caller's environment, working
directory, ``sys.path``, standard output and standard error as they are at the call, as a spawned
process would be; what a library reads from the environment only when it is imported was read
when the server started.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import sys
import textwrap
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing import get_context, reduction
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveBytes", "RankFailure", "peak_resident_bytes", "preload", "run_ranks"]

_HOST = "127.0.0.1"
# After the first failure, the other ranks usually fail within milliseconds (their peers vanish);
# waiting briefly lets the report show the root cause and its consequences together.
_SETTLE_S = 0.5
# SIGTERM is enough for ranks blocked in gloo; SIGKILL is the backstop for anything stubborn.
_TERMINATE_GRACE_S = 2.0


class RankFailure(AssertionError):
    """Raised in the parent when a rank raised, died, disagreed with the others or timed out.

    An AssertionError so that pytest reports a failing distributed test as a plain test failure.
    """


def _watch_parent(parent_pid: int) -> None:
    # A parent killed outright (e.g. by a CI timeout) never runs its cleanup; without this a rank
    # blocked in a collective would linger for the whole gloo timeout. The rank's own parent is
    # the fork server, which leaves when the caller does: either way the parent changes.
    forked_by = os.getppid()
    while os.getppid() == forked_by and _alive(parent_pid):
        time.sleep(0.5)
    os._exit(70)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


#: what the fork server imports once, so that no rank imports it again: seconds each for
#: ``torch.export`` (dynamo), AOTAutograd and distributed checkpoints, which ranks that capture,
#: lower and save a model need
_PRELOAD = [
    "__main__",
    "torch",
    "torch.distributed",
    "torch.export",
    "torch._functorch.aot_autograd",
    "torch.distributed.checkpoint",
    "highspy",
    "autoshard",
    "autoshard.runtime",
    "autoshard.testing",
]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (a model library's code every rank would
    otherwise import again: transformers' Llama takes seconds). Only before this process first
    runs ranks, when the server starts; a module that does not import is passed over."""
    if _server_started():
        raise RuntimeError("preload must come before the first run_ranks in this process")
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _server_started() -> bool:
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None) is not None


class _Fd:
    """A file descriptor of the caller, duplicated into the rank when it starts."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        # DupFd registers the descriptor with the process being started (only while it is)
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return dup.detach()


def _context() -> Any:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read once, when the server starts
    return ctx


def _as_the_caller(environ: dict[str, str], cwd: str, path: list[str], out: int, err: int) -> None:
    """The caller's environment, directory, path and output, at the call (a fork server's are
    those it started with)."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    for fd, theirs in ((1, out), (2, err)):
        if theirs != fd:  # spawn hands descriptors over at their own numbers
            os.dup2(theirs, fd)
            os.close(theirs)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    parent_pid: int,
    caller: tuple[dict[str, str], str, list[str], int, int],
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    _as_the_caller(*caller)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
    )
    try:
        # Ranks share very few cores; intra-op threads per rank would only oversubscribe them.
        torch.set_num_threads(1)
        # The parent's clock started before the spawn, so it fires first; gloo's is a backstop.
        pg_timeout = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=pg_timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout
        )
        outcome: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException:
        outcome = ("err", traceback.format_exc())
    try:
        # Plain pickle, not Connection.send: torch registers a shared-memory reducer for tensors
        # with multiprocessing's pickler, and that needs this process alive when the parent reads.
        try:
            payload = pickle.dumps(outcome)
        except Exception:
            payload = pickle.dumps(
                ("err", "return value not picklable:\n" + traceback.format_exc())
            )
        conn.send_bytes(payload)
    finally:
        conn.close()
        # Leave without tearing the process group down: gloo's teardown races with peers that
        # already left (a transport thread calls std::terminate, the rank dies by SIGABRT after
        # its result was sent). The outcome is delivered; nothing else needs this process.
        # multiprocessing's own finalizers still run: they unlink the semaphores this process
        # made (tqdm's lock, taken by torch.fx), which the parent's tracker would report.
        multiprocessing.util._run_finalizers()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _check_spawnable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # Spawned children re-import fn by module and name; failing here is clearer than a pickling
    # error from deep inside Process.start().
    qualname = getattr(fn, "__qualname__", "")
    if not callable(fn) or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"run_ranks needs a picklable module-level function, got {fn!r}")
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_ranks needs a picklable module-level function and picklable arguments: {exc}"
        ) from exc


def _describe(rank: int, proc: BaseProcess, result: tuple[str, Any] | None) -> str:
    code = proc.exitcode
    if code is None:
        ending = "still running"
    elif code < 0:
        try:
            ending = f"killed by {signal.Signals(-code).name}"
        except ValueError:  # real-time signals have no name
            ending = f"killed by signal {-code}"
    else:
        ending = f"exited with code {code}"
    if result is None:
        # Died before reporting (or never got to fn): its own stderr holds any explanation.
        return f"rank {rank}: no result; {ending}"
    if result[0] == "ok":
        shown = repr(result[1])
        head = f"rank {rank}: returned {shown if len(shown) <= 200 else shown[:197] + '...'}"
    else:
        head = f"rank {rank}: raised"
    if code:
        head += f", then {ending}"
    if result[0] == "ok":
        return head
    return head + "\n" + textwrap.indent(str(result[1]).rstrip(), "    ")


def _collect(
    procs: list[BaseProcess], conns: list[Connection], deadline: float, timeout: float
) -> list[Any]:
    """Wait on pipes and process sentinels together, so a death is noticed the moment it happens."""
    n = len(procs)
    results: dict[int, tuple[str, Any]] = {}
    exited: set[int] = set()
    failed_at: float | None = None

    def receive(rank: int) -> None:
        try:
            results[rank] = pickle.loads(conns[rank].recv_bytes())
        except EOFError:
            pass  # died before reporting; its exit code tells the story
        except Exception:
            results[rank] = ("err", "result could not be unpickled:\n" + traceback.format_exc())

    while True:
        now = time.monotonic()
        bad = [
            r
            for r in range(n)
            if results.get(r, ("ok",))[0] == "err"
            or (r in exited and (procs[r].exitcode != 0 or r not in results))
        ]
        if bad and failed_at is None:
            failed_at = now
        settled = all(r in exited or r in results for r in range(n))
        if failed_at is not None and (settled or now >= failed_at + _SETTLE_S):
            lines = [_describe(r, procs[r], results.get(r)) for r in range(n)]
            raise RankFailure(f"rank(s) {bad} failed; all ranks stopped\n" + "\n".join(lines))
        if not bad and len(exited) == n:
            return [results[r][1] for r in range(n)]
        if now >= deadline:
            late = [r for r in range(n) if r not in exited]
            lines = [_describe(r, procs[r], results.get(r)) for r in range(n)]
            raise RankFailure(
                f"timed out after {timeout:g} s; rank(s) {late} had not finished\n"
                + "\n".join(lines)
            )
        until = deadline if failed_at is None else min(deadline, failed_at + _SETTLE_S)
        sentinels = {procs[r].sentinel: r for r in range(n) if r not in exited}
        pipes = {conns[r]: r for r in range(n) if r not in results and r not in exited}
        for ready in wait([*sentinels, *pipes], max(0.0, until - now)):
            if isinstance(ready, int):
                rank = sentinels[ready]
                procs[rank].join()
                exited.add(rank)
                # Whatever it sent before exiting is still buffered in the pipe.
                if rank not in results and conns[rank].poll(0):
                    receive(rank)
            elif pipes[ready] not in results:
                receive(pipes[ready])


def _reap(procs: list[BaseProcess]) -> None:
    started = [p for p in procs if p.pid is not None]
    for p in started:
        if p.is_alive():
            p.terminate()
    grace_end = time.monotonic() + _TERMINATE_GRACE_S
    for p in started:
        p.join(max(0.0, grace_end - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
            p.join()
        p.close()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, **kwargs: Any
) -> list[Any]:
    """Run fn(*args, **kwargs) on world_size new processes (ranks) with torch.distributed
    (gloo) initialised; return the per-rank return values, in rank order.

    Any rank raising, dying or returning while another raises fails the whole run with a
    RankFailure listing every rank's outcome, as soon as it happens rather than after the gloo
    timeout. timeout bounds the whole run, spawn included; no child outlives this call.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    _check_spawnable(fn, args, kwargs)
    deadline = time.monotonic() + timeout
    ctx = _context()
    # Binding port 0 in the parent and handing the real port to the children avoids the race
    # of picking a "free" port that someone else grabs before rank 0 binds it.
    store = dist.TCPStore(_HOST, 0, is_master=True, wait_for_workers=False)
    procs: list[BaseProcess] = []
    conns: list[Connection] = []
    caller = (dict(os.environ), os.getcwd(), list(sys.path), _Fd(1), _Fd(2))
    common = (world_size, store.port, timeout, os.getpid(), caller)
    try:
        for rank in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            conns.append(recv_end)
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, *common, send_end, fn, args, kwargs),
                name=f"autoshard-rank-{rank}",
            )
            procs.append(proc)
            try:
                proc.start()
            finally:
                # Only the child may hold the write end, or a dead child would never read as EOF.
                send_end.close()
        return _collect(procs, conns, deadline, timeout)
    finally:
        _reap(procs)
        for conn in conns:
            conn.close()
        del store  # the rendezvous must outlive every rank, so it goes last


def peak_resident_bytes() -> int:
    """This process's highest resident size in bytes, its own alone.

    ``getrusage(RUSAGE_SELF).ru_maxrss`` is not: a process started by fork and exec (every
    multiprocessing "spawn" rank, every torchrun worker) begins with its parent's peak there, as
    Linux carries the old image's high-water mark across exec. ``VmHWM`` in ``/proc/self/status``
    is the new image's own; systems without /proc fall back to ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage on CPU, counted the same way whatever library made them:
    ``with LiveBytes() as m: ...``, then ``m.live`` bytes now and ``m.peak`` the most seen.

    CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so this counts
    storages: the mode sees every tensor an operator returns (forward, backward, hooks,
    optimizers, collectives' outputs) and adds its storage's bytes the first time; a weak
    reference subtracts them when the storage is freed, and ``resize_`` is followed. Storages
    made before the mode count nothing once told with ``ignore`` (views of them are not new
    memory), so build what is measured inside it. DTensor operators are left to DTensor, whose
    local operators the mode then sees."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._bytes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes counted]
        self._resize: Any = None

    def ignore(self, *tensors: torch.Tensor) -> None:
        """Storages made before the mode (views of them are not new memory)."""
        for t in tensors:
            self._bytes.setdefault(t.untyped_storage(), [0])

    def reset_peak(self) -> None:
        self.peak = self.live

    def _see(self, storage: torch.UntypedStorage) -> None:
        if storage in self._bytes:
            return
        cell = [storage.nbytes()]
        self._bytes[storage] = cell
        weakref.finalize(storage, self._free, cell)
        self._add(cell[0])

    def _free(self, cell: list[int]) -> None:
        self.live -= cell[0]

    def _add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def __enter__(self) -> LiveBytes:
        original = self._resize = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            cell = self._bytes.get(storage)
            if cell is not None:
                self._add(storage.nbytes() - cell[0])
                cell[0] = storage.nbytes()
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if DTensor in types:
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and t.device.type == "cpu":
                self._see(t.untyped_storage())
        return out
