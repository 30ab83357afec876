"""Optimizer offload (docs/parallelism/offload.md) against plain PyTorch (DESIGN.md invariant 1):
GPT with tied embeddings and an unused parameter, and transformers' Llama built from a config,
float64, 5 AdamW steps on dp 2, every loss and every parameter equal to the eager model's under
``torch.optim.AdamW``; a fraction of 1.0 and 0.5 at ZeRO 0-3, with clipping; checkpoints saved under
offload loaded without it and the reverse; the bytes each tier holds; bad ``offload=`` values named.
Parameter offload (ZeRO 3's shards on the host) likewise, and an embedding table on the host against
plain PyTorch's ``sparse=True`` table under SparseAdam, with the bytes of rows each step moves.
Activation offload of Llama's decoder layers on pp 2 and dp 2 (the bytes moved against the test's
own count of what they saved); NVMe-held optimizer state (the files, the checkpoints, a rank's peak
resident memory against its host budget). Optimizer, NVMe, parameter (on the host and in files) and
embedding offload inside pipeline stages (pp 2, pp 2 x dp 2) likewise, and a table tied to another
stage's weight named."""

from __future__ import annotations

import copy
import ctypes
import fnmatch
import gc
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_runtime import STEPS, WithUnused, batches, build

import autoshard
from autoshard import Options, clip_grad_norm_, parallelize, shard_inputs, single_device
from autoshard.graph.capture import capture_modes
from autoshard.runtime.offload import OffloadedBlock
from autoshard.testing import run_ranks

LR = 1e-2
CLIP = 0.05
#: two pipeline stages under 1F1B, two micro-batches a step
PIPELINE = {"schedule": "1f1b", "microbatches": 2}
#: transformers computes the loss of float64 logits in float32, over fewer rows a micro-batch
#: (and a data-parallel rank) than plain PyTorch's one batch: its rounding, not the step's
HF = {"rtol": 1e-6, "atol": 1e-6}
#: the host memory the NVMe runs stream through, in MiB
NVME_BUDGET_MB = 0.01


def _setup(unused: bool = True) -> tuple[torch.nn.Module, list, dict]:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    inner, config = build("gpt", 0.0)
    model = (WithUnused(inner) if unused else inner).to(torch.float64)
    data = batches(config, torch.float64)
    return model, data, capture_modes(model, data[0])


def _plain(model: torch.nn.Module, data: list, clip: float | None, micro: int = 1) -> dict:
    """The eager model under ``torch.optim.AdamW`` (and ``clip_grad_norm_``): the reference;
    ``micro`` micro-batches a step, their gradients added up."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        for i in range(micro):
            loss = ref(*data[(step + i) % len(data)]) / micro
            loss.backward()
            losses.append(float(loss))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step(), opt.zero_grad()
    return {"losses": losses, "norms": norms, "state": ref.state_dict()}


def _made(
    model: torch.nn.Module,
    data: list,
    captured: dict,
    level: int,
    fraction: float,
    where: bool | str | dict = False,
    mesh: dict | None = None,
) -> Any:
    """``fraction`` of the optimizer on the host; ``where`` True puts ZeRO 3's shards there
    too, a path keeps the optimizer's host part in files under it (NVMe, streamed in windows
    of 163 float64 elements: many a tensor), a mapping adds its keys (ZeRO 3's shards in
    files: ``{"parameters": True, "nvme": path}``). On dp 2, or on ``mesh``, whose ``pp`` axis makes
    ``PIPELINE``'s stages (capturing one micro-batch, not ``captured``'s whole batch)."""
    offload = {"optimizer": fraction} if fraction or where is True else None
    if where is True:
        offload["parameters"] = True
    elif isinstance(where, dict):
        offload = {"optimizer": fraction, "host_budget_mb": NVME_BUDGET_MB} | where
    elif where:
        offload |= {"nvme": where, "host_budget_mb": NVME_BUDGET_MB}
    staged = PIPELINE if mesh and "pp" in mesh else {"captured": captured}
    return parallelize(model, data[0], mesh or {"dp": 2}, zero=level, offload=offload, **staged)


def _train(
    pm: Any, opt: Any, data: list, steps: range, clip: float | None, micro: int = 1, sync=False
) -> dict[str, list]:
    """``micro`` micro-batches a step, all but the last under ``no_sync`` unless ``sync``
    (then each backward sums, and the offload adds what comes after the first)."""
    losses, norms = [], []
    for step in steps:
        for i in range(micro):
            loss = pm(*shard_inputs(data[(step + i) % len(data)], pm)) / micro
            if i == micro - 1 or sync:
                loss.backward()
            else:
                with pm.no_sync():
                    loss.backward()
            losses.append(float(loss))
        if clip is not None:
            norms.append(float(clip_grad_norm_(pm, clip)))
        opt.step(), opt.zero_grad()
    return {"losses": losses, "norms": norms}


def _same(
    got: dict[str, Any],
    ref: dict[str, Any],
    steps: range,
    case: Any,
    rel: float = 1e-9,
    **close: float,
) -> None:
    """Losses within ``rel`` and parameters within ``close`` (``assert_close``'s defaults)."""
    for got_loss, ref_loss in zip(got["losses"], [ref["losses"][s] for s in steps], strict=True):
        assert got_loss == pytest.approx(ref_loss, rel=rel), case
    full = got["state"]
    assert full.keys() == ref["state"].keys(), case
    for k, v in ref["state"].items():
        torch.testing.assert_close(full[k], v, **close, msg=lambda m, k=k: f"{case} {k}: {m}")


def _offloaded_training(
    level: int, fraction: float, clip: float | None, micro: int = 1, sync: bool = False
) -> dict[str, Any]:
    """GPT at ZeRO ``level`` with ``fraction`` of each tensor's optimizer on the host against
    plain PyTorch (``micro`` micro-batches a step); the bytes of each tier after the last step."""
    model, data, captured = _setup()
    ref = _plain(model, data, clip, micro)
    pm = _made(model, data, captured, level, fraction)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), clip, micro, sync)
    for norm, expected in zip(got["norms"], ref["norms"], strict=True):
        assert norm == pytest.approx(expected, rel=1e-9), (level, fraction)
        assert expected > clip  # the clipping was active
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS * micro), (level, fraction, clip, micro, sync))
    assert torch.equal(got["state"]["unused.weight"], model.unused.weight)  # no gradient
    trainable = [t for t in pm.local_tensors().values() if t.requires_grad]
    stepped = [
        t for fqn, t in pm.local_tensors().items() if t.requires_grad and "unused" not in fqn
    ]
    offloaded = [math.floor(fraction * t.numel() + 0.5) for t in trainable]
    tails = [math.floor(fraction * t.numel() + 0.5) for t in stepped]
    heads = [t.numel() - n for t, n in zip(stepped, tails, strict=True)]
    return {
        "fraction": fraction,
        "device": pm.state_bytes(opt),
        "host": pm.state_bytes(opt, tier="host"),
        "user_state": len(opt.state),
        "host_master_bytes": 8 * sum(offloaded),
        # on the device, AdamW's two moments of each head and a float32 step count per tensor
        "head_adam_bytes": sum(2 * 8 * n + 4 for n in heads if n),
        # on the host, the tails' two moments (and a step count per chunk of tails)
        "tail_moment_bytes": sum(2 * 8 * n for n in tails),
        "tails": sum(1 for n in tails if n),
    }


