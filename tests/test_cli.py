"""The ``autoshard`` command line (cli/): plan, redistribute, argument errors and ``-m``."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
import subprocess
import sys

import pytest
import torch

import autoshard
from autoshard.cost import cluster_spec, estimate
from autoshard.graph.capture import capture
from autoshard.models import Llama, LlamaConfig


def test_plan_command_writes_json_that_parallelize_reads(tmp_path, capsys) -> None:
    from autoshard.cli.main import main

    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            "llama",
            "--layers",
            "4",
            "--hidden",
            "256",
            "--heads",
            "8",
            "--kv-heads",
            "4",
            "--ffn",
            "512",
            "--seq",
            "64",
            "--batch",
            "16",
            "--vocab",
            "1000",
            "--cluster",
            "dgx-h100",
            "--nodes",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "MFU" in text and "meshes tried" in text
    data = json.loads(out.read_text())
    assert math.prod(data["mesh"].values()) == 16
    assert any(k.startswith("layers.*.") for k in data["strategies"])
    # the JSON plans a real (4-layer) model of the same shape in the planner
    from autoshard.mesh import mesh_info
    from autoshard.search import input_layouts, load_plan
    from autoshard.search.semi import plan_graph

    config = LlamaConfig(
        num_layers=4,
        hidden=256,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden=512,
        max_seq=64,
        vocab_size=1000,
    )
    with torch.device("meta"):
        model = Llama(config).to(torch.bfloat16)
        idx = torch.zeros(16, 64, dtype=torch.long)
    captured = capture(model, (idx, idx.clone()), {})
    plan = load_plan(out)
    built = plan_graph(
        captured,
        mesh_info(plan["mesh"]),
        plan["strategies"],
        input_layouts=input_layouts(captured, plan),
    )
    built = dataclasses.replace(built, zero=plan["zero"])  # the stage the search chose
    configured = [n for n in built.nodes.values() if n.configured]
    assert len(configured) >= 4 * 20
    got = estimate(built, captured, cluster_spec(plan["cluster"]))
    # the 2-block capture priced at depth 4 misses only autograd's add of the residual
    # stream's two gradients between blocks (the last captured block has one reader)
    assert got.step_time == pytest.approx(data["predicted"]["step_time_s"], rel=5e-3)


def test_redistribute_command_prints_the_least_bytes_plan(capsys) -> None:
    """Rows split over dp to columns split over tp: each rank keeps its [8, 16] corner and
    all-gathers it over dp, (2 - 1) x 8 x 16 x 4 = 512 bytes per rank."""
    from autoshard.cli.main import main

    argv = ["redistribute", "--mesh", "dp=2,tp=2", "--shape", "16,32"]
    code = main([*argv, "--src", "dp,_", "--dst", "_,tp"])
    assert code == 0
    text = capsys.readouterr().out
    assert "all_gather over {dp}" in text
    assert "f32[16@dp,32] -> f32[16,32@tp]: 512 B/rank" in text
    assert "all_to_all" not in text and "all_reduce" not in text
    code = main([*argv, "--src", "dp,_", "--dst", "_,tp", "--dtype", "f64"])
    assert code == 0 and "1024 B/rank" in capsys.readouterr().out
    assert gc.isenabled()  # paused while the command was read, on again for the caller


def test_the_command_s_collector_is_off_while_the_package_is_imported(monkeypatch, capsys) -> None:
    """The package's import pauses the garbage collector only in the ``autoshard`` command
    (its script or ``-m autoshard.cli``), to the import's end; a library's import leaves it
    as it was, and a command that does not plan leaves it on."""
    from autoshard import command as _command
    from autoshard.cli.main import main

    for argv, command in [
        (["/usr/bin/python3", "/venv/bin/autoshard", "plan"], True),
        (["python", "-m", "autoshard.cli", "plan"], True),
        (["python", "-c", "import autoshard"], False),
        (["python", "train.py", "autoshard"], False),
        (["python"], False),
    ]:
        monkeypatch.setattr(sys, "orig_argv", argv)
        assert _command.the_command() is command, argv
    out = subprocess.run([sys.executable, "-c", "import autoshard, gc; print(gc.isenabled())"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "True"
    monkeypatch.setattr(_command, "PAUSED", True)
    gc.disable()  # as the command's start left it
    try:
        _command.resume()  # at the end of the package's import
        assert gc.isenabled() and not _command.PAUSED
        _command.resume()  # (once)
        assert gc.isenabled()
    finally:
        gc.enable()
    argv = ["redistribute", "--mesh", "dp=2,tp=2", "--shape", "16,32", "--src", "dp,_"]
    assert main([*argv, "--dst", "_,tp"]) == 0 and gc.isenabled()
    capsys.readouterr()


def test_redistribute_command_draws_both_layouts(tmp_path, capsys) -> None:
    from autoshard.cli.main import main

    stem = tmp_path / "move"
    argv = ["redistribute", "--mesh", "dp=2,tp=2", "--shape", "16,32", "--src", "dp,_"]
    assert main([*argv, "--dst", "_,tp", "--picture", str(stem)]) == 0
    out = capsys.readouterr().out
    for end in ("src", "dst"):
        path = tmp_path / f"move-{end}.png"
        assert f"picture: {path}" in out and path.read_bytes().startswith(b"\x89PNG")


def test_redistribute_command_names_a_bad_mesh(capsys) -> None:
    """A mesh size that is not a number stops the command with a message naming --mesh."""
    from autoshard.cli.main import main

    argv = ["redistribute", "--mesh", "dp=2,tp=x", "--shape", "16,32"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--src", "dp,_", "--dst", "_,tp"])
    assert exit_info.value.code == 2 and gc.isenabled()
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: --mesh:") and "dp=2,tp=x" in err, err


def _every_option(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for inner, path in _every_option(sub):
                    yield inner, f"{name} {path}"
        else:
            yield action, "/".join(action.option_strings) or action.dest


def test_every_option_of_every_command_has_help_and_shows_its_default(capsys) -> None:
    from autoshard.cli.args import build_parser
    from autoshard.cost.cluster import PRESETS

    commands = ("demo", "redistribute", "plan", "calibrate", "train", "simulate")
    parser = build_parser(dict.fromkeys(commands, print))
    options = list(_every_option(parser))
    assert len(options) > 25
    missing = [path for action, path in options if not action.help]
    assert not missing, f"options without help: {missing}"
    for command in ("plan", "calibrate", "redistribute", "train", "demo", "simulate"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        if command == "plan":
            assert "(default: 32000)" in text and all(name in text for name in PRESETS)
            assert "--tp-across-nodes" in text and "--kv-heads" in text
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("autoshard ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--cluster", "nosuch"], "cluster 'nosuch': not a preset (dgx-a100"),
        (["plan", "--cluster", "cpu", "--devices", "3"], "3 devices is not a whole number"),
        (["plan", "--heads", "3"], "num_heads(3)"),
        (["plan", "--model-fn", "nosuchmodule:make"], "no module 'nosuchmodule' (looked in"),
        (["plan", "--model-fn", "justamodule"], "expected module:function"),
        (["plan", "--devices", "8", "--cp", "3"], "cp 3 does not divide the 8 devices"),
        (["plan", "--devices", "8", "--tp", "3"], "tp 3 does not divide the 8 devices"),
        (
            ["plan", "--devices", "8", "--cp", "2", "--tp", "8"],
            "tp 8 does not divide the 4 devices a context-parallel",
        ),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys) -> None:
    from autoshard.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    with pytest.raises(Exception, match=re.escape(message)):
        main(["--debug", *argv])  # the whole error, traceback and all


def test_model_fn_finds_a_module_of_the_current_directory(tmp_path, monkeypatch, capsys) -> None:
    from autoshard.cli.main import main

    (tmp_path / "mymodels_cli.py").write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))\n"
        "    return model, (torch.randn(4, 8),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["plan", "--model-fn", "mymodels_cli:make", "--cluster", "cpu"]) == 0
    assert "predicted step" in capsys.readouterr().out


def test_plan_command_for_the_mlp_on_one_node(tmp_path, capsys) -> None:
    """One dgx-h100 node is 8 devices: the plan's mesh uses all of them, in the plan format."""
    from autoshard.cli.main import main

    out = tmp_path / "out.json"
    assert main(["plan", "--model", "mlp", "--nodes", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "autoshard-plan/1"
    assert math.prod(data["mesh"].values()) == 8
    assert data["cluster"]["nodes"] == 1 and data["cluster"]["devices_per_node"] == 8
    assert "meshes tried" in capsys.readouterr().out


def test_plan_command_fixes_the_offload_and_records_it(tmp_path, capsys) -> None:
    """--offload and --nvme fix what is kept off the device: the JSON records it (and its
    options, which a run takes), the table shows the host and NVMe tiers; a bad kind is named."""
    from autoshard.cli.main import main

    out = tmp_path / "out.json"
    small = ["plan", "--model", "gpt", "--cluster", "cpu", "--devices", "2", "--zero", "3"]
    flags = ["--offload", "optimizer=0.5", "--offload", "parameters", "--nvme", "/nvme"]
    assert main([*small, *flags, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    wanted = {"optimizer": 0.5, "parameters": True, "nvme": "/nvme"}
    assert data["offload"] == data["options"]["offload"] == wanted
    pred = data["predicted"]
    assert pred["host_memory_bytes"]["optimizer"] > 0 and pred["offload_s"] > 0
    assert "offload optimizer=0.5, parameters=True, nvme=/nvme: host" in capsys.readouterr().out
    assert main([*small, "--json", str(out)]) == 0  # left out: nothing offloaded
    assert "offload" not in json.loads(out.read_text())
    with pytest.raises(SystemExit):
        main([*small, "--offload", "gpu"])
    assert "'gpu': expected optimizer[=fraction]" in capsys.readouterr().err


def test_plan_command_offloads_in_pipeline_stages(tmp_path, capsys) -> None:
    """--offload with --pp: the busiest rank's tiers in ``predicted`` (the one-program plan's
    fields), each rank's in ``pipeline``, the table's offload line; --copies still refused."""
    from autoshard.cli.main import main

    out = tmp_path / "out.json"
    staged = ["plan", "--model", "llama", "--cluster", "cpu", "--devices", "4", "--pp", "2"]
    staged += ["--microbatches", "4", "--schedule", "1f1b", "--recompute", "none"]
    assert main([*staged, "--offload", "optimizer", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["offload"] == data["options"]["offload"] == {"optimizer": 1.0}
    pred, pipe = data["predicted"], data["pipeline"]
    assert pred["memory_bytes"]["optimizer"] == 0 and pred["offload_s"] == pipe["offload_s"] > 0
    assert len(pipe["host_memory_bytes"]) == len(pipe["nvme_memory_bytes"]) == 2
    busiest = max(pipe["host_memory_bytes"], key=lambda m: sum(m.values()))
    assert pred["host_memory_bytes"] == {**busiest, "total": sum(busiest.values())}
    assert busiest["optimizer"] == 2 * busiest["parameters"] > 0
    assert pred["nvme_memory_bytes"]["total"] == 0
    assert "offload optimizer=1.0: host " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*staged, "--offload", "optimizer", "--copies", "2"])
    assert "--offload: not yet planned with copies" in capsys.readouterr().err


def test_python_dash_m_autoshard_cli_help() -> None:
    """``python -m autoshard.cli --help`` exits 0 and lists the subcommands."""
    done = subprocess.run(
        [sys.executable, "-m", "autoshard.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    for command in ("demo", "redistribute", "plan", "calibrate"):
        assert command in done.stdout


def test_plan_command_states_its_precision_and_assumptions(capsys) -> None:
    from autoshard.cli.main import main

    assert main(["plan", "--model", "gpt", "--cluster", "dgx-a100", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "precision: bfloat16 compute" in out  # a cluster job trains in bf16
    assert "peak 312.0 TFLOP/s" in out  # the A100's bf16 peak, not its TF32 one
    assert "attention 60% forward / 50% backward" in out
    assert "buckets overlapping backward" in out
    assert main(["plan", "--model", "gpt", "--nodes", "1", "--dtype", "f32"]) == 0
    assert "precision: float32 compute" in capsys.readouterr().out


def _finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_version_and_no_torch_deprecation_notices_in_the_output() -> None:
    # planning imports no runtime; the runtime's names are there on first use
    code = (
        "import sys, autoshard.cli.main, autoshard; print('autoshard.runtime' in sys.modules, "
        "'parallelize' in dir(autoshard), autoshard.parallelize.__module__, "
        "autoshard.runtime.save is autoshard.save)"
    )
    cli = [sys.executable, "-m", "autoshard.cli"]
    plan = [*cli, "plan", "--model", "mlp", "--nodes", "1"]
    # four processes of one core each, started together
    started = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in (
            [*cli, "--version"],
            plan,
            [*plan, "--json", "-"],
            [sys.executable, "-c", code],
        )
    ]
    version, planned, as_json, lazy = (_finished(p) for p in started)
    assert version.returncode == 0 and version.stdout.startswith("autoshard 0.1.0 (torch ")
    assert planned.returncode == 0, planned.stderr
    assert "FutureWarning" not in planned.stderr + planned.stdout
    assert planned.stdout.startswith("mesh ")
    # the process ends as soon as its output is out (``_end_process``): all of it is
    assert "\n  (* chosen)\n" in planned.stdout and planned.stdout.endswith("\n"), planned.stdout
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout)["format"] == "autoshard-plan/1"  # nothing else on stdout
    assert lazy.stdout.split() == [
        "False",
        "True",
        "autoshard.runtime.entry.parallelizing",
        "True",
    ], lazy


def test_the_meshes_tried_say_which_fit_nowhere_and_which_a_bound_skipped() -> None:
    from autoshard.plan_text import _meshes

    rows = [
        {"mesh": {"dp": 4, "tp": 2}, "zero": 2, "step_s": 0.25, "memory": 2**33},
        {"mesh": {"dp": 8, "tp": 1}, "zero": 1, "bound_s": 0.3, "skipped": "bound"},
        {"mesh": {"dp": 8, "tp": 1}, "zero": 0, "bound_s": 0.2, "skipped": "memory",
         "least_memory": 3 * 2**30},
        {"mesh": {"dp": 2, "tp": 4}, "zero": 0, "bound_s": 0.4, "fits": False},
    ]  # fmt: skip
    data = {"mesh": {"dp": 4, "tp": 2}, "zero": 2, "predicted": {"meshes": rows,
            "step_time_s": 0.5, "search_objective_s": 0.25,
            "peak_memory_bytes": 2**33}}  # fmt: skip
    # a bound is the search objective's, beside the chosen mesh's objective, not its step
    assert _meshes(data)[1:] == [
        "*      4x2 ZeRO 2: 500.00 ms, 8.00 GiB (objective ~250.00 ms)",
        "       8x1 ZeRO 1: not searched: its objective at least 300.00 ms "
        "(the chosen's: 250.00 ms)",
        "       8x1 ZeRO 0: does not fit: needs at least 3.00 GiB",
        "       2x4 ZeRO 0: does not fit, bound 400.00 ms",
        "  (* chosen)",
    ]


def test_a_plan_from_autoshard_plan_prints_the_command_s_table() -> None:
    """``format_search`` of what ``autoshard.plan`` returns (no search result, no command
    times): the headline, the meshes tried and every layer, the totals its prediction's."""
    from autoshard.plan_text import format_search

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    example = (torch.randn(16, 32), torch.randn(16, 8))
    p = autoshard.plan(model, example, "cpu", num_devices=4, loss_fn=torch.nn.functional.mse_loss)
    lines = format_search(p.json, None, p).splitlines()
    pred = p.json["predicted"]
    assert lines[0].startswith(f"mesh {' x '.join(f'{k}({v})' for k, v in p.json['mesh'].items())}")
    assert lines[1].startswith(f"predicted step {pred['step_time_s'] * 1e3:.2f} ms"), lines
    assert lines[3] == f"search '{pred['search']}' {pred['search_s']:.2f} s", lines
    assert not any(line.startswith("capture ") for line in lines), lines
    total = next(line for line in lines if line.lstrip().startswith("total "))
    assert f"= step {pred['step_time_s'] * 1e3:.2f} ms, peak " in total, total
    assert any(line.startswith("  input args_0: ") for line in lines), lines


def test_train_reads_a_toml_config_and_names_what_is_wrong_in_it(tmp_path) -> None:
    from autoshard.cli.train import TrainConfig

    path = tmp_path / "run.toml"
    path.write_text('[train]\ntarget = "train_fn:make"\nsteps = 7\nzero = 2\nclip = 1.0\n')
    cfg = TrainConfig.from_toml(str(path))
    assert (cfg.target, cfg.steps, cfg.zero, cfg.clip, cfg.lr) == ("train_fn:make", 7, 2, 1.0, 1e-3)
    path.write_text('[train]\ntarget = "m:f"\nstep = 7\n')
    with pytest.raises(ValueError, match=r"run.toml: \[train\] has unknown keys \['step'\]"):
        TrainConfig.from_toml(str(path))
    path.write_text("[train]\nsteps = 7\n")
    with pytest.raises(ValueError, match=r"needs target = 'module:function'"):
        TrainConfig.from_toml(str(path))
    path.write_text("[train\n")
    with pytest.raises(ValueError, match="run.toml: not TOML"):
        TrainConfig.from_toml(str(path))


def test_train_names_pipeline_settings_it_cannot_take(tmp_path) -> None:
    from autoshard.cli.train import TrainConfig
    from autoshard.cli.train_check import check

    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    with pytest.raises(ValueError, match=r"its own pipeline and parallel settings; leave out --pp"):
        check(TrainConfig("m:f", plan=str(plan), pp=2))
    with pytest.raises(ValueError, match=r"leave out --tp, --sequence-parallel"):
        check(TrainConfig("m:f", plan=str(plan), tp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"schedule='pipedream': expected one of gpipe, 1f1b"):
        check(TrainConfig("m:f", schedule="pipedream"))
    with pytest.raises(ValueError, match=r"recompute='some': expected one of none, full"):
        check(TrainConfig("m:f", recompute="some"))


def test_train_names_a_target_that_gives_no_model(tmp_path, monkeypatch) -> None:
    from autoshard.cli.user_fn import parts_of, user_function

    (tmp_path / "broken_fn.py").write_text("def make():\n    return 3\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="broken_fn:make: return \\(model, data"):
        parts_of(user_function("broken_fn:make"), "broken_fn:make")
    with pytest.raises(ValueError, match="no nn.Module under 'model'"):
        parts_of({"model": 3, "batch": ()}, "x:y")
    with pytest.raises(ValueError, match="has no function 'nothing'"):
        user_function("broken_fn:nothing")


def test_plan_table_names_dims_and_its_layers_add_up_to_the_headline(tmp_path, capsys) -> None:
    """The table's per-layer rows (the block list once, with its count) add up to the
    headline's step time and peak memory, the chosen mesh's row shows the same time, and
    every op's layouts name their dims."""
    from autoshard.cli.main import main

    argv = ["plan", "--model", "gpt", "--layers", "6", "--hidden", "512", "--heads", "8"]
    picture = tmp_path / "plan.png"
    argv += ["--seq", "256", "--batch", "32", "--devices", "8", "--picture", str(picture)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert picture.read_bytes().startswith(b"\x89PNG")  # the same rows, drawn
    headline = re.search(r"predicted step ([\d.]+) ms, .* peak memory ([\d.]+ \w+) per", out)
    step, peak = headline.groups()
    assert re.search(rf"^\* +\S+ ZeRO \d: {step} ms,", out, re.M)  # the chosen mesh's row
    total = re.search(r"^  total .* = step ([\d.]+) ms, peak ([\d.]+ \w+)$", out, re.M)
    assert total.groups() == (step, peak)
    # the rows themselves, each block list counted by its blocks, add up to the headline
    table = out.split("  layer ", 1)[1].split("\n  total ", 1)[0].splitlines()[1:]
    rows = [re.fullmatch(r"  .+?\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) (\w+)", r) for r in table]
    assert rows and all(rows), table
    unit = {"KiB": 2**-10, "MiB": 1.0, "GiB": 2**10}
    time = sum(int(r[1]) * (float(r[2]) + float(r[3])) for r in rows)
    memory = sum(int(r[1]) * float(r[4]) * unit[r[5]] for r in rows)
    assert time == pytest.approx(float(step), abs=0.002 * len(rows) + 0.01), (time, step)
    value, scale = peak.split()
    assert memory == pytest.approx(float(value) * unit[scale], abs=0.01 * len(rows) * 6), memory
    block = re.search(r"^  layers\.\* +(\d+) ", out, re.M)
    assert block and block.group(1) == "6"  # two blocks captured, six priced, one row
    assert re.search(r"c_attn/linear\.0 +x\[b\S*, s, in\] weight\[out\S*, in\]", out)
    assert re.search(r"^  input idx: \[b\S*, s\S*\]$", out, re.M)


def test_plan_command_fixes_context_parallelism_and_its_attention(capsys) -> None:
    """``--cp`` puts a context-parallel axis of that size in every mesh searched (the inputs'
    sequence split over it); ``--attention`` fixes how attention computes over it."""
    from autoshard.cli.main import main

    argv = ["plan", "--model", "llama", "--seq", "4096", "--batch", "2", "--devices", "8"]
    for method in ("ring", "allgather"):
        assert main([*argv, "--cp", "2", "--attention", method]) == 0
        out = capsys.readouterr().out
        assert "cp(2)" in out.splitlines()[0], out.splitlines()[0]
        assert "sequence of input idx: split 2 ways over cp" in out
        assert f"attention over a split sequence: {method} (2 ops)" in out


def test_one_long_sequence_on_one_node_fits_by_context_parallelism_and_recompute(capsys) -> None:
    """Llama-3-8B's shape, one sequence of 131072 on 8 H100s: its activations outgrow a device
    without recompute, and a batch of one leaves a pipeline no micro-batches; the search
    finds one stage with recompute over the context-parallel split: selective, with ZeRO 3
    sharding the state over the 8 ranks to make room for it, faster than full recompute."""
    from autoshard.cli.main import main

    argv = ["plan", "--model", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32",
            "--kv-heads", "8", "--ffn", "14336", "--vocab", "128256", "--seq", "131072",
            "--batch", "1", "--nodes", "1", "--cp", "8"]  # fmt: skip
    steps = []
    for given in ([], ["--recompute", "full"]):
        assert main(argv + given) == 0
        out = capsys.readouterr().out
        head = out.splitlines()[0]
        assert head.startswith("pipeline: pp(1) x dp(1) x cp(8)"), head
        assert "recompute none" not in head, head
        peak = re.search(r"peak memory ([0-9.]+) GiB per device \(of 80.00 GiB\)", out)
        assert peak and float(peak.group(1)) <= 80, out.splitlines()[1]
        steps.append(float(re.search(r"predicted step ([0-9.]+) ms", out).group(1)))
        if not given:
            assert "recompute selective, ZeRO 3" in head, head
    assert steps[0] < steps[1], steps


def test_plan_command_unties_gpt_s_output_layer() -> None:
    """``--untie-embeddings`` gives GPT's lm_head its own weight (by default it is wte's)."""
    from autoshard.cli.args import build_parser
    from autoshard.cli.main import _reference_model

    argv = ["plan", "--model", "gpt", "--vocab", "4096", "--hidden", "256"]
    for extra, tied in (([], True), (["--untie-embeddings"], False)):
        commands = ("demo", "redistribute", "plan", "calibrate", "train", "simulate")
        parser = build_parser(dict.fromkeys(commands, print))
        model = _reference_model(parser.parse_args([*argv, *extra]))[0]
        assert (model.lm_head.weight is model.wte.weight) is tied
        count = sum(p.numel() for p in model.parameters())
        blocks = sum(p.numel() for p in model.layers.parameters())
        assert count - blocks - 128 * 256 - 2 * 256 == (1 if tied else 2) * 4096 * 256
