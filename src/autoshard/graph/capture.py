"""Capture: torch.export of a model (and its loss) into an :class:`OpGraph`.

The graph keeps linear, sdpa, layer_norm and cross-entropy whole (``run_decompositions({})``
removes in-place ops only). Dropout's train flag is baked into the graph, so a model is captured
once per mode.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from autoshard.graph.experts import ExpertsError, experts_as_ops
from autoshard.graph.failure import (
    Held,
    describe_failure,
    one_line_on_rank_zero,
    replay,
    torch_logs_held,
)
from autoshard.graph.opgraph import OpGraph, annotate, module_path
from autoshard.graph.rewrite import rows_through_views
from autoshard.graph.traced import Traced, traced

_DROPPED = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


class CaptureError(ValueError):
    """A model (or part of one) that torch.export cannot capture; names the module."""


class _WithLoss(nn.Module):
    """model(*inputs) followed by loss_fn(output, target): the last input is the target."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*args[:-1]), args[-1])


def call_inputs(
    example_inputs: Sequence[Any] | Mapping[str, Any], example_kwargs: dict[str, Any] | None
) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword inputs of the model's call: a batch that is a dict (a
    transformers batch: ``input_ids``, ``labels``, ...) is passed as keywords."""
    if isinstance(example_inputs, Mapping):
        return (), {**example_inputs, **(example_kwargs or {})}
    return tuple(example_inputs), dict(example_kwargs or {})


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter and buffer, keyed by each of its names (tied weights)."""
    groups: dict[int, list[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        groups.setdefault(id(tensor), []).append(name)
    return {name: names for names in groups.values() for name in names}


def capture(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    train: bool = True,
    dtype: torch.dtype | None = None,
) -> OpGraph:
    """Export ``model`` in train or eval mode; with ``loss_fn`` the last of ``args`` is the
    target and the captured function returns the loss. With ``dtype``, the model is captured
    as if its floating parameters, buffers and inputs were of that dtype (mixed precision's
    compute dtype), on the meta device; the model itself is left as it is."""
    prefix = "" if loss_fn is None else "model."
    held = Held()  # torch's log of the export: printed if it succeeds, filed if not
    args, kwargs = call_inputs(args, kwargs)
    try:
        program = _exported(model, args, kwargs, loss_fn, train, dtype, held, one_trace=True)
    except (ExpertsError, CaptureError):  # told in one line already
        raise
    except Exception as err:  # one line: the user's source line and the op; the rest filed
        one_line_on_rank_zero()
        raise CaptureError(describe_failure(model, err, held)) from None
    replay(held)
    return _from_program(program, model, prefix, train)


def captured_in_one_trace(
    model: nn.Module,
    args: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> OpGraph | None:
    """The training graph :func:`capture` makes, where it is made in one trace (``traced``);
    None where it would need export."""
    held = Held()
    program = _exported(model, args, {}, loss_fn, True, dtype, held, one_trace=True, export=False)
    if program is None:
        return None
    replay(held)
    return _from_program(program, model, "" if loss_fn is None else "model.", True)


def exported(
    model: nn.Module,
    args: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """The training-mode export :func:`capture` makes, with torch's ``dynamic_shapes`` (for
    the positional ``args``); torch's errors as they are."""
    held = Held()
    program = _exported(model, args, {}, loss_fn, True, dtype, held, dynamic_shapes)
    replay(held)
    return program


def _exported(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    train: bool,
    dtype: torch.dtype | None,
    held: Held,
    dynamic_shapes: Any = None,
    one_trace: bool = False,
    export: bool = True,
) -> ExportedProgram | Traced | None:
    """The export of the model; with ``one_trace``, the same graph made in one trace where
    that can be (``traced``), and without ``export`` None where it cannot."""
    root: nn.Module = model if loss_fn is None else _WithLoss(model, loss_fn)
    was_training = model.training
    model.train(train)
    args, kwargs = _unaliased(tuple(args), kwargs or {})
    # A model built on the meta device is captured there, inputs included.
    meta = dtype is not None or any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    try:
        with (
            experts_as_ops(model),
            _as_trained(model, own_loss=loss_fn is None) as refused,
            _state_in(model, dtype, meta),
            torch_logs_held(held),
        ):
            if meta:
                args, kwargs = pytree.tree_map(lambda x: _on_meta(x, dtype), (args, kwargs))
            if one_trace:  # where export's second trace would change nothing
                made = traced(root, tuple(args), kwargs)
                if refused:  # what export would meet again
                    raise refused[0]
                if made is not None or not export:
                    return made
            if loss_fn is not None and dynamic_shapes is not None:
                dynamic_shapes = (dynamic_shapes,)  # _WithLoss takes them as one *args
            program = torch.export.export(
                root, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes
            )
            return program.run_decompositions({})
    finally:
        model.train(was_training)


@contextmanager
def _as_trained(model: nn.Module, own_loss: bool) -> Iterator[list[CaptureError]]:
    """The model called, for the block, as a training step calls it: with ``use_cache=False``
    where its forward takes that keyword (a cache of keys and values serves generation and
    is no output of a step); with ``own_loss`` (no ``loss_fn``), an output that carries a
    ``loss`` (a transformers ``ModelOutput`` of a batch with ``labels``) stands for that loss.
    The call is the model's own (its ``forward`` of this instance, whose signature names the
    inputs), so module paths and names are as without it. Yields the list of the errors the
    call raised (an output without its loss), which a trace that fails swallows."""
    forward = model.forward
    signature = inspect.signature(forward)
    no_cache = "use_cache" in signature.parameters
    refused: list[CaptureError] = []
    if not (no_cache or own_loss):
        yield refused
        return

    def trained(*args: Any, **kwargs: Any) -> Any:
        if no_cache:
            kwargs.setdefault("use_cache", False)
        out = forward(*args, **kwargs)
        if not own_loss or isinstance(out, torch.Tensor) or not hasattr(out, "loss"):
            return out
        if not isinstance(out.loss, torch.Tensor):
            refused.append(
                CaptureError(
                    f"{type(model).__name__} returned no loss: pass labels in the batch, or "
                    "return a scalar loss from forward"
                )
            )
            raise refused[-1]
        return out.loss

    trained.__signature__ = signature  # type: ignore[attr-defined]
    before = model.__dict__.get("forward")
    model.forward = trained
    try:
        yield refused
    finally:
        if before is None:
            del model.forward
        else:
            model.forward = before


def _on_meta(x: Any, dtype: torch.dtype | None) -> Any:
    """``x`` as a meta tensor, of ``dtype`` if floating and given."""
    if not isinstance(x, torch.Tensor):
        return x
    cast = dtype is not None and x.is_floating_point()
    return torch.empty(x.shape, dtype=dtype if cast else x.dtype, device="meta")


@contextmanager
def _state_in(model: nn.Module, dtype: torch.dtype | None, meta: bool = True) -> Iterator[None]:
    """The model's parameters and buffers swapped, for the block, for meta tensors (floating
    ones of ``dtype`` if given), tied ones still tied; the originals are back afterwards."""
    if not meta:
        yield
        return
    swapped: list[tuple[dict, str, Any]] = []
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in list(table.items()):
                if value is None:
                    continue
                if id(value) not in made:
                    meta = _on_meta(value, dtype)
                    if isinstance(value, nn.Parameter):
                        meta = nn.Parameter(meta, requires_grad=value.requires_grad)
                    made[id(value)] = meta
                swapped.append((table, name, value))
                table[name] = made[id(value)]
    try:
        yield
    finally:
        for table, name, value in swapped:
            table[name] = value


def _unaliased(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """A tensor passed as two inputs (``labels=input_ids``) becomes two tensors: torch.export
    traces one placeholder for both (pytorch#144683), wrong once the inputs differ."""
    seen: set[int] = set()

    def fresh(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in seen:
            return x.clone()
        seen.add(id(x))
        return x

    return pytree.tree_map(fresh, (args, kwargs))


def capture_modes(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> dict[bool, OpGraph]:
    """The train and the eval graph (dropout is baked into each); reusable across plans.
    ``dtype``: capture in that compute dtype (see :func:`capture`)."""
    return {
        mode: capture(model, args, kwargs, loss_fn=loss_fn, train=mode, dtype=dtype)
        for mode in (True, False)
    }


def _from_program(
    program: ExportedProgram | Traced,
    model: nn.Module,
    prefix: str,
    train: bool,
    graph: fx.Graph | None = None,
) -> OpGraph:
    """The OpGraph of ``program`` (of ``graph``, a copy of its graph, where given)."""
    graph = program.graph_module.graph if graph is None else graph
    signature = program.graph_signature
    kinds = {
        InputKind.PARAMETER: "param",
        InputKind.BUFFER: "buffer",
        InputKind.CONSTANT_TENSOR: "buffer",
        InputKind.USER_INPUT: "input",
    }
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs = []
    node_kinds: dict[str, str] = {}
    fqns: dict[str, str] = {}
    constants: dict[str, torch.Tensor] = {}
    for node, spec in zip(placeholders, signature.input_specs, strict=True):
        if spec.kind not in kinds:
            raise CaptureError(f"input {node.name} of kind {spec.kind} is not supported")
        node_kinds[node.name] = kinds[spec.kind]
        if spec.kind == InputKind.USER_INPUT:
            inputs.append(node.name)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            fqns[node.name] = spec.target
            constants[node.name] = program.constants[spec.target]
        else:
            fqns[node.name] = spec.target.removeprefix(prefix)
    _drop_checks(graph)
    outputs, mutations = [], {}
    for i, spec in enumerate(signature.output_specs):
        if spec.kind == OutputKind.USER_OUTPUT:
            outputs.append(i)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            mutations[i] = spec.target.removeprefix(prefix)
        else:
            raise CaptureError(f"output {i} of kind {spec.kind} is not supported")
    graph.eliminate_dead_code()
    rows_through_views(graph)
    _strip_prefix(graph, prefix)
    og = OpGraph(
        graph=graph,
        train=train,
        in_spec=program.call_spec.in_spec,
        out_spec=program.call_spec.out_spec,
        inputs=inputs,
        outputs=outputs,
        mutations=mutations,
        aliases=tied_names(model),
    )
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    annotate(og, node_kinds, fqns, constants, frozen)
    return og


def _drop_checks(graph: fx.Graph) -> None:
    """Remove export's shape and metadata assertions; refuse ops no rule can split."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED:
            graph.erase_node(node)
        elif (
            node.op == "call_function"
            and not isinstance(node.target, torch._ops.OpOverload)
            and node.target.__module__ != "_operator"
        ):
            raise CaptureError(
                f"{node.name}: {node.target} in {module_path(node) or 'the model'} is not an aten "
                f"op (a higher-order op such as a no_grad region or a checkpoint); it cannot be "
                f"split"
            )


def _strip_prefix(graph: fx.Graph, prefix: str) -> None:
    if not prefix:
        return
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                k: (path.removeprefix(prefix.rstrip(".")).removeprefix("."), cls)
                for k, (path, cls) in stack.items()
            }


__all__ = [
    "CaptureError",
    "call_inputs",
    "capture",
    "capture_modes",
    "captured_in_one_trace",
    "exported",
    "tied_names",
]
