"""The graph torch.export makes, made in one trace where the model needs nothing export adds.

``torch.export.export(...).run_decompositions({})`` traces the model twice: once before
autograd's dispatch, and again to functionalize that graph and decompose the composite ops
that alias or mutate (``reshape`` into ``view`` or ``clone`` and ``_unsafe_view``, ``chunk``
into ``split``, ``dropout``...), keeping the functional ones whole (``linear``, ``sdpa``,
``layer_norm``, ``cross_entropy_loss``). Where the first trace meets no mutation, the second
changes nothing else, so one trace before autograd's dispatch that decomposes those same
composite ops, with export's own naming of the inputs, is the same graph: the same ops in
the same order, names, module paths, shapes and dtypes (``tests/test_capture_traced.py``
compares the two on every reference model and transformers' models). It takes a fraction
of export's time: Llama's two blocks 0.15 s against 0.7 s, and none of export's first
call's setup.

An in-place op on a value an op made, which no view shares (``x /= s`` in Mixtral's router),
is made functional as export's functionalization makes it (``div_`` to ``div``, the nodes
named again in order). :func:`traced` makes the graph, or answers None where export is
needed: another mutation (of an input, a parameter, a buffer updated in training, a value a
view shares), an op no aten op names (a ``no_grad`` region, a
higher-order op), a tensor the code makes that is not an input (a constant), a shape that
depends on the data, inputs or outputs other than tensors, or a torch without the pieces
this uses. Export then runs as before, with its errors.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.config
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

#: off (``AUTOSHARD_CAPTURE=export`` in the environment) to capture with torch.export always
ENABLED = [os.environ.get("AUTOSHARD_CAPTURE", "") != "export"]


@dataclass
class CallSpec:
    in_spec: Any
    out_spec: Any


@dataclass
class Traced:
    """What capture reads of an ExportedProgram, for a graph made by :func:`traced`."""

    graph_module: fx.GraphModule
    graph_signature: ExportGraphSignature
    call_spec: CallSpec
    constants: dict[str, torch.Tensor]


def traced(root: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Traced | None:
    """``root``'s graph as export's ``run_decompositions({})`` makes it, or None where export
    is needed (module docstring). ``root`` is in the mode to capture; its parameters, buffers
    and the inputs are the tensors to trace with (meta ones where captured on meta)."""
    if not ENABLED[0]:
        return None
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    if not all(isinstance(x, torch.Tensor) for x in flat):
        return None
    try:
        tools = _torch_tools()
    except (ImportError, AttributeError):  # another torch: export it is
        return None
    # every name of a tied tensor, as export lifts them (its uses read the last one)
    params = dict(root.named_parameters(remove_duplicate=False))
    buffers = dict(root.named_buffers(remove_duplicate=False))
    out_specs: list[Any] = []

    def run(state: dict[str, torch.Tensor], args: tuple, kwargs: dict[str, Any]) -> tuple:
        with tools.reparametrized(root, state):
            out = root(*args, **kwargs)
        leaves, spec = pytree.tree_flatten(out)
        out_specs.append(spec)
        return tuple(leaves)

    run._orig_mod = root  # type: ignore[attr-defined]  # module paths as export records them
    tracer = tools.tracer({}, "fake", False, True, True, False, True)
    tracer.decomposition_table = _Decomposed(tools, tracer.decomposition_table)
    try:
        with _as_export_traces(tools):
            gm = tracer.trace(run, {**params, **buffers}, args, kwargs)
    except Exception:  # export says what it is, in its words
        return None
    if not _functional(gm.graph) or not _plain(gm.graph):
        return None
    output = gm.graph.output_node()
    output.args = (tuple(output.args[0]),)  # export's output: a tuple
    signature = _signature(gm.graph, params, buffers, _transient(root))
    if signature is None:
        return None
    try:
        tools.naming(gm, signature, root, args, kwargs, None, {})
    except Exception:
        return None
    return Traced(gm, signature, CallSpec(in_spec, out_specs[-1]), {})


@contextmanager
def _as_export_traces(tools: _Tools) -> Iterator[None]:
    """The contexts export traces in, and no stack traces recorded."""
    with _backends_off(), _no_stack_traces(), tools.exporting(), tools.torch_functions():
        with tools.builtins():
            yield


@contextmanager
def _backends_off() -> Iterator[None]:
    """cuDNN, oneDNN and NNPACK off, as export traces (ops that read the flags record them:
    ``layer_norm``'s ``cudnn_enable``); their flags as they were afterwards."""
    backends = (torch.backends.mkldnn, torch.backends.nnpack, torch.backends.cudnn)
    kept = [backend.set_flags(False) for backend in backends]
    try:
        yield
    finally:
        for backend, flags in zip(backends, kept, strict=True):
            backend.set_flags(*flags)


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """No Python stack trace recorded on each node: nothing reads them, and filtering them
    imports torch.export's tracer (and networkx) and walks the stack at every op."""
    kept = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = kept


@dataclass
class _Tools:
    exporting: Any
    torch_functions: Any
    builtins: Any
    tracer: Any
    reparametrized: Any
    naming: Any
    preservable: Any
    composite: Any
    decomposition: Any


def _torch_tools() -> _Tools:
    """The pieces of torch this uses (private ones: a torch without them exports instead):
    its tracer, the contexts export traces in (``torch.compiler.is_exporting()`` true, its
    handling of torch functions and of ``max``/``min`` on tensors), the rule for which
    composite ops export keeps whole, and its naming of the inputs."""
    from torch._export.non_strict_utils import (
        _NonStrictTorchFunctionHandler,
        _override_builtin_ops,
    )
    from torch._export.utils import (
        _compiling_state_context,
        _get_decomp_for_cia,
        _is_cia_op,
        _is_preservable_cia_op,
        placeholder_naming_pass,
    )
    from torch.fx.experimental.proxy_tensor import _MakefxTracer
    from torch.nn.utils.stateless import _reparametrize_module

    return _Tools(
        _compiling_state_context,
        _NonStrictTorchFunctionHandler,
        _override_builtin_ops,
        _MakefxTracer,
        _reparametrize_module,
        placeholder_naming_pass,
        _is_preservable_cia_op,
        _is_cia_op,
        _get_decomp_for_cia,
    )


class _Decomposed(dict):
    """The trace's decomposition table: every composite op export decomposes (one that
    aliases, mutates or is unsafe to keep), by its composite kernel; asked op by op, as the
    trace meets them, rather than listed over all of aten beforehand."""

    def __init__(self, tools: _Tools, given: dict) -> None:
        super().__init__(given)
        self.tools = tools
        self.asked: dict[Any, Any] = {}

    def _of(self, op: Any) -> Any:
        if dict.__contains__(self, op):
            return dict.__getitem__(self, op)
        if op not in self.asked:
            decomposed = (
                isinstance(op, torch._ops.OpOverload)
                and self.tools.composite(op)
                and not self.tools.preservable(op)
            )
            self.asked[op] = self.tools.decomposition(op) if decomposed else None
        return self.asked[op]

    def __contains__(self, op: object) -> bool:
        return self._of(op) is not None

    def __getitem__(self, op: Any) -> Any:
        found = self._of(op)
        if found is None:
            raise KeyError(op)
        return found

    def get(self, op: Any, default: Any = None) -> Any:
        found = self._of(op)
        return default if found is None else found


def _functional(graph: fx.Graph) -> bool:
    """In-place ops on values no view shares and no input is made functional (``x /= s`` in
    Mixtral's router: ``div_`` to ``div``), and the graph's names made again in order, as
    export's functionalization names them; False where a mutation is of anything else."""
    made = False
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if not target._schema.is_mutable:
            continue
        functional = _functional_of(target)
        if functional is None or not _fresh(node.args[0], node) or not _same_result(node):
            return False
        node.target = functional
        made = True
    if made:
        _named_again(graph)
    return True


def _functional_of(op: torch._ops.OpOverload) -> Any:
    """The functional op of an in-place one (``aten.div_.Tensor``: ``aten.div.Tensor``) that
    writes its first argument only; None for any other mutation."""
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    name = op.overloadpacket.__name__
    if len(written) != 1 or written[0] is not schema.arguments[0] or not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None) if op.namespace == "aten" else None
    functional = getattr(packet, op._overloadname, None) if packet is not None else None
    if not isinstance(functional, torch._ops.OpOverload) or functional._schema.is_mutable:
        return None
    return functional


