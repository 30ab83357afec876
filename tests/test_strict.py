"""Strict point-to-point mode (autoshard.strict, docs/failures.md): over gloo, point-to-point
groups keep NCCL's order (one after the other as posted, a send waiting for its receiver), so
an order that passes on gloo but hangs on GPUs hangs here too, and the watchdog names it."""

from __future__ import annotations

import re
from contextlib import nullcontext

import pytest
import torch

from autoshard.testing import RankFailure, run_ranks


def _matching_groups() -> list[list[float]]:
    """Groups of different shapes on the two sides that NCCL completes: rank 0 sends and
    receives in one group, rank 1 receives in one and sends in the next; then a send_recv,
    then a group with two tensors each way."""
    import torch.distributed as dist

    from autoshard import comm, watch

    rank = dist.get_rank()
    peer = 1 - rank
    watch.start(30.0, tick_s=0.25)
    got = []
    with comm.strict_p2p():
        x, out = torch.full((3,), rank + 1.0), torch.empty(3)
        if rank == 0:
            comm.post_p2p([(x, peer)], [(out, peer)]).wait()
        else:
            first = comm.post_p2p([], [(out, peer)])
            comm.post_p2p([(x * 10, peer)], []).wait()  # waits for the first group too
            assert first._works[0].done.is_set()
        got.append(out.tolist())
        got.append(comm.send_recv(x, [peer], peer, x).tolist())
        ins = [torch.empty(2), torch.empty(4)]
        comm.post_p2p([(x[:2] * 3, peer), (x.repeat(2)[:4] * 5, peer)], [(t, peer) for t in ins])
    got += [t.tolist() for t in ins]  # the block's end waited for the last group
    return got


def test_groups_that_nccl_completes_complete_with_their_values() -> None:
    got = run_ranks(_matching_groups, 2, timeout=120)
    assert got[0] == [[20.0] * 3, [2.0] * 3, [6.0] * 2, [10.0] * 4]
    assert got[1] == [[1.0] * 3, [1.0] * 3, [3.0] * 2, [5.0] * 4]


def _crossed(strict: bool) -> list[float]:
    """Both ranks post a receive, then the send the other waits for, then wait for the
    receive: gloo completes it (a send leaves when posted); NCCL runs each rank's receive
    first and never gets to the sends."""
    import torch.distributed as dist

    from autoshard import comm, watch

    peer = 1 - dist.get_rank()
    watch.start(3.0, tick_s=0.25)
    out = torch.empty(2)
    with comm.strict_p2p() if strict else nullcontext():
        received = comm.post_p2p([], [(out, peer)])
        sent = comm.post_p2p([(torch.full((2,), float(dist.get_rank())), peer)], [])
        received.wait()
        sent.wait()
    return out.tolist()


def test_an_order_gloo_lets_pass_hangs_in_strict_mode_and_the_watchdog_names_it(capfd) -> None:
    assert run_ranks(_crossed, 2, False, timeout=60) == [[1.0, 1.0], [0.0, 0.0]]
    with pytest.raises(RankFailure) as failure:
        run_ranks(_crossed, 2, True, timeout=60)
    # the first rank the watchdog stops closes its connections: the other ends by its own
    # watchdog or by the error of its receive, whichever comes first
    assert "exited with code 124" in str(failure.value), failure.value
    said = re.search(r"autoshard: error: (.*)", capfd.readouterr().err)
    assert said, failure.value
    assert re.fullmatch(
        r"rank (\d) waited 3 s in send_recv #1 over ranks \[0, 1\] \(step 0, its point-to-point "
        r"group \[receive from (\d)\] running\): every member issued it, so they disagree on "
        r"what it is or the network lost it \(rank \2 is at step 0, waiting in send_recv #1 "
        r"over ranks \[0, 1\] for \d+ s, its point-to-point group \[receive from \1\] running\)",
        said.group(1),
    ), said.group(1)