def _checkpoint_across(
    directory: str, before: tuple, after: tuple, mesh: dict | None = None
) -> None:
    """Two steps at ZeRO and offload ``before`` (level, fraction, and ``_made``'s ``where``
    or not), saved; loaded into a model with other values at ``after``, three more steps: as
    plain PyTorch's five; on dp 2 or ``mesh`` (``_made``'s). (No unused parameter: a
    checkpoint holds no optimizer state of a tensor never stepped, which a load asks for.)"""
    model, data, captured = _setup(unused=False)
    ref = _plain(model, data, None)
    pm = _made(model, data, captured, *before, mesh=mesh)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    _train(pm, opt, data, range(2), None)
    where = "" if len(before) < 3 else ("host" if before[2] is True else "nvme")
    where += "files" if len(before) > 2 and isinstance(before[2], dict) else ""
    staged = "-".join(f"{k}{v}" for k, v in (mesh or {}).items())
    path = Path(directory) / f"{staged}{before[:2]}{where}-{after[:2]}"
    autoshard.save(path, pm, opt, step=2)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)  # a load must overwrite them
    pm2 = _made(other, data, captured, *after, mesh=mesh)
    opt2 = torch.optim.AdamW(pm2.parameters(), lr=LR)
    assert autoshard.load(path, pm2, opt2)["step"] == 2
    got = _train(pm2, opt2, data, range(2, STEPS), None)
    got["state"] = pm2.full_state_dict()
    _same(got, ref, range(2, STEPS), (before, after, mesh))


def _offloaded_llama(
    level: int,
    fraction: float,
    mesh: dict | None = None,
    clip: float | None = CLIP,
    micro: int = 1,
    where: bool | str | dict = False,
) -> None:
    """transformers' Llama built from a config (padded targets the loss leaves out), clipped
    where ``clip``, at ZeRO ``level`` with ``fraction`` of its optimizer on the host (in files,
    ZeRO 3's shards too, by ``where``: ``_made``'s), on dp 2 or ``mesh`` (``_made``'s),
    ``micro`` scaled backwards a step that each sum: as plain PyTorch, every tensor stepped by
    the offload (the user's optimizer keeps no state) with its tails' state on the host (or
    its window of them)."""
    from test_copies import _batches, _llama

    model, data = _llama(), _batches()
    ref = _plain(model, data, clip, micro)
    staged = mesh is not None and "pp" in mesh
    captured = None if staged else capture_modes(model, data[0])
    pm = _made(model, data, captured, level, fraction, where, mesh=mesh)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), clip, micro, sync=True)
    case = ("llama", level, fraction, mesh, micro, where)
    # under pipeline stages, each micro-batch's loss is rounded to float32 apart (HF)
    close = HF if staged else {}
    for norm, expected in zip(got["norms"], ref["norms"], strict=True):
        assert norm == pytest.approx(expected, rel=close.get("rtol", 1e-9)), case
        assert expected > clip  # the clipping was active
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS * micro), case, rel=1e-6, **close)
    assert len(opt.state) == 0 and pm.state_bytes(opt, tier="host")["optimizer"] > 0, case


def _parameters_on_host(fraction: float, micro: int = 1) -> None:
    """GPT at ZeRO 3 with its shards on the host (``fraction`` of the rest's optimizer too),
    clipped, ``micro`` backwards a step that each sum: as plain PyTorch; between steps the
    device holds no shard, no gradient of one and none of their optimizer state."""
    model, data, captured = _setup()
    ref = _plain(model, data, CLIP, micro)
    offload = {"parameters": True, "optimizer": fraction}
    pm = parallelize(model, data[0], {"dp": 2}, captured=captured, zero=3, offload=offload)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), CLIP, micro, sync=True)
    case = ("parameters", fraction, micro)
    for norm, expected in zip(got["norms"], ref["norms"], strict=True):
        assert norm == pytest.approx(expected, rel=1e-9), case
    device, host = pm.state_bytes(opt), pm.state_bytes(opt, tier="host")
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS * micro), case)
    local = pm.local_tensors()
    shards = {fqn: t for fqn, t in local.items() if fqn in pm.zero_units}
    rest = [t for fqn, t in local.items() if fqn not in shards]
    assert shards and all(t.requires_grad for t in shards.values()), case
    assert device["parameters"] == sum(t.nbytes for t in rest), case
    assert host["parameters"] >= sum(t.nbytes for t in shards.values()) > 0, case
    stepped = [t for fqn, t in shards.items() if "unused" not in fqn]
    shard_adam = sum(2 * t.nbytes + 4 for t in stepped if t.numel())
    assert host["optimizer"] >= shard_adam, case
    if fraction == 1.0:  # the rest's state is the optimizer offload's, on the host too
        assert device["optimizer"] == 0, case
    else:
        assert host["optimizer"] == shard_adam and device["optimizer"] > 0, case
        assert host["parameters"] == sum(t.nbytes for t in shards.values()), case
    loss = pm(*shard_inputs(data[0], pm))
    loss.backward()  # the gradients of the shards are the host's: none on the device
    assert pm.state_bytes(opt)["gradients"] == sum(
        t.grad.nbytes for t in rest if t.grad is not None
    ), case
    assert all(t.grad is not None for t in stepped), case


