"""One options value: every choice of ``parallelize``, ``autoshard.plan``, ``autoshard plan``
and ``autoshard train`` lives in ``autoshard.options.Options``, checked once, and reaches the
one-program path, the pipeline path, the search and the plan JSON alike."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest
import torch
import torch.nn as nn

import autoshard
from autoshard.options import RUN_AS_PLANNED, FrozenDict, Options
from autoshard.search import PlanningError
from autoshard.testing import run_ranks

#: the arguments of the entry points that are the model and its inputs, not options
MODEL_ARGS = {"model", "example_inputs", "loss_fn", "example_kwargs", "captured", "options"}
#: options only a run reads (the search plans the same without them)
RUN_ONLY = {
    "input_layouts", "plan", "replicas", "bucket_cap_mb", "init", "seed", "timeout_s",
    "reshard_after_forward", "stages", "device",
}  # fmt: skip
FIELDS = {f.name for f in dataclasses.fields(Options)}


def test_every_keyword_of_the_entry_points_is_an_option() -> None:
    """``parallelize`` takes every option, ``autoshard.plan`` every one a search reads; a new
    option added to one and not the other fails here."""
    taken = set(inspect.signature(autoshard.parallelize).parameters) - MODEL_ARGS
    assert taken == FIELDS, taken ^ FIELDS
    planned = set(inspect.signature(autoshard.plan).parameters) - MODEL_ARGS
    planned -= {"num_devices"}  # the devices a cluster preset offers, not a choice of plan
    assert planned == FIELDS - RUN_ONLY, planned ^ (FIELDS - RUN_ONLY)


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"search": "fastest"}, "search='fastest': expected one of optimal"),
        ({"search": "optimal", "plan": "p.json"}, "give search= or plan=, not both"),
        ({"memory_limit": 0}, "memory_limit=0: expected a positive number"),
        ({"timeout_s": -1.0}, "timeout_s=-1.0: expected a positive number"),
        ({"microbatches": 0}, "microbatches=0: expected a positive int"),
        ({"tp": True}, "tp=True: expected a positive int"),
        ({"virtual_stages": 1.5}, "virtual_stages=1.5: expected a positive int"),
        ({"sequence_parallel": 1}, "sequence_parallel=1: expected True or False"),
        ({"schedule": "pipedream"}, "schedule='pipedream': expected one of gpipe"),
        ({"attention": "flash"}, "attention='flash': expected one of allgather"),
        ({"replicas": "copy"}, "replicas='copy': expected one of broadcast"),
        ({"recompute": {"layers.*": "half"}}, "recompute={'layers.*': 'half'}: expected one"),
        ({"zero": 4}, "zero=4: expected 0-3"),
        ({"virtual_stages": 2, "schedule": "1f1b"}, "virtual_stages=2 with schedule='1f1b'"),
        ({"stages": [3]}, "stages=(3,): expected the module paths"),
        ({"seed": "0"}, "seed='0': expected an int"),
        ({"device": "gpu"}, "device='gpu': expected 'cpu', 'cuda', 'cuda:N' or a torch.device"),
        ({"device": "meta"}, "device='meta': expected 'cpu', 'cuda'"),
        ({"offload": {"activations": 3}}, "offload.'activations'.=3: expected a module glob"),
        ({"offload": {"parameters": "yes"}}, "offload.'parameters'.='yes': expected True or"),
        ({"offload": {"nvme": 1}}, "offload.'nvme'.=1: expected a directory path"),
    ],
)
def test_an_option_out_of_range_is_named(given, named) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Options(**given)


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(ValueError) as err:
        Options(microbatches=0, zero=5, attention="flash")
    assert "microbatches=0" in str(err.value) and "zero=5" in str(err.value)
    assert "attention='flash'" in str(err.value)


def test_options_cannot_change_and_travel_whole() -> None:
    opts = Options(mesh={"dp": 2, "tp": 2}, strategies={"fc": ((2, 1), (1, 1))}, zero={"w": 2},
                   stages=["layers.2"], precision="bf16")  # fmt: skip
    assert isinstance(opts.mesh, FrozenDict) and opts.stages == ("layers.2",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.zero = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="cannot change"):
        opts.mesh["pp"] = 2
    with pytest.raises(TypeError, match="cannot change"):
        opts.strategies.update({"other": None})
    again = pickle.loads(pickle.dumps(opts))
    assert again == opts and isinstance(again.mesh, FrozenDict)
    assert opts.replace(zero=1).zero == 1 and opts.zero == {"w": 2}
    with pytest.raises(ValueError, match="zero=7"):
        opts.replace(zero=7)


def test_a_mesh_fixes_the_pipeline_s_degree_and_a_stage_s_sub_mesh() -> None:
    staged = Options(mesh={"pp": 2, "dp": 2, "tp": 2}).with_mesh_pp()
    assert staged.pp == 2 and staged.stage_mesh.as_dict() == {"dp": 2, "tp": 2}
    assert Options(mesh={"pp": 4}).stage_mesh.as_dict() == {"dp": 1}
    assert Options(mesh=8).stage_mesh is None and Options(mesh=8).with_mesh_pp().pp is None
    with pytest.raises(ValueError, match=r"pp=4, but the mesh pp\(2\) \* dp\(2\) has pp 2"):
        Options(mesh={"pp": 2, "dp": 2}, pp=4).with_mesh_pp()
    with pytest.raises(ValueError, match="pp=2, but the mesh dp.2. has pp 1"):
        Options(mesh={"dp": 2}, pp=2).with_mesh_pp()


def test_defaults_are_what_the_search_would_pick() -> None:
    assert Options(schedule="interleaved-1f1b").stages_a_rank == 2
    assert Options(schedule="interleaved-1f1b", virtual_stages=3).stages_a_rank == 3
    assert Options(schedule="1f1b").stages_a_rank == 1
    assert Options().search_keywords()["search"] == "optimal"


def test_keywords_and_an_options_value_combine_or_name_the_clash() -> None:
    base = Options(zero=2, precision="bf16")
    assert Options.from_call({"zero": None, "seed": 3}, base) == base.replace(seed=3)
    with pytest.raises(ValueError, match=r"zero \(2 against 1\)"):
        Options.from_call({"zero": 1}, base)


def test_a_plan_s_options_are_the_run_s_unless_given_otherwise() -> None:
    recorded = Options(precision="bf16", sequence_parallel=True, attention="ring",
                       offload={"optimizer": 0.5}).as_json()  # fmt: skip
    assert recorded["precision"] == {"compute": "bfloat16", "reduce": None}
    taken = Options().planned_under(recorded, "plan p.json")
    assert {n: taken.as_json()[n] for n in RUN_AS_PLANNED} == {
        n: recorded[n] for n in RUN_AS_PLANNED
    }
    with pytest.raises(ValueError, match="attention='ulysses', but plan p.json was made with"):
        Options(attention="ulysses").planned_under(recorded, "plan p.json")
    with pytest.raises(ValueError, match=r"offload=\{'optimizer': 1.0\}, but plan p.json was"):
        Options(offload={"optimizer": 1.0}).planned_under(recorded, "plan p.json")


class Blocks(nn.Module):
    """Four blocks (a linear, a dropout) over (batch, sequence, hidden) values."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(4))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.drop(torch.relu(layer(x)))
        return nn.functional.mse_loss(x, y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, 8, generator=g), torch.randn(8, 4, 8, generator=g)


