"""Data for each rank (autoshard.data): on 4 ranks as dp 2 x tp 2, over 3 epochs, the
data-parallel shards together are the dataset, tensor-parallel partners see the same batches,
the order follows the seed, a saved position resumes at the next batch, and the batches train
as the global batch does on one device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import autoshard
from autoshard.data import ShardSampler
from autoshard.models import MLP, MLPConfig
from autoshard.testing import run_ranks

NUM_SAMPLES, BATCH, EPOCHS = 37, 8, 3


def _dataset() -> TensorDataset:
    """Sample i's features hold i in their first column, so a batch names its samples."""
    x = torch.randn(NUM_SAMPLES, 16, generator=torch.Generator().manual_seed(0))
    x[:, 0] = torch.arange(NUM_SAMPLES, dtype=torch.float32)
    y = torch.arange(NUM_SAMPLES) % 8
    return TensorDataset(x, y)


def _ids(batch: tuple[torch.Tensor, ...]) -> list[int]:
    return [int(v) for v in batch[0][:, 0].tolist()]


def _rank(end: str) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = MLP(MLPConfig())
    example = (torch.randn(BATCH, 16), torch.zeros(BATCH, dtype=torch.long))
    pm = autoshard.parallelize(
        model, example, {"dp": 2, "tp": 2}, {"layers.*.fc1": ((None, None), ("tp", None))}
    )
    loader = autoshard.data.loader(_dataset(), pm, BATCH, seed=7, end=end)
    epochs = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        epochs.append([_ids(b) for b in loader])
    # resume: 2 batches into epoch 1, save; a fresh loader continues with the third
    loader.set_epoch(1)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    again = autoshard.data.loader(_dataset(), pm, BATCH, seed=7, end=end)
    again.load_state_dict(state)
    resumed = [_ids(b) for b in again]
    # the loader's batches train as the global batch does on one device
    loader.set_epoch(0)
    local = next(iter(loader))
    loss = pm(*local)
    loss.backward()
    torch.optim.SGD(pm.parameters(), lr=0.1).step()
    stepped = pm.full_state_dict()  # a collective
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _ids(local))
    return {
        "epochs": epochs, "resumed": resumed, "loss": float(loss), "first": everyone,
        "stepped": stepped,
    }  # fmt: skip


@pytest.mark.parametrize("end", ["drop", "pad"])
def test_shards_cover_the_dataset_partners_agree_and_resume(end: str) -> None:
    results = run_ranks(_rank, 4, end, timeout=180)
    # ranks 0,1 (tp partners) hold dp shard 0; ranks 2,3 dp shard 1
    assert results[0]["epochs"] == results[1]["epochs"]
    assert results[2]["epochs"] == results[3]["epochs"]
    full_batches = NUM_SAMPLES // BATCH if end == "drop" else -(-NUM_SAMPLES // BATCH)
    orders = []
    for epoch in range(EPOCHS):
        shard0, shard1 = results[0]["epochs"][epoch], results[2]["epochs"][epoch]
        assert len(shard0) == len(shard1) == full_batches
        seen = [i for a, b in zip(shard0, shard1, strict=True) for i in a + b]
        assert all(len(a) == BATCH // 2 for a in shard0 + shard1)
        if end == "drop":  # every sample at most once, all but the incomplete last batch
            assert len(set(seen)) == len(seen) == full_batches * BATCH
        else:  # every sample at least once
            assert set(seen) == set(range(NUM_SAMPLES))
        orders.append(seen)
        # the order is the seed's: the same permutation a sampler of that seed draws
        sampler = ShardSampler(NUM_SAMPLES, BATCH, 2, 0, seed=7, end=end)
        sampler.epoch = epoch
        assert shard0 == sampler.batches()
    assert orders[0] != orders[1]  # each epoch its own order
    for r in range(4):
        assert results[r]["resumed"] == results[r]["epochs"][1][2:]
    # one step on the global batch the four ranks' parts make
    first = results[0]["first"]
    assert first[0] == first[1] and first[2] == first[3]
    x, y = _dataset().tensors
    ids = first[0] + first[2]
    torch.manual_seed(0)
    model = MLP(MLPConfig())
    ref = model(x[ids], y[ids])
    ref.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for r in range(4):
        assert results[r]["loss"] == pytest.approx(float(ref), rel=1e-5)
        for name, want in model.state_dict().items():  # and the step's every parameter
            torch.testing.assert_close(results[r]["stepped"][name], want, msg=name)


def test_bad_loader_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="end='wrap'"):
        ShardSampler(10, 4, 2, 0, end="wrap")
    with pytest.raises(ValueError, match="global batch 5 does not divide into 2"):
        ShardSampler(10, 5, 2, 0)
    with pytest.raises(ValueError, match="seeded 1, not 0"):
        from autoshard.data import ShardLoader
        from autoshard.layout import Layout

        layout = Layout.replicated((4, 16), 1)
        loader = ShardLoader(_dataset(), 4, [layout, Layout.replicated((4,), 1)], 0, seed=0)
        loader.load_state_dict({"epoch": 0, "position": 1, "seed": 1})


def test_inputs_split_differently_read_whole_batches_and_cut_each_by_its_layout() -> None:
    """A plan may split the ids by the batch and the targets by the sequence: each rank reads
    the whole global batch and keeps its part of each input."""
    from autoshard.data import ShardLoader
    from autoshard.layout import Layout

    mesh = {"dp": 2}
    data = TensorDataset(torch.arange(64).reshape(16, 4), 100 + torch.arange(64).reshape(16, 4))
    rows = Layout.from_named((8, 4), ("dp", None), mesh, dtype=torch.int64)
    cols = Layout.from_named((8, 4), (None, "dp"), mesh, dtype=torch.int64)
    whole = Layout.from_named((8, 4), (None, None), mesh, dtype=torch.int64)
    for rank in range(2):
        mine = ShardLoader(data, 8, [rows, cols], rank, seed=3)
        full = ShardLoader(data, 8, [whole, whole], rank, seed=3)
        assert mine.whole and len(mine) == len(full) == 2
        for (x, y), (fx, fy) in zip(mine, full, strict=True):
            assert torch.equal(x, fx[4 * rank : 4 * rank + 4])
            assert torch.equal(y, fy[:, 2 * rank : 2 * rank + 2])
