"""What overlapping a collective with compute can save on this host, without autoshard.

    python -m bench.copies_bound [small|sizes|knobs|kinds] [rounds]

Two gloo ranks (``torch.distributed``, 1 compute thread each) run a step three ways, taking
turns, the order turning around every round: ``one``, a product ``x @ w`` and a collective of
its result; ``seq``, ``x`` cut in ``k`` chunks, each chunk's product and collective one after
another; ``ovl``, the same chunks interleaved, chunk ``i``'s collective posted
(``async_op=True``) and waited after chunk ``i+1``'s product. ``ovl/one`` is what copies can
reach at best (the bench's ratio); ``ovl/seq`` what the overlap alone saves. Times are the
slowest rank's, the fastest round's (the paired ratio ``ovl/one``: the median over rounds);
``cpu`` is rank 0's process CPU time (its compute and gloo's threads), which
shows how much of a collective is CPU work on the cores the products need.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("one", "seq", "ovl", "mm", "comm")


def _collective(kind: str, y: torch.Tensor, group: object, async_op: bool) -> object:
    size = dist.get_world_size(group)
    if kind == "ar":
        return dist.all_reduce(y, group=group, async_op=async_op)
    if kind == "ag":
        out = y.new_empty(size * y.shape[0], *y.shape[1:])
        return dist.all_gather_into_tensor(out, y, group=group, async_op=async_op)
    out = y.new_empty(y.shape[0] // size, *y.shape[1:])
    return dist.reduce_scatter_tensor(out, y, group=group, async_op=async_op)


def _ways(cfg: dict, group: object) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cfg["rows"], cfg["hidden"], generator=g)
    w = torch.randn(cfg["hidden"], cfg["hidden"], generator=g) / cfg["hidden"] ** 0.5
    chunks, zeros, kind, reps = list(x.chunk(cfg["k"])), torch.zeros_like(x), cfg["kind"], 4

    def seq() -> None:
        for chunk in chunks:
            _collective(kind, chunk @ w, group, False)

    def ovl() -> None:
        pending = None
        for chunk in chunks:
            work = _collective(kind, chunk @ w, group, True)
            if pending is not None:
                pending.wait()  # chunk i's collective ran beside chunk i+1's product
            pending = work
        pending.wait()

    steps = {
        "one": lambda: _collective(kind, x @ w, group, False),
        "seq": seq,
        "ovl": ovl,
        "mm": lambda: x @ w,
        "comm": lambda: _collective(kind, zeros, group, False),
    }
    return {name: (lambda f=f: [f() for _ in range(reps)]) for name, f in steps.items()}, reps


def _timed(step: object) -> tuple[float, float]:
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    step()
    cpu = time.process_time() - cpu
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), cpu


def _group(threads: int | None, groups: dict) -> object:
    if threads not in groups:
        opts = dist.ProcessGroupGloo._Options()
        opts._threads = threads
        groups[threads] = dist.new_group(backend="gloo", pg_options=opts)
    return groups[threads]


def _rank(rank: int, port: int, configs: list, out: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    groups: dict = {None: None}
    for cfg in configs:
        torch.set_num_threads(cfg["threads"])
        ways, reps = _ways(cfg, _group(cfg["gloo_threads"], groups))
        for step in ways.values():
            step()  # warm-up
        wall: dict = {w: [] for w in WAYS}
        cpu: dict = {w: [] for w in WAYS}
        for r in range(cfg["rounds"]):
            for name in WAYS if r % 2 == 0 else WAYS[::-1]:
                t, c = _timed(ways[name])
                wall[name].append(t / reps * 1e3)
                cpu[name].append(c / reps * 1e3)
        if rank == 0:
            out.put((cfg, wall, cpu))
    dist.destroy_process_group()


def _line(cfg: dict, wall: dict, cpu: dict) -> str:
    ms = {w: min(v) for w, v in wall.items()}  # the fastest round: the host's others least
    paired = statistics.median(o / s for o, s in zip(wall["ovl"], wall["one"], strict=True))
    share = ms["comm"] / (ms["comm"] + ms["mm"])
    return (
        f"{cfg['kind']} rows={cfg['rows']} hidden={cfg['hidden']} k={cfg['k']} "
        f"threads={cfg['threads']} gloo_threads={cfg['gloo_threads']}: product {ms['mm']:.2f} "
        f"collective {ms['comm']:.2f} ms (share {share:.0%}) | one {ms['one']:.2f} seq "
        f"{ms['seq']:.2f} ovl {ms['ovl']:.2f} ms | ovl/one {paired:.3f} (paired median) "
        f"ovl/seq {ms['ovl'] / ms['seq']:.3f} | cpu ms: collective "
        f"{min(cpu['comm']):.2f} one {min(cpu['one']):.2f} ovl {min(cpu['ovl']):.2f}"
    )


def configs(which: str, rounds: int = 25) -> list[dict]:
    """The configurations of a set: sizes, compute and gloo threads, collective kinds."""
    base = {"kind": "ar", "rows": 512, "hidden": 256, "k": 2, "threads": 1}
    base |= {"gloo_threads": None, "rounds": rounds}
    if which == "knobs":
        return [base | {"threads": t, "gloo_threads": g} for t in (1, 2) for g in (None, 1, 2)]
    if which == "kinds":
        return [base | {"kind": c, "k": k} for c in ("ar", "ag", "rs") for k in (2, 4, 8)]
    sizes = [(64, 256), (128, 256), (256, 256), (512, 256), (1024, 128)]
    if which == "sizes":
        sizes += [(1024, 256), (2048, 256), (512, 512), (4096, 64)]
    return [base | {"rows": r, "hidden": h} for r, h in sizes]


def main(which: str, rounds: int) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    chosen = configs(which, rounds)
    ranks = [ctx.Process(target=_rank, args=(r, port, chosen, out)) for r in range(2)]
    for p in ranks:
        p.start()
    for _ in chosen:
        print(_line(*out.get()), flush=True)
    for p in ranks:
        p.join()


if __name__ == "__main__":
    main(
        sys.argv[1] if len(sys.argv) > 1 else "small", int(sys.argv[2]) if len(sys.argv) > 2 else 25
    )
