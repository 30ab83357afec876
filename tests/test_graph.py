"""Capture and the OpGraph (graph/): placeholder kinds and names, tied weights, op keys stable
across modes and depths, repeated blocks and key patterns, FLOPs, shapes and dtypes, capture
errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

from autoshard import CaptureError, single_device
from autoshard.graph import OpGraph, capture, capture_modes, node_info
from autoshard.models import MLP, Llama, LlamaConfig, MLPConfig, build, reference_config

warnings.filterwarnings("ignore", category=FutureWarning)

MODELS = ["gpt", "llama", "mlp"]
BATCH = 2


class _Captured:
    """A reference model (2 blocks, dropout on), its train and eval graphs, and the train graph
    of the same model with 4 blocks."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        config = reference_config(name, dropout=0.1)
        self.model = build(config)
        self.example = config.example_batch(BATCH)
        self.modes = capture_modes(self.model, self.example)
        deep = reference_config(name, layers=4, dropout=0.1)
        self.deep = capture(build(deep), deep.example_batch(BATCH))

    @property
    def train(self) -> OpGraph:
        return self.modes[True]


@pytest.fixture(scope="module")
def captured():
    """``captured(name)``: each reference model captured once for the whole module."""
    cache: dict[str, _Captured] = {}

    def get(name: str) -> _Captured:
        if name not in cache:
            cache[name] = _Captured(name)
        return cache[name]

    return get


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's arguments that are graph values holding a tensor, in argument order."""
    flat = pytree.tree_leaves((node.args, node.kwargs))
    return [
        a for a in flat if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


def _names_by_tensor(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every name of each parameter, keyed by each of its names (tied ones share a tuple)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: tuple(sorted(names)) for names in groups.values() for name in names}


# -- placeholders -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_placeholders_have_kinds_names_and_the_state_shapes(captured, name: str) -> None:
    """Inputs, parameters and buffers are told apart and named by the model's own names, with
    the shapes and dtypes of the model's tensors."""
    c = captured(name)
    og = c.train
    params = dict(c.model.named_parameters(remove_duplicate=False))
    buffers = dict(c.model.named_buffers())
    placeholders = [og[n] for n in og.graph.nodes if n.op == "placeholder"]
    by_kind: dict[str, list] = {}
    for info in placeholders:
        by_kind.setdefault(info.kind, []).append(info)
    assert set(by_kind) <= {"input", "param", "buffer"}
    inputs = by_kind["input"]
    assert [i.node.name for i in inputs] == og.inputs
    assert og.inputs == (["x", "targets"] if name == "mlp" else ["idx", "targets"])
    assert all(i.fqn is None and i.names == () for i in inputs)
    assert [i.out_shapes[0] for i in inputs] == [tuple(t.shape) for t in c.example]
    # every parameter name is some placeholder's name or one of its tied names
    seen = {n for i in by_kind["param"] for n in i.names}
    assert seen == set(params)
    for info in by_kind["param"]:
        p = params[info.fqn]
        assert info.is_state and info.out_shapes == (tuple(p.shape),), info.fqn
        assert info.out_dtypes == (p.dtype,), info.fqn
    assert {i.fqn for i in by_kind.get("buffer", [])} == set(buffers)
    for info in by_kind.get("buffer", []):
        assert info.out_shapes == (tuple(buffers[info.fqn].shape),), info.fqn
    assert og.constants == {}


@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_carry_all_their_names(captured, tied: bool) -> None:
    """GPT's lm_head and Llama's output (when tied) share the embedding's weight: the
    placeholder names both; an untied weight has only its own name."""
    if tied:
        gpt = captured("gpt")
        config = LlamaConfig(tie_embeddings=True)
        torch.manual_seed(0)
        llama = Llama(config)
        cases = [
            (gpt.model, gpt.train, ("lm_head.weight", "wte.weight")),
            (
                llama,
                capture(llama, config.example_batch(BATCH)),
                ("output.weight", "tok_embeddings.weight"),
            ),
        ]
    else:
        llama = captured("llama")
        cases = [(llama.model, llama.train, ("output.weight",))]
    for model, og, names in cases:
        expected = _names_by_tensor(model)
        assert expected[names[0]] == names  # the model itself ties (or not) as the case says
        found = [og[n] for n in og.graph.nodes if n.op == "placeholder" and og[n].fqn in names]
        assert found, names
        for info in found:
            assert tuple(sorted(info.names)) == names, (info.fqn, info.names)
        for info in og.state():
            if info.kind == "param":
                assert tuple(sorted(info.names)) == expected[info.fqn], info.fqn


# -- op keys, blocks and patterns -------------------------------------------------------------


def _dropout_paths(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.Dropout)}