def _aliases(node: fx.Node) -> bool:
    """Whether the node's value may share memory with its inputs (a view, an in-place op)."""
    target = node.target
    if target is operator.getitem:
        return _aliases(node.args[0]) if isinstance(node.args[0], fx.Node) else True
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in target._schema.returns)


def _fresh(value: Any, mutation: fx.Node) -> bool:
    """A value an op made (not an input, parameter or view) that no view of shares."""
    if not isinstance(value, fx.Node) or value.op != "call_function" or _aliases(value):
        return False
    return all(user is mutation or not _aliases(user) for user in value.users)


def _same_result(node: fx.Node) -> bool:
    """The functional op's result has the in-place one's shape and dtype: every tensor
    argument of the written one's dtype (no promotion) and broadcast to its shape."""
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return False  # a tensor by keyword: not looked into
    written = node.args[0].meta.get("val")
    values = [a.meta.get("val") for a in node.args[1:] if isinstance(a, fx.Node)]
    if not isinstance(written, torch.Tensor) or not all(
        isinstance(v, torch.Tensor) and v.dtype == written.dtype for v in values
    ):
        return False
    shape = torch.broadcast_shapes(written.shape, *(v.shape for v in values))
    return tuple(shape) == tuple(written.shape)


def _named_again(graph: fx.Graph) -> None:
    """Every node named again in graph order as the tracer names them (an op by its name,
    ``div``, ``div_1``...), the placeholders as they are: export's second trace names them so."""
    names = fx.graph._Namespace()
    for node in graph.nodes:
        if node.op == "call_function":
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                target = target.overloadpacket.__name__
            candidate = graph._target_to_str(target)
        else:
            candidate = node.name
        node.name = names.create_name(candidate, node)
    graph._graph_namespace = names