#: each path of ``parallelize``: the one program, and pipeline stages (one here, cut into
#: two micro-batches; the stage's sub-mesh is the one program's mesh)
PATHS = {"one program": {}, "pipeline": {"microbatches": 2}}


def _build(mesh, **kw):
    torch.manual_seed(0)
    try:
        return autoshard.parallelize(Blocks(), _batch(), mesh, **kw)
    except PlanningError as err:
        return err


def _reaching() -> dict[str, list]:
    """On each path: what each option changed of the module ``parallelize`` made."""
    from autoshard.search.plans import format_plan

    out: dict[str, list] = {}
    for path, staged in PATHS.items():
        seen = []
        for kw in (dict(memory_limit=1), dict(memory_limit=1, search="optimal")):
            seen.append(type(_build({"tp": 2}, **staged, **kw)).__name__)
        for kw in (dict(zero=2), dict(zero=2, search="optimal")):
            seen.append(_build({"tp": 2}, **staged, **kw).plan.zero)
        pm = _build(2, **staged, search="optimal", tp=2, precision="bf16")
        split = {n: s for n, s in pm.plan.mesh.as_dict().items() if s > 1}
        seen.append((split, pm.plan.precision.compute))
        searched = _build(2, **staged, search="optimal", tp=2, sequence_parallel=True)
        seen.append("@tp" in format_plan(searched.plan))  # every op split over tp where it can
        pm = _build({"tp": 2}, **staged, seed=5, timeout_s=30.0, replicas="check", zero=3,
                    bucket_cap_mb=1.0, reshard_after_forward=False, recompute="full")  # fmt: skip
        # what the runtime made of them: the dropout seed, the buckets, ZeRO 3's resharding,
        # the blocks run again in backward (checkpointed submodules in the program)
        from autoshard.lower.recompute import Recompute

        program = pm.programs[True]
        program = program if isinstance(program, torch.fx.GraphModule) else program[0]
        again = any(isinstance(m, Recompute) for m in program.modules())
        seen.append((pm.run_state.seed, pm.grad_sync.cap_bytes,
                     pm.zero_units.reshard_after_forward, again))  # fmt: skip
        out[path] = seen
    return out


