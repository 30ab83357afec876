"""The shape of the package (docs/architecture.md): imports point one way, down the data flow,
never in a circle; no private name crosses a package; modules and functions stay small; the
public surface is what the docs list and every name in it imports."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch

import autoshard

SRC = Path(autoshard.__file__).resolve().parent

# Bottom first: a module may import its own package and the packages listed before it.
LAYERS = [
    ("command", "watch"),
    ("comm", "strict", "devices", "mesh", "precision", "testing", "memo", "supervisor"),
    ("layout", "schedule"),
    ("options",),
    ("redistribution",),
    ("data",),
    ("ops",),
    ("graph",),
    ("cost",),
    ("search",),
    ("lower",),
    ("runtime", "ps"),
    ("models",),
    ("pictures", "plan_text"),
    ("cli",),
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
TOP = len(LAYERS)  # autoshard/__init__.py: the public surface over everything

#: a package's rooms (sub-packages), bottom first: a room imports the faces (``__init__``) of
#: the rooms before it, never their modules, never a room after it
ROOMS = {"runtime": ("state", "offload", "program", "ps", "pipeline", "entry")}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
#: a function longer than MAX_FUNCTION_LINES says why in a comment starting with this
LONG_REASON = "# Whole:"

PUBLIC = {
    "PRESETS",
    "CaptureError",
    "CheckpointDamaged",
    "CheckpointError",
    "ClusterSpec",
    "Factored",
    "GradScaler",
    "Layout",
    "LayoutError",
    "MeshError",
    "NonFiniteGradientError",
    "Options",
    "ParallelModule",
    "Plan",
    "PlanMismatchError",
    "PlanningError",
    "Precision",
    "RedistributionPlan",
    "Step",
    "StrategyError",
    "capture_modes",
    "clip_grad_norm_",
    "data",
    "gather_tensor",
    "init_mesh",
    "latest",
    "load",
    "materialize",
    "meta_init",
    "parallelize",
    "plan",
    "redistribute",
    "redistribution_plan",
    "save",
    "shard_inputs",
    "shard_tensor",
    "single_device",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["autoshard", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


MODULES = _modules()


def _package(module: str) -> str:
    """``autoshard.search.driver`` -> ``search``; the top-level package is ``autoshard``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "autoshard"


def _level(module: str) -> int:
    return LEVEL[_package(module)] if _package(module) != "autoshard" else TOP


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not MODULES[importer].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of ``module``, including
    imports inside functions: a lazy import is still an edge."""
    tree = ast.parse(MODULES[module].read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("autoshard")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if not target.startswith("autoshard"):
                continue
            names = [a.name for a in node.names]
            submodules = [n for n in names if f"{target}.{n}" in MODULES]
            out += [(f"{target}.{n}", [], node.lineno) for n in submodules]
            rest = [n for n in names if n not in submodules]
            if rest:
                out.append((target, rest, node.lineno))
    return out


def _edges() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}


def test_every_package_has_a_layer():
    packages = {_package(m) for m in MODULES} - {"autoshard"}
    assert packages <= set(LEVEL), f"add {sorted(packages - set(LEVEL))} to LAYERS"


def test_no_upward_imports():
    bad = []
    for module in MODULES:
        for target, _, line in _imports(module):
            if target in MODULES and _level(target) > _level(module):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "imports that point up the data flow:\n" + "\n".join(bad)


def test_no_import_cycles():
    edges = _edges()
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_across_packages():
    bad = []
    for module in MODULES:
        for target, names, line in _imports(module):
            if _package(target) == _package(module):
                continue
            private = [n for n in names if n.startswith("_")]
            if private or any(p.startswith("_") for p in target.split(".")[1:]):
                bad.append(f"{module}:{line} takes {private or target} from {target}")
    assert not bad, "\n".join(bad)


def test_modules_and_functions_are_small():
    bad = []
    for module, path in MODULES.items():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            bad.append(f"{module}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            body = lines[node.lineno - 1 : node.end_lineno]
            if length > MAX_FUNCTION_LINES and not any(LONG_REASON in b for b in body):
                bad.append(f"{module}.{node.name}: {length} lines and no '{LONG_REASON}' reason")
        bad += _stale_reasons(module, text)
    assert not bad, "\n".join(bad)


def _stale_reasons(module: str, text: str) -> list[str]:
    """A ``# Whole:`` reason in no function over the limit (it outlived its length)."""
    functions = [n for n in ast.walk(ast.parse(text))
                 if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]  # fmt: skip
    spans = [(n.lineno, n.end_lineno, n.end_lineno - n.lineno + 1) for n in functions]
    stale = []
    for k, line in enumerate(text.splitlines(), start=1):
        if LONG_REASON in line and all(size <= MAX_FUNCTION_LINES for a, b, size in spans
                                       if a <= k <= b):  # fmt: skip
            stale.append(f"{module}:{k}: a '{LONG_REASON}' reason in no function over the limit")
    return stale