class _Tokens(torch.nn.Module):
    """A table of 4096 rows that dominates a small classifier over the mean of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(4096, 8, sparse=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(ids).mean(1)), y)


class _TokensRead(_Tokens):
    """``_Tokens`` whose table is also read whole before the head, besides its lookups."""

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.emb(ids).mean(1) + self.emb.weight.mean(0)), y)


def _token_optimizers(model: torch.nn.Module, table: torch.Tensor | None) -> list:
    """SparseAdam for the table (its gradient is sparse), AdamW for the rest (either left
    out where a pipeline stage holds none)."""
    rest = [p for p in model.parameters() if p is not table]
    sparse = [torch.optim.SparseAdam([table], lr=LR)] if table is not None else []
    return sparse + ([torch.optim.AdamW(rest, lr=LR)] if rest else [])


def _plain_with_table(model: torch.nn.Module, fqn: str, data: list) -> tuple:
    """A copy of ``model`` trained as plain PyTorch on ``data``, its table ``fqn`` stepped by
    SparseAdam and the rest by AdamW: the copy and its losses."""
    ref = copy.deepcopy(model)
    opts, losses = _token_optimizers(ref, ref.get_parameter(fqn)), []
    for batch in data:
        loss = ref(*batch)
        loss.backward()
        losses.append(float(loss))
        for opt in opts:
            opt.step(), opt.zero_grad()
    return ref, losses


def _tables_on_host() -> None:
    """The table of ``_Tokens`` on the host on dp 2 (ids with repeats): every loss and
    parameter as plain PyTorch's; the device holds none of the table; a step moves each
    rank's unique rows to the device and the union's gradients back."""
    torch.manual_seed(0)
    model = _Tokens().to(torch.float64)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 64, (8, 6), generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(STEPS)
    ]
    ref, ref_losses = _plain_with_table(model, "emb.weight", data)
    pm = parallelize(model, data[0], {"dp": 2}, offload={"embeddings": "emb"})
    table = pm.local_tensors()["emb.weight"]
    opts = _token_optimizers(pm, table)
    row = 8 * table.element_size()
    for batch, ref_loss in zip(data, ref_losses, strict=True):
        local = shard_inputs(batch, pm)
        loss = pm(*local)
        loss.backward()
        assert table.grad.is_sparse and table.grad.device.type == "cpu"
        assert float(loss) == pytest.approx(ref_loss, rel=1e-9)
        assert pm.offload_traffic() == {
            "to_device": local[0].unique().numel() * row,
            "to_host": batch[0].unique().numel() * row,
        }
        for opt in opts:
            opt.step(), opt.zero_grad()
    full = pm.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda m, k=k: f"table {k}: {m}")
    device = [pm.state_bytes(opt) for opt in opts]
    host = pm.state_bytes(opts[0], tier="host")
    assert device[0]["parameters"] == sum(t.nbytes for t in pm.parameters() if t is not table)
    assert device[0]["optimizer"] == 0 < device[1]["optimizer"]
    assert host["parameters"] == table.nbytes
    assert host["optimizer"] == 2 * table.nbytes  # SparseAdam's moments, dense, on the host


def _table_in_stage(which: str) -> None:
    """The table of ``_Tokens`` (ids with repeats) or of transformers' Llama built from a
    config (untied) on the host in the stage of pp 2 x dp 2 that looks it up, under 1F1B:
    every loss and parameter as plain PyTorch's ``sparse=True`` table under SparseAdam; that
    stage's device holds none of the table, its host the table and SparseAdam's moments, the
    other stage's neither; each micro-batch moves its rank's unique rows to the device and
    the union's gradients back."""
    from test_copies import _batches, _llama

    torch.manual_seed(0)
    if which == "tokens":
        model, glob, close, cut = _Tokens().to(torch.float64), "emb", {}, {"stages": ["head"]}
        gen = torch.Generator().manual_seed(1)
        data = [
            (torch.randint(0, 64, (8, 6), generator=gen), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(STEPS)
        ]
    else:
        model, data, glob, close, cut = _llama(), _batches(), "model.model.embed_tokens", HF, {}
        model.model.model.embed_tokens.sparse = True
    fqn = f"{glob}.weight"
    ref, ref_losses = _plain_with_table(model, fqn, data)
    offload = {"embeddings": glob}
    pm = parallelize(model, data[0], {"pp": 2, "dp": 2}, offload=offload, **PIPELINE, **cut)
    table = pm.local_tensors().get(fqn)
    opts = _token_optimizers(pm, table)
    for batch, ref_loss in zip(data, ref_losses, strict=True):
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        assert float(loss) == pytest.approx(ref_loss, rel=close.get("rtol", 1e-9)), which
        row = ref.get_parameter(fqn)[0].nbytes
        micro = batch[0].chunk(PIPELINE["microbatches"])
        mine = [m.chunk(2)[pm.rank % 2].unique().numel() * row for m in micro]
        moved = {"to_device": sum(mine), "to_host": sum(m.unique().numel() * row for m in micro)}
        assert pm.offload_traffic() == (moved if table is not None else dict.fromkeys(moved, 0))
        if table is not None:
            assert table.grad.is_sparse and table.grad.device.type == "cpu", which
        for opt in opts:
            opt.step(), opt.zero_grad()
    full = pm.full_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **close, msg=lambda m, k=k: f"{which} {k}: {m}")
    device = pm.state_bytes(opts[-1])
    host = pm.state_bytes(opts[0], tier="host")
    rest = [t for t in pm.local_tensors().values() if t is not table]  # buffers too
    assert device["parameters"] == sum(t.nbytes for t in rest), (which, device)
    held = table.nbytes if table is not None else 0
    assert host["parameters"] == held and host["optimizer"] == 2 * held, (which, host)
    assert (table is not None) == (pm.rank < 2), which  # the first stage's ranks, 0 and 1


#: the decoder layers of transformers' Llama under ``test_copies``' wrapper
LAYERS = "model.model.layers.*"


class _SavedCount:
    """Bytes of the distinct tensors autograd saves inside a block for backward, besides the
    parameters and buffers (which live on the device anyway): the test's own count, inside
    each offloaded block (so innermost, where the offload's hooks are then not asked)."""

    def __init__(self, pm: Any) -> None:
        self.resident = {t.untyped_storage().data_ptr() for t in pm.parameters()}
        self.resident |= {t.untyped_storage().data_ptr() for t in pm.buffers()}
        self.bytes, self.keys, self.contexts = 0, set(), []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        if key not in self.keys and key[0] not in self.resident and t.numel():
            self.keys.add(key)
            self.bytes += t.numel() * t.element_size()
        return t

    def enter(self, *_: Any) -> None:
        self.keys = set()  # a block's own tensors: one block's saved tensor is not another's
        context = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        context.__enter__()
        self.contexts.append(context)

    def exit(self, *_: Any) -> None:
        self.contexts.pop().__exit__(None, None, None)


def _moved_and_saved(pm: Any, batch: tuple) -> tuple[int, int, int]:
    """One step's bytes the offload sent to the host and back, and the test's count of what
    the offloaded blocks saved in the same step run again."""
    offload = pm.activation_offload
    before = offload.to_host_bytes, offload.to_device_bytes
    pm(*shard_inputs(batch, pm)).backward()
    moved = offload.to_host_bytes - before[0], offload.to_device_bytes - before[1]
    count = _SavedCount(pm)
    programs = pm.programs[True]
    programs = programs.values() if isinstance(programs, dict) else [programs]  # by stage
    blocks = [m for p in programs for m in p.modules() if isinstance(m, OffloadedBlock)]
    assert len(blocks) == len(pm.activation_offload.blocks)
    hooks = [h for b in blocks for h in (b.block.register_forward_pre_hook(count.enter),
                                         b.block.register_forward_hook(count.exit))]  # fmt: skip
    pm(*shard_inputs(batch, pm)).backward()
    for h in hooks:
        h.remove()
    assert offload.to_host_bytes - before[0] == moved[0]  # the count's hooks were innermost
    return moved[0], moved[1], count.bytes


