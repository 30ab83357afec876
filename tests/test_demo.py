"""``autoshard demo``: plans, trains, checkpoints midway and matches one process."""

from __future__ import annotations

import math
import re

from autoshard.cli.demo import DemoConfig, batch_at, build_model, one_process


def test_demo_trains_resumes_from_its_checkpoint_and_matches_one_process(capfd) -> None:
    from autoshard.cli.main import main

    argv = ["demo", "--ranks", "2", "--steps", "8", "--every", "4", "--layers", "1"]
    argv += ["--hidden", "32", "--heads", "2", "--seq", "16", "--batch", "4"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    assert "plan for 2 ranks, searched (optimal)" in out
    assert "(* chosen by the search)" in out and "configured by the user" not in out
    assert re.search(r"saved \S+step4 and resumed a new model from it at step 4", out)
    lines = re.findall(r"step +(\d+)/8 +loss (\S+) +(\S+) tokens/s .* MFU (\S+)%", out)
    assert [int(s) for s, *_ in lines] == [4, 8]
    assert all(float(mfu) > 0 for *_, mfu in lines)
    worst = float(re.search(r", (\S+) over all 8", out)[1])
    assert worst < 1e-5  # float32 rounding, over a checkpoint and a resume


def test_demo_batches_are_the_texts_next_bytes() -> None:
    cfg = DemoConfig(seq=16, batch=4)
    from autoshard.cli.demo import _text

    data = _text()
    x, y = batch_at(data, cfg, 3)
    assert x.shape == y.shape == (4, 16)
    assert (x[:, 1:] == y[:, :-1]).all()  # the targets are the inputs shifted by one byte
    assert (batch_at(data, cfg, 3)[0] == x).all() and not (batch_at(data, cfg, 4)[0] == x).all()
    losses = one_process(DemoConfig(steps=3, layers=1, hidden=32, heads=2, seq=16, batch=4))
    assert len(losses) == 3 and abs(losses[0] - math.log(256)) < 0.5  # bytes, untrained
    assert build_model(cfg).lm_head.weight.shape == (256, 64)
