"""The watchdog (autoshard.watch, docs/failures.md): a wait past the timeout names the rank
that never arrived and what it is doing, and every rank stops, the laggard too, with no
launcher to kill it."""

from __future__ import annotations

import re
import time

import pytest
import torch

from autoshard.testing import RankFailure, run_ranks


def _laggard(timeout_s: float) -> None:
    """Both ranks sum once; then rank 1 goes to sleep in its own code while rank 0 waits for
    the second sum (an async one, waited later)."""
    from autoshard import comm, watch

    watch.start(timeout_s, tick_s=0.25)
    watch.step(3)
    comm.all_reduce(torch.ones(4), [0, 1])
    if torch.distributed.get_rank() == 1:
        watch.doing("in its own code")
        time.sleep(120)
    comm.all_reduce_async_(torch.ones(4), [0, 1]).wait()


def test_a_rank_that_never_arrives_is_named_and_every_rank_stops(capfd) -> None:
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_laggard, 2, 3.0, timeout=100)
    assert time.monotonic() - began < 60  # not the 120 s rank 1 sleeps, nor run_ranks' 100
    assert str(failure.value).count("exited with code 124") == 2, failure.value
    err = capfd.readouterr().err
    said = re.search(r"autoshard: error: (.*)", err)
    assert said, err
    assert re.fullmatch(
        r"rank 0 waited 3 s in all_reduce #2 over ranks \[0, 1\] \(step 3\): rank 1 never "
        r"arrived \(rank 1 is at step 3, in its own code for \d+ s\)",
        said.group(1),
    ), said.group(1)
    assert f"autoshard: rank 1 stopped: {said.group(1)}" in err  # the laggard ends by itself