def _activations_offloaded(mesh: dict, **options: Any) -> dict[str, Any]:
    """transformers' Llama with the saved tensors of its decoder layers on the host, against
    plain PyTorch; the bytes moved against the test's count of what those layers saved, and
    (under a pipeline) the saved bytes the device held at most with and without offload."""
    from test_copies import _batches, _llama

    model, data = _llama(), _batches()
    ref = _plain(model, data, None)
    pm = parallelize(model, data[0], mesh, offload={"activations": LAYERS}, **options)
    assert pm.activation_offload.blocks and all(
        fnmatch.fnmatchcase(b, LAYERS) for b in pm.activation_offload.blocks
    )
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), None)
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS), ("activations", mesh), rel=1e-6)
    to_host, to_device, saved = _moved_and_saved(pm, data[0])
    out = {"mesh": mesh, "to_host": to_host, "to_device": to_device, "saved": saved}
    out["prefetches"] = pm.activation_offload.prefetches
    if "pp" in mesh:
        for made in (pm, parallelize(model, data[0], mesh, **options)):
            made.counting_saved = True
            made(*data[0])
        out["peaks"] = (sum(pm.saved_bytes.peak.values()), sum(made.saved_bytes.peak.values()))
    return out


def _nvme_training(directory: str, level: int, fraction: float, clip: float | None = None) -> None:
    """GPT at ZeRO ``level`` with ``fraction`` of its optimizer in files under ``directory``,
    as plain PyTorch (clipped where ``clip``, the norms too); the files hold each tail's master
    weights, gradient and two moments, the host only the two slots of the budget."""
    model, data, captured = _setup()
    ref = _plain(model, data, clip)
    before = set(Path(directory).iterdir())
    pm = _made(model, data, captured, level, fraction, directory)
    made = set(Path(directory).iterdir()) - before  # both ranks write there
    (mine,) = [d for d in made if d.name.startswith(f"rank{pm.rank}-")]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), clip)
    for norm, expected in zip(got["norms"], ref["norms"], strict=True):
        assert norm == pytest.approx(expected, rel=1e-9), ("nvme", level, fraction)
        assert expected > clip  # the clipping was active
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS), ("nvme", level, fraction, clip))
    if fraction == 1.0:
        assert len(opt.state) == 0  # every tensor's state is in the files
    tails = {
        fqn: math.floor(fraction * t.numel() + 0.5) * t.element_size()
        for fqn, t in pm.local_tensors().items()
        if t.requires_grad and t.numel()
    }
    # a tensor never stepped has its master's file only
    held = sum(4 * n if "unused" not in fqn else n for fqn, n in tails.items())
    files = sum(f.stat().st_size for f in mine.iterdir())
    assert files == held > 0, (files, tails)
    host = pm.state_bytes(opt, tier="host")
    assert host["parameters"] == host["gradients"] == 0
    assert 0 < host["optimizer"] <= NVME_BUDGET_MB * 2**20


def _parameters_in_files(
    directory: str, clip: float | None = None, mesh: dict | None = None
) -> None:
    """GPT at ZeRO 3 with its shards kept in files under ``directory`` (with their masters'
    optimizer state; no optimizer fraction of the rest), as plain PyTorch (clipped where
    ``clip``, the norms too); the device and the host hold none of a shard's bytes, nor its
    gradient or state, the files all of them; gathers found shards read ahead. On dp 2 or
    ``mesh`` (``_made``'s: its stages' ranks share ``directory``, each its own files)."""
    staged = mesh is not None and "pp" in mesh
    model, data, captured = _setup(unused=not staged)  # a stage holds what its ops read
    ref = _plain(model, data, clip)
    before = set(Path(directory).iterdir())
    offload = {"parameters": True, "nvme": directory, "host_budget_mb": NVME_BUDGET_MB}
    given = PIPELINE if staged else {"captured": captured}
    pm = parallelize(model, data[0], mesh or {"dp": 2}, zero=3, offload=offload, **given)
    torch.distributed.barrier()  # every rank has made its directory
    made = {d for d in set(Path(directory).iterdir()) - before if d.name.startswith("rank")}
    assert len(made) == torch.distributed.get_world_size(), made
    (mine,) = [d for d in made if d.name.startswith(f"rank{pm.rank}-")]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), clip)
    for norm, expected in zip(got["norms"], ref["norms"], strict=True):
        assert norm == pytest.approx(expected, rel=1e-9), ("parameters in files", clip)
        assert expected > clip  # the clipping was active
    device, host = pm.state_bytes(opt), pm.state_bytes(opt, tier="host")
    io = pm.nvme_io()
    if not staged:  # a stage of two units has none two ahead of a gather to read
        assert 0 < io["ahead_bytes"] < io["read_bytes"], io  # a part of what was read
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS), ("parameters in files", clip, mesh))
    local = pm.local_tensors()
    shards = {fqn: t for fqn, t in local.items() if fqn in pm.zero_units and t.numel()}
    rest = [t for fqn, t in local.items() if fqn not in shards]
    assert shards and all(t.untyped_storage().nbytes() == 0 for t in shards.values())
    assert device["parameters"] == sum(t.nbytes for t in rest)
    assert host["parameters"] == host["gradients"] == 0
    assert not any(t in opt.state for t in shards.values())  # their state is in the files
    assert 0 < host["optimizer"] <= NVME_BUDGET_MB * 2**20  # the two slots, the read-ahead
    # each stepped shard's master, gradient and two moments; the unused one's master alone
    held = sum(t.nbytes * (1 if "unused" in fqn else 4) for fqn, t in shards.items())
    assert sum(f.stat().st_size for f in mine.iterdir()) == held