@pytest.mark.parametrize("name", MODELS)
def test_op_keys_name_the_module_and_its_kth_call(captured, name: str) -> None:
    """``key`` is ``<module path>/<aten op>.<k>``, k counting that op's calls made directly by
    that module in graph order; the paths are the model's module names."""
    c = captured(name)
    modules = {n for n, _ in c.model.named_modules()}
    counts: dict[tuple[str, str], int] = {}
    for info in c.train.ops():
        op = info.node.target.__name__.split(".")[0]
        k = counts.get((info.path, op), 0)
        counts[(info.path, op)] = k + 1
        assert info.path in modules, info.path
        assert info.key == f"{info.path}/{op}.{k}", (info.key, info.node.name)
    keys = {i.key for i in c.train.ops()}
    expected = {
        "gpt": ["layers.0.attn.c_attn/linear.0", "layers.1.mlp.c_fc/linear.0", "lm_head/linear.0"],
        "llama": ["layers.0.attention.wq/linear.0", "layers.1.feed_forward.w2/linear.0"],
        "mlp": ["layers.0.fc1/linear.0", "layers.1.fc2/linear.0", "head/linear.0"],
    }[name]
    assert set(expected) <= keys, sorted(keys)


@pytest.mark.parametrize("name", MODELS)
def test_op_keys_agree_between_train_and_eval_and_across_depths(captured, name: str) -> None:
    """The same op has the same key in the train and the eval graph (only dropout differs),
    and block 0 and everything outside the blocks have the same keys at depth 2 and 4."""
    c = captured(name)
    drop = _dropout_paths(c.model)
    assert drop, "the reference models have dropout modules"

    def keys(og: OpGraph) -> list[str]:
        return [i.key for i in og.ops() if i.path not in drop]

    assert keys(c.modes[True]) == keys(c.modes[False])
    assert any(i.path in drop for i in c.modes[True].ops())  # dropout is in the train graph

    def outer_and_first(og: OpGraph) -> list[str]:
        return [i.key for i in og.ops() if i.block is None or i.block == ("layers", 0)]

    assert outer_and_first(c.train) == outer_and_first(c.deep)
    assert len(c.deep.ops()) > len(c.train.ops())


@pytest.mark.parametrize("name", MODELS)
def test_repeated_blocks_and_key_patterns(captured, name: str) -> None:
    """``layers`` is one repeated list with every block index; nodes inside a block carry
    ("layers", i) and the pattern ``layers.*<rest>/<op>``; nodes outside keep their key."""
    c = captured(name)
    for og, depth in ((c.train, 2), (c.deep, 4)):
        assert og.repeated == {"layers": tuple(range(depth))}
        inside = 0
        for info in og.ops():
            parts = info.path.split(".")
            if parts[0] == "layers":
                index = int(parts[1])
                rest = info.path[len(f"layers.{index}") :]
                assert info.block == ("layers", index), info.key
                assert og.key_pattern(info) == f"layers.*{rest}/{info.op}", info.key
                inside += 1
            else:
                assert info.block is None and og.key_pattern(info) == info.key, info.key
        # every block has the same ops, so the count splits evenly
        assert inside > 0 and inside % depth == 0
        patterns = {og.key_pattern(i) for i in og.ops() if i.block is not None}
        assert len(patterns) == inside // depth