def test_every_option_reaches_both_paths() -> None:
    """The same options change the one-program module and the pipeline's alike: a memory
    limit is kept (or named) with and without a search, ZeRO, precision, a fixed tensor-
    parallel degree and sequence parallelism reach a search of either, and what the runtime
    reads reaches the module either way."""
    one, staged = run_ranks(_reaching, 2, timeout=300)[0].values()
    assert one[:2] == ["PlanningError", "PlanningError"], one[:2]
    assert one[2:4] == [2, 2]
    assert one[4] == ({"tp": 2}, torch.bfloat16)
    assert one[5] is True
    assert one[6] == (5, 2**20, False, True), one[6]
    assert one == staged, (one, staged)


def _interleaved() -> tuple:
    torch.manual_seed(0)
    pm = autoshard.parallelize(Blocks(), _batch(), {"pp": 2}, schedule="interleaved-1f1b",
                               microbatches=4)  # fmt: skip
    searched = autoshard.parallelize(Blocks(), _batch(), {"pp": 2}, search="optimal", zero=1,
                                     schedule="interleaved-1f1b")  # fmt: skip
    return (pm.options.stages_a_rank, pm.schedule.num_stages, searched.plan.zero,
            searched.schedule.name)  # fmt: skip


def test_interleaved_without_virtual_stages_takes_the_search_s_default() -> None:
    assert run_ranks(_interleaved, 2, timeout=300)[0] == (2, 4, 1, "interleaved-1f1b")


def test_a_plan_records_its_options_and_a_run_keeps_them() -> None:
    model = Blocks()
    made = autoshard.plan(model, _batch(), "cpu", num_devices=2, precision="bf16", zero=1)
    assert made.json["options"]["precision"] == {"compute": "bfloat16", "reduce": None}
    assert made.json["options"]["zero"] == 1
    staged = autoshard.plan(model, _batch(), "cpu", num_devices=2, microbatches=2,
                            memory_limit=2**30)  # fmt: skip
    assert staged.json["options"]["memory_limit"] == 2**30
    assert staged.json["pipeline"]["microbatches"] == 2
    assert "microbatches" not in staged.json["pipeline"]["searched"]
    with pytest.raises(PlanningError, match="no pipeline configuration fits 1 B"):
        autoshard.plan(model, _batch(), "cpu", num_devices=2, microbatches=2, memory_limit=1)