class _Wide(torch.nn.Module):
    """Four 1024-wide layers: 32 MiB of float64 weights, little else."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return torch.nn.functional.mse_loss(x, y)


def _status(key: str) -> int:
    """Bytes of ``key`` (``VmRSS``, ``VmHWM``: the peak since it was last reset) of this rank."""
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(key))
    return int(line.split()[1]) * 1024


def _peak_growth(offload: dict | None, optimizer: type = torch.optim.AdamW) -> int:
    """Three steps of ``_Wide`` on dp 2 at ZeRO 0: the peak of the rank's resident memory
    over what it held before them."""
    torch.manual_seed(0)
    model = _Wide().double()
    batch = (torch.randn(4, 1024, dtype=torch.float64), torch.randn(4, 1024, dtype=torch.float64))
    pm = parallelize(model, batch, {"dp": 2}, zero=0, offload=offload)
    opt = optimizer(pm.parameters(), lr=LR)
    del model
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    # allocations of 64 KiB and more mapped and unmapped (M_MMAP_THRESHOLD), so that freed
    # memory leaves the resident set and a peak is what was held at once; what earlier
    # cases freed given back
    libc.mallopt(-3, 65536)
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    before = _status("VmRSS")
    for _ in range(3):
        pm(*shard_inputs(batch, pm)).backward()
        opt.step(), opt.zero_grad()
    return _status("VmHWM") - before


def _nvme_cases(directory: str) -> dict[str, Any]:
    """NVMe-held optimizer state: as plain PyTorch at ZeRO 0 and 2, checkpoints both ways,
    and the resident memory of a run whose state outgrows its host budget; ZeRO 3's shards
    in files, as plain PyTorch."""
    nvme = Path(directory) / "nvme"
    nvme.mkdir(exist_ok=True)
    _nvme_training(str(nvme), 0, 1.0)
    _nvme_training(str(nvme), 2, 0.5)
    _parameters_in_files(str(nvme))
    _checkpoint_across(directory, (1, 1.0, str(nvme)), (2, 0.0))
    _checkpoint_across(directory, (2, 0.5), (0, 1.0, str(nvme)))
    budget = 4
    held = {"optimizer": 1.0, "nvme": str(nvme), "host_budget_mb": budget}
    return {
        "budget": budget * 2**20,
        # the state AdamW keeps for _Wide's 32 MiB on the host: masters, gradients, moments
        "state": 4 * sum(p.numel() * p.element_size() for p in _Wide().double().parameters()),
        # the same steps with no optimizer state: the device's own (here the rank's memory)
        "stateless": _peak_growth(None, torch.optim.SGD),
        "nvme": _peak_growth(held),
        "on_host": _peak_growth({"optimizer": 1.0}),
    }


def _cases(directory: str) -> list[dict[str, Any]]:
    """Every case in one spawn of the ranks."""
    trained = [
        _offloaded_training(*case)
        for case in [
            (0, 1.0, None),
            (0, 0.5, CLIP),
            (1, 1.0, None),
            (1, 0.5, CLIP),
            (2, 1.0, CLIP),
            (2, 0.5, None),
            (3, 1.0, CLIP),
            (3, 0.5, None),
            # accumulation: under no_sync, and by backwards that each sum (added on the host)
            (2, 1.0, None, 2),
            (0, 0.5, None, 2, True),
            (3, 0.5, CLIP, 2, True),
        ]
    ]
    _checkpoint_across(directory, (2, 1.0), (1, 0.0))
    _checkpoint_across(directory, (3, 0.0), (2, 0.5))
    _checkpoint_across(directory, (1, 0.5), (3, 1.0))
    _checkpoint_across(directory, (3, 0.0, True), (2, 0.0))  # shards saved from the host
    _checkpoint_across(directory, (1, 0.0), (3, 0.5, True))  # and loaded into it
    _offloaded_llama(2, 0.5)
    _offloaded_llama(3, 1.0)
    # pipeline stages: Llama clipped, two halved losses a step (each backward's gradients
    # scaled, the second's added on the host); GPT's tied embedding and head in both stages
    _offloaded_llama(0, 1.0, {"pp": 2}, micro=2)
    _checkpoint_across(directory, (0, 1.0), (0, 0.0), {"pp": 2})
    nvme = Path(directory) / "nvme"
    nvme.mkdir(exist_ok=True)
    _checkpoint_across(directory, (0, 0.0), (0, 0.5, str(nvme)), {"pp": 2})
    _parameters_on_host(0.0)
    _parameters_on_host(1.0, micro=2)
    _tables_on_host()
    activations = [
        _activations_offloaded({"pp": 2}, schedule="1f1b", microbatches=2),
        _activations_offloaded({"dp": 2}),
    ]
    return {"optimizer": trained, "activations": activations, "nvme": _nvme_cases(directory)}


def test_offload_trains_as_plain_pytorch_and_checkpoints_across_it(tmp_path) -> None:
    """Optimizer offload: ZeRO 0-3 with a fraction of 1.0 and 0.5 on dp 2 (clipping in half the
    cases, gradient accumulation in three), and checkpoints saved under offload loaded without
    it and the reverse, each as plain PyTorch; with it all, the device holds no optimizer
    state and the host holds all of it. Activation offload of Llama's decoder layers on pp 2
    and dp 2, as plain PyTorch: every byte they save goes to the host and comes back once.
    NVMe: as plain PyTorch, checkpoints both ways, and a rank's peak resident memory within
    its host budget (and a margin) of a run without optimizer state; ZeRO 3's shards kept in
    files as plain PyTorch, neither the device nor the host holding their bytes."""
    per_rank = run_ranks(_cases, 2, str(tmp_path), timeout=1500)
    for rank, cases in enumerate(per_rank):
        for moved in cases["activations"]:
            assert moved["to_host"] == moved["to_device"] == moved["saved"] > 0, moved
            if "pp" in moved["mesh"]:  # what autograd kept on the device at most
                with_offload, without = moved["peaks"]
                assert with_offload < without, (rank, moved)
            else:  # layer 0's tensors started back when layer 1's backward began, each step
                assert moved["prefetches"] >= STEPS, moved
        run = cases["nvme"]
        # beside what the device's gradients, buckets and collectives take (here the rank's
        # own memory: a stateless run's growth), the budget and 16 MiB more (the windows'
        # optimizers, the I/O thread); the same state on the host outgrows that
        bound = run["stateless"] + run["budget"] + 16 * 2**20
        assert run["budget"] < run["state"], run
        assert run["nvme"] < bound < run["on_host"], (rank, run)
        for held in cases["optimizer"]:
            fraction, host, device = held["fraction"], held["host"], held["device"]
            assert host["parameters"] == held["host_master_bytes"] > 0
            if fraction == 1.0:
                assert held["user_state"] == 0
            # each tensor's moments split between the tiers: the heads' on the device with a
            # step count per tensor (none at 1.0), the tails' on the host with one per chunk
            assert device["optimizer"] == held["head_adam_bytes"], held
            counts = host["optimizer"] - held["tail_moment_bytes"]
            assert counts % 4 == 0 and 1 <= counts // 4 <= held["tails"], held


def _staged_cases(directory: str) -> None:
    """Optimizer, parameter, embedding and NVMe offload inside the stages of pp 2 x dp 2
    (4 ranks)."""
    mesh = {"pp": 2, "dp": 2}
    _table_in_stage("tokens")
    _table_in_stage("llama")
    tied, data, _ = _setup(unused=False)
    tied.wte.sparse = True  # the last stage's output layer reads the same weight
    with pytest.raises(ValueError, match=r"wte.weight is read by pipeline stages \[0, 1\]"):
        parallelize(tied, data[0], mesh, offload={"embeddings": "wte"}, **PIPELINE)
    # the first stage's ranks refuse a table read besides its lookups, and the second stage's
    # ranks, which hold no table, hear of it rather than wait for them in their first step
    ids, y = torch.randint(0, 64, (8, 6)), torch.randint(0, 4, (8,))
    read = r"emb.weight is read by .* besides its lookups"
    told = rf"^rank 0 could not make its pipeline stages: .*{read}" if dist.get_rank() > 1 else read
    with pytest.raises(ValueError, match=told):
        parallelize(
            _TokensRead(),
            (ids, y),
            mesh,
            offload={"embeddings": "emb"},
            **PIPELINE,
            stages=["head"],
        )
    files = Path(directory) / "files"
    files.mkdir(exist_ok=True)
    _parameters_in_files(str(files), mesh=mesh)
    _offloaded_llama(1, 0.5, mesh)
    _checkpoint_across(directory, (3, 0.0, True), (2, 0.5), mesh)  # shards from the host
    _checkpoint_across(directory, (1, 0.0), (3, 1.0, True), mesh)  # and into it


def test_offload_inside_pipeline_stages_trains_as_plain_pytorch(tmp_path) -> None:
    """On pp 2 x dp 2 under 1F1B: Llama with half its optimizer on the host at ZeRO 1,
    clipped; GPT (its tied embedding and head in both stages) with ZeRO 3's shards on the
    host, checkpoints across that and the optimizer's offload at ZeRO 2 both ways, and with
    them in files; a dominant table and Llama's on the host in the first stage (GPT's tied
    one named); every loss and parameter as plain PyTorch's."""
    run_ranks(_staged_cases, 4, str(tmp_path), timeout=1200)