class _TwoLinears(nn.Module):
    """Numbered blocks of Linear layers: the same sizes or not."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:], strict=True)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize(("sizes", "repeated"), [([8, 16, 4], False), ([8, 8, 8], True)])
def test_blocks_that_differ_are_not_repeated(sizes: list[int], repeated: bool) -> None:
    """Two numbered blocks of different sizes are blocks but not a repeated list; two of the
    same size are."""
    og = capture(_TwoLinears(sizes), (torch.randn(3, 8),))
    linears = [i for i in og.ops() if i.op.startswith("linear")]
    assert [i.block for i in linears] == [("layers", 0), ("layers", 1)]
    if repeated:
        assert og.repeated == {"layers": (0, 1)}
        assert [og.key_pattern(i) for i in linears] == ["layers.*/linear.0"] * 2
    else:
        assert og.repeated == {}
        assert [og.key_pattern(i) for i in linears] == ["layers.0/linear.0", "layers.1/linear.0"]


# -- FLOPs, shapes and dtypes -----------------------------------------------------------------


def _needs_grad(node: fx.Node, params: dict[str, nn.Parameter]) -> bool:
    """Whether autograd computes a gradient for this value: a trainable parameter, or a float
    value computed from one (user inputs and buffers never)."""
    info = node_info(node)
    if node.op == "placeholder":
        return info.kind == "param" and params[info.fqn].requires_grad
    val = node.meta["val"]
    floating = any(
        isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        for v in (val if isinstance(val, list | tuple) else [val])
    )
    args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
    return floating and any(_needs_grad(a, params) for a in args)


@pytest.mark.parametrize("name", MODELS)
def test_linear_flops_are_the_model_flops_of_forward_and_backward(captured, name: str) -> None:
    """A linear [M, K] x [N, K]^T does 2 M K N FLOPs forward and as many again for each of its
    two operands that needs a gradient (the MLP's first layer reads the user input: no dX)."""
    c = captured(name)
    params = dict(c.model.named_parameters(remove_duplicate=False))
    linears = [i for i in c.train.ops() if i.node.target is torch.ops.aten.linear.default]
    assert len(linears) >= 5
    first = []
    for info in linears:
        x, w = info.node.args[0], info.node.args[1]
        *lead, k = x.meta["val"].shape
        n, k_w = w.meta["val"].shape
        assert k == k_w
        m = math.prod(lead)
        passes = sum(_needs_grad(a, params) for a in (x, w))
        assert info.flops == 2 * m * k * n * (1 + passes), (info.key, info.flops)
        if node_info(x).kind == "input":
            first.append((info.key, passes))
    assert first == ([("layers.0.fc1/linear.0", 1)] if name == "mlp" else [])
    # nothing outside the contractions counts toward model FLOPs in these models
    total = sum(i.flops for i in c.train.ops())
    others = [i for i in c.train.ops() if i.flops and i not in linears]
    assert total >= sum(i.flops for i in linears) > 0
    assert all("scaled_dot_product_attention" in i.op for i in others), [i.key for i in others]


@pytest.mark.parametrize("name", MODELS)
def test_shapes_and_dtypes_are_the_fake_values(captured, name: str) -> None:
    """``in_shapes``/``in_dtypes`` follow the tensor arguments and ``out_shapes``/``out_dtypes``
    the outputs' fake values; known sizes check the values themselves."""
    c = captured(name)
    for info in c.train.ops():
        args = [a.meta["val"] for a in _tensor_args(info.node)]
        assert info.in_shapes == tuple(tuple(a.shape) for a in args), info.key
        assert info.in_dtypes == tuple(a.dtype for a in args), info.key
        val = info.node.meta["val"]
        outs = list(val) if isinstance(val, list | tuple) else [val]
        assert info.out_shapes == tuple(tuple(v.shape) for v in outs), info.key
        assert info.out_dtypes == tuple(v.dtype for v in outs), info.key
    by_key = {i.key: i for i in c.train.ops()}
    config = c.model.config
    if name == "gpt":
        seq, hidden = config.block_size, config.hidden
        fc = by_key["layers.0.mlp.c_fc/linear.0"]
        assert fc.out_shapes == ((BATCH, seq, 4 * hidden),)
        assert fc.in_shapes == ((BATCH, seq, hidden), (4 * hidden, hidden), (4 * hidden,))
        assert by_key["layers.0.attn/split.0"].out_shapes == ((BATCH, seq, hidden),) * 3
    elif name == "llama":
        seq, hidden = config.max_seq, config.hidden
        kv = config.num_kv_heads * config.head_dim
        assert by_key["layers.0.attention.wk/linear.0"].out_shapes == ((BATCH, seq, kv),)
    else:
        fc = by_key["layers.0.fc1/linear.0"]
        assert fc.out_shapes == ((BATCH, config.hidden),)
        assert fc.out_dtypes == (torch.float32,)
    loss = next(i for i in c.train.ops() if i.op.startswith("cross_entropy"))
    assert loss.out_shapes == ((),) and loss.out_dtypes == (torch.float32,)


def test_dtypes_follow_the_model() -> None:
    """A float64 model's ops are float64; the integer targets stay int64."""
    torch.manual_seed(0)
    config = MLPConfig()
    x, y = config.example_batch(BATCH)
    og = capture(MLP(config).double(), (x.double(), y))
    assert {i.out_dtypes for i in og.ops()} == {(torch.float64,)}
    targets = og[og.by_name["targets"]]
    assert targets.out_dtypes == (torch.int64,) and targets.kind == "input"


# -- capture errors and losses ----------------------------------------------------------------


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow cannot be captured
            return x * 2
        return x


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.block = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.proj(x))


def test_capture_error_is_one_line_with_the_users_source_line_and_the_op(capfd) -> None:
    """The module, this file's line with the `if`, the op export stopped at and the remedy in
    one line; torch's own log of the export is filed with the traceback, not printed."""
    import inspect

    from autoshard.graph.failure import log_path

    with pytest.raises(CaptureError) as info:
        capture(_Outer(), (torch.randn(2, 4),))
    message = str(info.value)
    line = inspect.getsourcelines(_Branchy.forward)[1] + 1
    assert "\n" not in message
    assert "module 'block'" in message
    assert f"{__file__}:{line} in forward: `if x.sum() > 0:" in message
    assert "(op aten.item)" in message and "torch.where" in message
    assert message.endswith(f"full log: {log_path()}")
    log = log_path().read_text()
    assert "GuardOnDataDependentSymNode" in log and "torch's log during the capture" in log
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert capfd.readouterr().err == ""


def test_loss_fn_is_captured_with_a_model_returning_logits() -> None:
    torch.manual_seed(0)
    config = MLPConfig()
    model = MLP(config).double()
    x, y = config.example_batch(4)
    x = x.double()
    ref = single_device(model, (x, y), loss_fn=F.cross_entropy)
    ref.eval()
    model.eval()
    torch.testing.assert_close(ref(x, y), F.cross_entropy(model(x), y))