def test_the_checks_see_a_violation():
    """The import walk finds a known edge, so an empty finding above means something."""
    short = "def f():\n    # Whole: once long\n    return 1\n"
    assert _stale_reasons("m", short) == ["m:2: a '# Whole:' reason in no function over the limit"]
    targets = {t for t, _, _ in _imports("autoshard.search.driver")}
    assert "autoshard.search.costgraph" in targets
    assert _level("autoshard.cli.main") > _level("autoshard.layout.layout")


def test_public_surface():
    assert set(autoshard.__all__) == PUBLIC
    for name in autoshard.__all__:
        assert getattr(autoshard, name) is not None


# ``__main__`` modules run the command line when imported.
@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(module):
    importlib.import_module(module)


#: parameter names that hold an object a package above the reader defines (a search.Plan, a
#: runtime.ParallelModule), and that package
UPPER_OBJECTS = {"plan": "search", "node_plan": "search", "pm": "runtime"}


def _untyped_reads(module: str) -> list[str]:
    """Where ``module`` reads an object of a layer above it through ``Any`` (or no annotation)
    or ``getattr``, by the names such objects go by: a read the import check cannot see."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            for arg in args.posonlyargs + args.args + args.kwonlyargs:
                owner = UPPER_OBJECTS.get(arg.arg)
                untyped = arg.annotation is None or ast.unparse(arg.annotation) == "Any"
                if owner and _level(module) < LEVEL[owner] and untyped:
                    found.append(f"{module}:{arg.lineno} {node.name}({arg.arg}: Any)")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args:
            name = ast.unparse(node.args[0])
            owner = UPPER_OBJECTS.get(name)
            if owner and _level(module) < LEVEL[owner]:
                found.append(f"{module}:{node.lineno} getattr({name}, ...)")
    return found


def test_no_layer_reads_an_upper_layers_object_untyped() -> None:
    """A package below the one that defines a plan or a parallel module takes it as a typed
    view defined at its own layer (``cost.decisions.PlanDecisions``, ``data.Planned``), never
    as ``Any`` or through ``getattr``: what it reads is then named where it is defined."""
    found = [where for module in MODULES for where in _untyped_reads(module)]
    assert not found, found


def _room(module: str) -> tuple[str, str] | None:
    """(package, room) of a module inside a room, None elsewhere."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in ROOMS and parts[2] in ROOMS[parts[1]]:
        return parts[1], parts[2]
    return None


def test_rooms_import_the_faces_of_the_rooms_before_them() -> None:
    bad = []
    for module in MODULES:
        mine = _room(module)
        for target, _, line in _imports(module):
            theirs = _room(target)
            if theirs is None or theirs == mine:
                continue
            face = ".".join(["autoshard", *theirs])
            if target != face:
                bad.append(f"{module}:{line} imports {target}, inside the room {face}")
            if mine is not None and mine[0] == theirs[0]:
                order = ROOMS[mine[0]]
                if order.index(theirs[1]) > order.index(mine[1]):
                    bad.append(f"{module}:{line} imports {face}, a room after its own")
    assert not bad, "\n".join(bad)