def _fp16_scaled(
    level: int, fraction: float | None, nvme: str | None = None, mesh: dict | None = None
) -> None:
    """GPT computing in float16 with ``fraction`` of its optimizer on the host (in files under
    ``nvme``; none where None) at ZeRO ``level`` on ``mesh`` (dp 2; with a pp axis, in stages
    under 1F1B) under ``autoshard.GradScaler``, against one device under
    ``torch.amp.GradScaler``, both stepped by SGD with momentum (an update linear in the
    gradients, so float16's rounding moves it by as much as it moves them: test_precision.py).
    The first step's scaled gradients overflow float16 on both sides; a later step has an inf
    put into a host tail's gradient on rank 1 alone (a device gradient's without offload; into
    one parameter's on the one device): both skip those steps (the host's update too) and back
    off alike, and the rest equal."""
    model, config = build("gpt", 0.0)
    data = batches(config, torch.float32)
    captured = capture_modes(model, data[0], dtype=torch.float16)
    ref = single_device(copy.deepcopy(model), data[0], captured=captured, precision="fp16")
    offload = None if fraction is None else {"optimizer": fraction}
    if nvme:
        offload |= {"nvme": nvme, "host_budget_mb": 0.05}
    mesh = mesh or {"dp": 2}
    if "pp" in mesh:  # each stage's micro-batch captured by the run itself
        pm = parallelize(
            model, data[0], mesh, zero=level, precision="fp16", offload=offload, **PIPELINE
        )
    else:
        pm = parallelize(
            model, data[0], mesh, captured=captured, zero=level, precision="fp16", offload=offload
        )
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, pm)]
    # 2**16 scales float16's gradients past its largest value (65504)
    scalers = [
        torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2),
        autoshard.GradScaler(init_scale=2.0**16, growth_interval=2),
    ]
    start = ref.full_state_dict()
    case, poisoned = ("fp16", level, fraction, nvme, mesh), 4
    scales, stepped, losses = [], [], []
    for step in range(8):
        batch, before = data[step % len(data)], pm.full_state_dict()
        for m, opt, scaler, local in zip(
            (ref, pm), opts, scalers, (batch, shard_inputs(batch, pm)), strict=True
        ):
            loss = m(*local)
            scaler.scale(loss).backward()
            if step == poisoned and m is ref:
                next(iter(ref.parameters())).grad.view(-1)[0] = float("inf")
            elif step == poisoned and pm.rank == 1 and offload:
                # the last part: a host tail (a device head where the tails are in files)
                pm.offloaded_grads()[-1][1].view(-1)[0] = math.inf
            elif step == poisoned and pm.rank == 1:
                [p for p in pm.parameters() if p.grad is not None][-1].grad.view(-1)[0] = math.inf
            scaler.step(opt), scaler.update(), opt.zero_grad()
            losses.append(float(loss))
        scales.append([float(s.get_scale()) for s in scalers])
        after = pm.full_state_dict()
        stepped.append(any(not torch.equal(after[k], v) for k, v in before.items()))
    assert [a == b for a, b in scales] == [True] * 8, (case, scales)
    # a step skipped is one the scale backed off after (2**16 again after two clean ones)
    backed = [now[0] < was[0] for was, now in zip([[2.0**16]] + scales, scales, strict=False)]
    assert backed[0] and backed[poisoned] and not all(backed), (case, scales)
    assert stepped == [not b for b in backed], (case, stepped, scales)
    for got, expected in zip(losses[1::2], losses[0::2], strict=True):
        assert got == pytest.approx(expected, rel=0.02), case
    full = pm.full_state_dict()
    for k, v in ref.full_state_dict().items():
        moved, moved_ref = full[k] - start[k], v - start[k]
        error = float((moved - moved_ref).norm() / moved_ref.norm().clamp_min(1e-12))
        assert error < 0.03 or moved_ref.norm() == 0, (case, k, error)


def _planned_in_stages() -> None:
    """``autoshard.plan`` with pp 2 and the optimizer on the host, its JSON run by
    ``parallelize(plan=...)``: as plain PyTorch, the optimizer's state on the host alone."""
    model, data, _ = _setup(unused=False)
    ref = _plain(model, data, None)
    offload = {"optimizer": 1.0}
    plan = autoshard.plan(model, data[0], "cpu", num_devices=2, pp=2, offload=offload, **PIPELINE)
    made = json.loads(json.dumps(plan.json))
    assert made["pipeline"]["pp"] == 2 and made["options"]["offload"] == offload, made["options"]
    assert made["predicted"]["host_memory_bytes"]["optimizer"] > 0, made["predicted"]
    pm = parallelize(model, data[0], None, plan=made)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    got = _train(pm, opt, data, range(STEPS), None)
    got["state"] = pm.full_state_dict()
    _same(got, ref, range(STEPS), "planned in stages")
    assert pm.state_bytes(opt)["optimizer"] == 0 < pm.state_bytes(opt, tier="host")["optimizer"]


