"""The documentation stays true to the code: docs/api.md names every public name and shows each
signature as the code has it, every relative link in README.md and docs/ resolves, and the
README's ``autoshard plan`` examples of reference models print what it shows.

When a signature changes, ``python docs/make_api.py`` prints the page's new blocks.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import autoshard

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api.md"
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SIGNATURE_BLOCK = re.compile(r"(autoshard(?:\.\w+)+)(\(.*)", re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def public_names() -> list[str]:
    """``autoshard.X`` for X in ``autoshard.__all__``, and ``autoshard.data.X`` likewise."""
    names = [f"autoshard.{n}" for n in autoshard.__all__]
    return names + [f"autoshard.data.{n}" for n in autoshard.data.__all__]


def code_signature(dotted: str) -> str | None:
    """``str(inspect.signature(obj))`` of a dotted name, a method's without ``self``; None for
    an object without one (a constant, a module, an exception class)."""
    parts = dotted.split(".")
    parent: Any = None
    obj: Any = autoshard
    for part in parts[1:]:
        parent, obj = obj, getattr(obj, part)
    if not callable(obj):
        return None
    try:
        sig = inspect.signature(obj)
    except ValueError:
        return None
    if inspect.isclass(parent) and inspect.isfunction(inspect.getattr_static(parent, parts[-1])):
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return str(sig)


def unwrap(block: str) -> str:
    """A signature shown one parameter per line, as one line."""
    text = re.sub(r",\n\)", ")", block.strip())
    text = re.sub(r"\(\n\s+", "(", text)
    return re.sub(r",\n\s+", ", ", text)


def api_page() -> tuple[set[str], dict[str, str]]:
    """The names in docs/api.md's headings, and each signature block's name -> signature."""
    text = API.read_text()
    headings = set(re.findall(r"^#{2,4} `([\w.]+)`", text, re.MULTILINE))
    blocks: dict[str, str] = {}
    for body in FENCE.findall(text):
        match = SIGNATURE_BLOCK.fullmatch(unwrap(body))
        if match:
            assert match[1] not in blocks, f"docs/api.md shows {match[1]} twice"
            blocks[match[1]] = match[2]
    return headings, blocks


def test_every_public_name_has_a_heading_in_the_api_page() -> None:
    headings, _ = api_page()
    missing = [name for name in public_names() if name not in headings]
    assert not missing, f"docs/api.md has no heading for {missing}"
    unknown = [h for h in headings if h.startswith("autoshard.") and h not in public_names()]
    assert not unknown, f"docs/api.md has headings for names that are not public: {unknown}"


def test_every_signature_on_the_api_page_is_the_codes() -> None:
    _, blocks = api_page()
    assert len(blocks) > 60  # functions, classes and their methods
    stale = {
        name: (shown, code_signature(name))
        for name, shown in blocks.items()
        if shown != code_signature(name)
    }
    assert not stale, "docs/api.md differs from the code (python docs/make_api.py):\n" + "\n".join(
        f"{name}\n  page: {shown}\n  code: {code}" for name, (shown, code) in stale.items()
    )
    unshown = [n for n in public_names() if code_signature(n) is not None and n not in blocks]
    assert not unshown, f"docs/api.md shows no signature for {unshown}"


def test_the_generator_prints_what_the_page_shows() -> None:
    spec = importlib.util.spec_from_file_location("make_api", ROOT / "docs" / "make_api.py")
    assert spec is not None and spec.loader is not None
    make_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_api)
    assert make_api.missing() == []
    text = API.read_text()
    names = [name for _, names in make_api.SECTIONS for name in names]
    for name in names:
        block = make_api.signature_block(name)
        if block is not None:
            assert f"```python\n{block}\n```" in text, f"docs/api.md: autoshard.{name}"
    # the page keeps the generator's order: each name's heading or signature block
    places = []
    for name in names:
        found = re.search(rf"^(### `)?autoshard\.{re.escape(name)}[`(]", text, re.MULTILINE)
        assert found, f"docs/api.md: autoshard.{name}"
        places.append(found.start())
    assert places == sorted(places)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_relative_links_in_readme_and_docs_resolve() -> None:
    checked = 0
    broken = []
    for path in markdown_files():
        text = FENCE.sub("", path.read_text())
        text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:|#", target):  # a URL, or an anchor on the page
                continue
            checked += 1
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files: {broken}"
    assert checked > 20  # the parallelism pages, the index, the API page and the README


def readme_plan_examples() -> list[tuple[list[str], list[str]]]:
    """Each README block that runs ``autoshard plan --model`` (a reference model: no file of the
    user's needed): its arguments and the lines it shows."""
    examples = []
    for block in FENCE.findall((ROOT / "README.md").read_text()):
        if not block.startswith("$ autoshard plan --model "):
            continue
        lines = block.splitlines()
        command = lines.pop(0)
        while command.endswith("\\"):
            command = command[:-1] + " " + lines.pop(0).strip()
        args = shlex.split(command)[2:]
        if "--picture" in args:  # the picture is not the text checked, and slow to draw
            i = args.index("--picture")
            del args[i : i + 2]
        examples.append((args, lines))
    return examples


def test_the_readme_plan_examples_print_what_it_shows(tmp_path: Path) -> None:
    """A shown line is a printed line; one ending in "..." begins a printed line; "..." alone
    stands for lines left out."""
    examples = readme_plan_examples()
    assert examples, "the README shows no autoshard plan --model example"
    for args, shown in examples:
        run = subprocess.run(
            [sys.executable, "-m", "autoshard.cli", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        printed = [line.rstrip() for line in run.stdout.splitlines()]
        for line in shown:
            if line.strip() == "...":
                continue
            if line.endswith("..."):
                start = line[:-3].rstrip()
                assert any(p.startswith(start) for p in printed), (args, line)
            else:
                assert line.rstrip() in printed, (args, line)