def _private_names(path: Path) -> tuple[set[str], list[tuple[str, int]]]:
    """The private attributes a module defines (on ``self``, in a class, as a method) and
    those it reads off other objects, with their lines."""
    defined, read = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name.startswith("_"):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            owner = ast.unparse(node.value)
            if owner in ("self", "cls"):
                if isinstance(node.ctx, ast.Store):
                    defined.add(node.attr)
            else:
                read.append((node.attr, node.lineno))
    return defined, read


def test_no_room_reads_another_room_s_private_attributes() -> None:
    """An object of one room is used through its public face in another: ``pm._zero`` read
    by the pipeline's executor is an error, ``pm.zero_units`` is the way."""
    names = {m: _private_names(p) for m, p in MODULES.items() if _room(m)}
    torch_own = set(dir(torch.nn.Module()))  # nn.Module's own (_parameters, _buffers)
    by_room: dict[tuple[str, str], set[str]] = {}
    for module, (defined, _) in names.items():
        by_room.setdefault(_room(module), set()).update(defined - torch_own)
    bad = []
    for module, (_, read) in names.items():
        mine = _room(module)
        others = set().union(*(v for k, v in by_room.items() if k != mine))
        bad += [f"{module}:{line} reads {attr}" for attr, line in read
                if attr in others and attr not in by_room[mine]]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_the_room_checks_see_a_violation() -> None:
    assert _room("autoshard.runtime.pipeline.step") == ("runtime", "pipeline")
    _, read = _private_names(MODULES["autoshard.runtime.pipeline.step"])
    assert "_pipe" in {attr for attr, _ in read}  # the pipeline room's own, read by its executor
    zero, _ = _private_names(MODULES["autoshard.runtime.program.parallel"])
    assert "_zero" in zero  # so ``pm._zero`` read in the pipeline room would be named


#: where every tensor made is made on the rank's device (docs/devices.md)
ON_DEVICE = ("runtime", "ops", "redistribution", "lower")
#: torch's factories of new tensors (``*_like`` take the device of the tensor they copy)
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand",
             "randint", "randperm", "linspace", "logspace", "eye", "empty_strided",
             "as_tensor", "normal"}  # fmt: skip
#: the comment that says why a factory makes a host tensor on purpose
HOST_REASON = "# host:"


def _deviceless_factories(module: str, text: str) -> list[str]:
    """Each call of a torch factory with no ``device=``, or with a device written as a
    literal (a host tensor) and no ``# host:`` reason on its line or the line before; the
    meta device (shapes, no memory) is not a device a tensor is made on."""
    lines = text.splitlines()
    bad = []
    for node in ast.walk(ast.parse(text)):
        func = node.func if isinstance(node, ast.Call) else None
        if not (isinstance(func, ast.Attribute) and func.attr in FACTORIES):
            continue
        if not (isinstance(func.value, ast.Name) and func.value.id == "torch"):
            continue
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if isinstance(device, ast.Constant) and device.value == "meta":
            continue
        if device is not None and not isinstance(device, ast.Constant):
            continue
        near = lines[max(0, node.lineno - 2) : node.end_lineno]
        if not any(HOST_REASON in line for line in near):
            what = "no device=" if device is None else f"device={device.value!r}"
            bad.append(f"{module}:{node.lineno}: torch.{func.attr} with {what}")
    return bad


def test_every_tensor_the_runtime_makes_is_made_on_the_rank_s_device() -> None:
    bad = [
        problem
        for module, path in MODULES.items()
        if module.count(".") > 1 and module.split(".")[1] in ON_DEVICE
        for problem in _deviceless_factories(module, path.read_text())
    ]
    assert not bad, "\n".join(bad)


def test_the_device_check_sees_a_violation() -> None:
    text = (
        "import torch\n"
        "a = torch.zeros(3)\n"
        "b = torch.empty(3, device=x.device)\n"
        "c = torch.tensor([1], device='cpu')\n"
        "# host: counts staged for the exchange\n"
        "d = torch.tensor([1], device='cpu')\n"
        "e = torch.empty(3, device='meta')\n"
        "f = torch.zeros_like(b)\n"
    )
    assert _deviceless_factories("m", text) == [
        "m:2: torch.zeros with no device=",
        "m:4: torch.tensor with device='cpu'",
    ]