def _nvme_clipped(directory: str) -> None:
    """NVMe's clipping; float16's loss scaling over offloaded gradients; a plan with stages
    and the optimizer's offload run from its JSON (in the same ranks)."""
    _planned_in_stages()
    _nvme_training(directory, 0, 1.0, CLIP)
    _nvme_training(directory, 2, 0.5, CLIP)
    _nvme_training(directory, 3, 1.0, CLIP)
    _parameters_in_files(directory, CLIP)
    # ZeRO 3's shards in files saved from them (resharded to ZeRO 2 without offload) and
    # loaded into them; the optimizer's half in files beside them
    files = {"parameters": True, "nvme": directory}
    _checkpoint_across(directory, (3, 0.0, files), (2, 0.0))
    _checkpoint_across(directory, (1, 0.0), (3, 0.0, files))
    _checkpoint_across(directory, (3, 0.5, files), (3, 0.0, files))
    for level, fraction in [(1, 1.0), (1, 0.5), (3, 1.0), (3, 0.5)]:
        _fp16_scaled(level, fraction)
    _fp16_scaled(2, 0.5, directory)
    # transformers' Llama with half its optimizer in files, and with ZeRO 3's shards there
    _offloaded_llama(2, 0.5, where=directory)
    _offloaded_llama(3, 1.0, where={"parameters": True, "nvme": directory})
    for fraction in (None, 0.5):  # in stages: the last stage's rank 1 overflows alone
        _fp16_scaled(1, fraction, mesh={"pp": 2})


def test_nvme_held_gradients_are_clipped_as_plain_pytorch(tmp_path) -> None:
    """Clipping reads the gradients in files a window at a time for the norm (the device heads
    as they are) and scales them as the step reads them: the norms, losses and parameters of
    plain PyTorch's ``clip_grad_norm_`` at ZeRO 0, 2 and 3 on dp 2. float16 under loss scaling
    with the optimizer offloaded (1.0 and 0.5 at ZeRO 1 and 3; 0.5 in files at ZeRO 2; in
    pp 2's stages with half of it and without) as plain PyTorch under
    ``torch.amp.GradScaler``, overflowing steps skipped on both sides. transformers' Llama
    with half its optimizer in files at ZeRO 2, and at ZeRO 3 with its shards there too. A
    plan of pp 2 with the optimizer on the host, run from its JSON, as plain PyTorch."""
    run_ranks(_nvme_clipped, 2, str(tmp_path), timeout=900)


def test_offload_is_checked_and_named() -> None:
    assert Options(offload={"optimizer": True}).offload == {"optimizer": 1.0}
    assert Options(offload={"optimizer": 0.5}).offload == {"optimizer": 0.5}
    bad = [
        ({"optimizer": 1.5}, r"offload\['optimizer'\]=1.5: expected a fraction from 0 to 1"),
        ({"optimizer": -0.1}, r"offload\['optimizer'\]=-0.1"),
        ({"optimizer": "all"}, r"offload\['optimizer'\]='all'"),
        ({"gpu": 1.0}, r"offload\['gpu'\]: unknown; expected one of optimizer"),
        (0.5, r"offload=0.5: expected a mapping"),
    ]
    for given, named in bad:
        with pytest.raises(ValueError, match=named):
            Options(offload=given)
    model, data, _ = _setup()
    with pytest.raises(ValueError, match=r"offload\['optimizer'\]=2"):
        parallelize(model, data[0], {"dp": 1}, offload={"optimizer": 2})
    with pytest.raises(ValueError, match=r"offload\['activations'\]=3: expected a module glob"):
        Options(offload={"activations": 3})
    for given, named in [
        ({"nvme": "/tmp"}, r"offload\['nvme'\] keeps the optimizer's host part in files"),
        ({"optimizer": 1.0, "host_budget_mb": 8}, r"host_budget_mb'\] bounds the NVMe tier"),
        ({"optimizer": 1.0, "nvme": "/x", "host_budget_mb": 0}, r"expected a positive"),
    ]:
        with pytest.raises(ValueError, match=named):
            Options(offload=given)
    missing = Path(__file__).parent / "no-such-directory"
    a_file = Path(__file__)
    for path, named in [(missing, "no such directory"), (a_file, "not a directory")]:
        with pytest.raises(ValueError, match=rf"offload\['nvme'\]=.*{path.name}.*: {named}"):
            parallelize(model, data[0], {"dp": 1}, offload={"optimizer": 1.0, "nvme": path})
    with pytest.raises(ValueError, match=r"offload\['nvme'\]=True: the plan keeps state on NVMe"):
        parallelize(model, data[0], {"dp": 1}, offload={"optimizer": 1.0, "nvme": True})
    both = r"both name inner.layers.1: a block either runs again in backward or offloads"
    with pytest.raises(ValueError, match=both):
        parallelize(
            model,
            data[0],
            {"dp": 1},
            recompute={"*.1": "selective"},
            offload={"activations": "inner.layers.*"},
        )


def test_parameter_and_embedding_offload_are_checked_and_named() -> None:
    bad = [
        ({"parameters": True}, 2, r"offload\['parameters'\]=True with zero=2: .*give zero=3"),
        ({"parameters": "yes"}, 3, r"offload\['parameters'\]='yes': expected True or False"),
        ({"embeddings": 3}, None, r"offload\['embeddings'\]=3: expected a glob"),
    ]
    for given, zero, named in bad:
        with pytest.raises(ValueError, match=named):
            Options(offload=given, zero=zero)
    assert Options(offload={"parameters": True}, zero={"*": 3}).offload["parameters"] is True
    model, data, captured = _setup()
    with pytest.raises(ValueError, match=r"no parameter of this plan is under ZeRO 3"):
        parallelize(model, data[0], {"dp": 1}, zero=3, offload={"parameters": True})
    # zero left out (a plan's, or none): the run names what it found and what to give
    with pytest.raises(ValueError, match=r"under ZeRO 3 on rank 0 \(zero=None\).*give zero=3"):
        parallelize(model, data[0], {"dp": 1}, offload={"parameters": True})
    wrong = [
        ("nope", r"'nope': matches no nn.Embedding .*inner.wte, inner.wpe"),
        ("inner.wte", r"inner.wte is an nn.Embedding without sparse=True"),
    ]
    for glob, named in wrong:
        with pytest.raises(ValueError, match=named):
            parallelize(model, data[0], {"dp": 1}, offload={"embeddings": glob})
    tied = copy.deepcopy(model)
    tied.inner.wte.sparse = True  # the output layer reads the same weight
    for mesh in [{"dp": 1}, {"pp": 1}]:  # one stage holds the head too
        with pytest.raises(ValueError, match=r"no parameter named inner.wte.weight \(a tied"):
            parallelize(tied, data[0], mesh, offload={"embeddings": "inner.wte"})


