"""The global mean loss of a data-parallel plan: its value equals one device's, and the forward
waits for no collective (the targets' count travels from the start of the forward, the loss's
sum is waited for only when its value is read)."""

from __future__ import annotations

import copy
import warnings

import torch

from autoshard import parallelize, shard_inputs
from autoshard.models import build, reference_config
from autoshard.ops.pending import PendingLoss
from autoshard.testing import run_ranks


def _data_parallel_gpt(ignored: int):
    """A float64 GPT on 2 data-parallel ranks, its single-device copy and the global batch,
    whose first row has its first ``ignored`` targets set to the ignore index."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = reference_config("gpt", vocab=64, seq=8, layers=1, heads=2, hidden=16)
    model = build(config).double()
    reference = copy.deepcopy(model)
    batch = config.example_batch(4, torch.Generator().manual_seed(1))
    batch[1][0, :ignored] = -100
    pm = parallelize(model, batch, {"dp": 2})
    return pm, shard_inputs(batch, pm), reference, batch


def _waits_of_a_step() -> dict:
    import torch.distributed as dist

    from autoshard import comm

    # some of the first rank's targets ignored: the ranks' counts of targets differ
    pm, local, reference, batch = _data_parallel_gpt(ignored=5)

    log: list[str] = []
    start, blocking = comm.all_reduce_async_, dist.all_reduce

    class Work:
        def __init__(self, work: object, name: str) -> None:
            self.work, self.name = work, name

        def wait(self) -> None:
            log.append(f"wait {self.name}")
            self.work.wait()

    def started(x: torch.Tensor, ranks: list[int]) -> Work:
        name = "count" if x.dtype == torch.int64 else f"sum of {x.numel()}"
        log.append(f"start {name}")
        return Work(start(x, ranks), name)

    def waited(*args, **kwargs):  # a collective waited for where it is called
        if not kwargs.get("async_op"):
            log.append("blocking all_reduce")
        return blocking(*args, **kwargs)

    comm.all_reduce_async_, dist.all_reduce = started, waited
    try:
        loss = pm(*local)
        after_forward = list(log)
        loss.backward()
        after_backward = list(log)
        summed = {
            fqn: t.grad.clone() for fqn, t in pm.local_tensors().items() if t.grad is not None
        }
        value = loss.item()
        after_read = list(log)
        # arithmetic on the loss reads it; autograd.grad's first gradient does not
        again = pm(*local)
        grads = torch.autograd.grad(again * 2, [next(pm.parameters())])
    finally:
        comm.all_reduce_async_, dist.all_reduce = start, blocking
    expected = reference(*batch)
    expected.backward()
    # the ranks hold different numbers of targets: each gradient is still one device's
    for fqn, grad in summed.items():
        torch.testing.assert_close(grad, reference.get_parameter(fqn).grad, msg=fqn)
    return {
        "pending": isinstance(loss, PendingLoss),
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_read": after_read,
        "value": (value, expected.item()),
        "grad_finite": bool(torch.isfinite(grads[0]).all()),
        "grads_compared": len(summed),
    }


def test_the_forward_waits_for_no_collective_and_the_loss_is_one_devices() -> None:
    for out in run_ranks(_waits_of_a_step, 2, timeout=120):
        assert out["pending"]
        # the forward starts the count and the sum, and waits for neither
        assert out["after_forward"] == ["start count", "start sum of 1"], out
        # backward needs the count only; the gradient buckets follow
        backward = out["after_backward"][2:]
        assert backward[0] == "wait count" and "wait sum of 1" not in backward, out
        # reading the value waits for its sum, once
        assert out["after_read"][len(out["after_backward"]) :] == ["wait sum of 1"], out
        got, want = out["value"]
        assert abs(got - want) <= 1e-12 * abs(want), out["value"]
        assert out["grad_finite"]
        assert out["grads_compared"] > 5  # every parameter's gradient equals one device's


def _losses_read_later() -> tuple[list[float], list[float]]:
    pm, local, reference, batch = _data_parallel_gpt(ignored=0)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    kept, expected = [], []
    for _ in range(4):
        loss = pm(*local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        kept.append(loss)  # read only after later steps have started and waited newer sums
        ref_loss = reference(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(ref_loss.item())
    return [loss.item() for loss in kept], expected


def test_losses_kept_and_read_after_later_steps_are_one_devices() -> None:
    for got, expected in run_ranks(_losses_read_later, 2, timeout=120):
        assert len(got) == 4
        for g, e in zip(got, expected, strict=True):
            assert abs(g - e) <= 1e-12 * abs(e), (got, expected)