def _plain(graph: fx.Graph) -> bool:
    """No call other than aten ops and getitem, no constant, no shape that depends on the
    data: what export would change or refuse (mutations: ``_functional``, before)."""
    for node in graph.nodes:
        if node.op == "get_attr":
            return False
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return False
        values = node.meta.get("val")
        for value in values if isinstance(values, list | tuple) else [values]:
            if isinstance(value, torch.Tensor) and not all(isinstance(s, int) for s in value.shape):
                return False
    return True


def _signature(
    graph: fx.Graph,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    transient: set[str],
) -> ExportGraphSignature | None:
    """Export's signature of the traced graph: parameters, buffers (persistent or not), the
    user's inputs in order; the outputs, every one the user's. ``transient``: the buffers
    not in the state dict."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    state = [(InputKind.PARAMETER, name, True) for name in params]
    state += [(InputKind.BUFFER, name, name not in transient) for name in buffers]
    if len(placeholders) < len(state):
        return None
    inputs = [
        InputSpec(
            kind, TensorArgument(node.name), target, keep if kind is InputKind.BUFFER else None
        )
        for node, (kind, target, keep) in zip(placeholders, state, strict=False)
    ]
    inputs += [
        InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), None)
        for node in placeholders[len(state) :]
    ]
    (outs,) = graph.output_node().args
    if not all(isinstance(o, fx.Node) for o in outs):
        return None
    outputs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outs]
    return ExportGraphSignature(input_specs=inputs, output_specs=outputs)


def _transient(root: nn.Module) -> set[str]:
    """The names of the buffers registered ``persistent=False``."""
    return {
        f"{path}.{name}" if path else name
        for path, module in root.named_modules()
        for name in module._non_persistent_buffers_set
    }


__all__ = ["ENABLED", "Traced", "traced"]