def test_one_rank_trains_as_plain_pytorch_with_gradients_no_sum_routes() -> None:
    """dp 1: no bucket or unit sums a gradient, so each leaves ``.grad`` for the host as soon as
    backward has accumulated it, before the user's optimizer can see it."""
    model, data, captured = _setup()
    ref = _plain(model, data, None)
    for fraction in (1.0, 0.5):
        offload = {"optimizer": fraction}
        pm = parallelize(model, data[0], {"dp": 1}, captured=captured, offload=offload)
        opt = torch.optim.AdamW(pm.parameters(), lr=LR)
        got = _train(pm, opt, data, range(STEPS), None)
        got["state"] = pm.full_state_dict()
        _same(got, ref, range(STEPS), fraction)
        assert len(opt.state) == 0  # every tensor's state is the offload's
        pm(*data[0]).backward()
        assert all(p.grad is None for p in pm.parameters()), fraction  # routed in backward


def test_loss_scaling_names_a_second_optimizer_over_tensors_in_files(tmp_path) -> None:
    """The division loss scaling leaves pending over the tails in files is one for all of
    them: an optimizer that steps only some of them is named at ``unscale_``."""
    model, data, _ = _setup()
    offload = {"optimizer": 1.0, "nvme": str(tmp_path)}
    pm = parallelize(model, data[0], {"dp": 1}, precision="fp16", offload=offload)
    params = list(pm.parameters())
    opts = [torch.optim.SGD(params[:2], lr=LR), torch.optim.SGD(params[2:], lr=LR)]
    scaler = autoshard.GradScaler()
    scaler.scale(pm(*data[0])).backward()
    with pytest.raises(ValueError, match=r"under loss scaling: .* stepped by another optimizer"):
        scaler.unscale_(opts[0])


def test_bf16_offload_equals_the_run_without_it_under_fused_adamw() -> None:
    """Mixed precision: the float32 masters updated on the host by torch's fused CPU AdamW (one
    call over the flat masters) are bitwise those the same run updates on the device with
    ``fused=True`` (one call over the tensors)."""
    warnings.filterwarnings("ignore")
    inner, config = build("gpt", 0.0)
    data = batches(config, torch.float32)
    runs = []
    for offload in (None, {"optimizer": 1.0}):
        pm = parallelize(
            copy.deepcopy(inner), data[0], {"dp": 1}, precision="bf16", offload=offload
        )
        opt = torch.optim.AdamW(pm.parameters(), lr=LR, fused=offload is None)
        losses = _train(pm, opt, data, range(STEPS), None)["losses"]
        tiers = (pm.state_bytes(opt)["optimizer"], pm.state_bytes(opt, tier="host")["optimizer"])
        runs.append((losses, pm.full_state_dict(), tiers, len(opt.state)))
    (losses, state, (device, host), stepped), (losses_off, state_off, tiers_off, _) = runs
    assert device > 0 and host == 0
    # the same moments, all of them on the host, where the tensors stepped as one flat chunk
    # keep one float32 step count rather than one each
    assert tiers_off == (0, device - 4 * (stepped - 1))
    assert losses_off == losses
    for k, v in state.items():
        assert torch.equal(state_off[k], v), k


def test_a_host_table_under_bf16_moves_its_master_rows_and_casts_them_on_the_device() -> None:
    """Mixed precision: the lookup moves the float32 rows it reads and the program casts them
    to bfloat16 (the table itself is never cast); the losses are plain float32 PyTorch's to
    bfloat16's rounding."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = _Tokens()
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randint(0, 64, (8, 6), generator=gen), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]
    ref = copy.deepcopy(model)
    ref_opts = _token_optimizers(ref, ref.emb.weight)
    pm = parallelize(model, data[0], {"dp": 1}, precision="bf16", offload={"embeddings": "emb"})
    table = pm.local_tensors()["emb.weight"]
    opts = _token_optimizers(pm, table)
    assert "host_lookup_emb__weight" in pm.program().code
    for batch in data:
        ref_loss = ref(*batch)
        ref_loss.backward()
        loss = pm(*shard_inputs(batch, pm))
        loss.backward()
        assert loss.dtype == torch.bfloat16 and table.dtype == torch.float32
        assert float(loss) == pytest.approx(float(ref_loss), rel=2e-2)
        rows = batch[0].unique().numel() * 8 * 4
        assert pm.offload_traffic() == {"to_device": rows, "to_host": rows}
        for opt in opts + ref_opts:
            opt.step(), opt.zero_grad()


class _Lamb(torch.optim.Optimizer):
    """A step scaled by whole-tensor norms (LAMB's trust ratio): not elementwise."""

    def __init__(self, params: Any, lr: float = LR) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.norm() / p.grad.norm().clamp_min(1e-12) * p.grad)


class _OwnAdam(torch.optim.Adam):
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return super().step(closure)


def test_only_elementwise_optimizers_are_offloaded_and_others_are_named() -> None:
    """Offload steps each tensor in parts, a tail beside other tensors' tails: SGD with momentum
    and Adagrad, elementwise, train as plain PyTorch (float64, 5 steps, every loss and
    parameter); Adafactor, Muon (over the matrices), a LAMB-like optimizer of whole-tensor
    norms and an Adam subclass with its own step are refused by name at their first step,
    before anything is stepped."""
    model, data, captured = _setup()
    for make in (
        lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        lambda ps: torch.optim.Adagrad(ps, lr=LR),
    ):
        ref_model = copy.deepcopy(model)
        ref_opt = make(ref_model.parameters())
        ref = {"losses": []}
        for step in range(STEPS):
            loss = ref_model(*data[step % len(data)])
            loss.backward()
            ref["losses"].append(float(loss))
            ref_opt.step(), ref_opt.zero_grad()
        ref["state"] = ref_model.state_dict()
        pm = parallelize(model, data[0], {"dp": 1}, captured=captured, offload={"optimizer": 0.5})
        got = _train(pm, make(pm.parameters()), data, range(STEPS), None)
        got["state"] = pm.full_state_dict()
        _same(got, ref, range(STEPS), type(ref_opt).__name__)
    refused = [
        (torch.optim.Adafactor, lambda ps: ps, "Adafactor"),
        (torch.optim.Muon, lambda ps: [p for p in ps if p.dim() == 2], "Muon"),
        (_Lamb, lambda ps: ps, "_Lamb"),
        (_OwnAdam, lambda ps: ps, r"_OwnAdam \(a subclass of Adam with its own step\)"),
    ]
    for cls, chosen, named in refused:
        pm = parallelize(model, data[0], {"dp": 1}, captured=captured, offload={"optimizer": 1.0})
        opt = cls(chosen(list(pm.parameters())), lr=LR)
        before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        pm(*data[0]).backward()
        with pytest.raises(ValueError, match=rf"offload\['optimizer'\]: {named} is not an elem"):
            opt.step()
        after = pm.full_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), cls
        assert len(opt.state) == 0, cls
