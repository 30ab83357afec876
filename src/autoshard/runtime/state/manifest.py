"""A checkpoint's manifest: written last, at commit, it lists every file of the checkpoint with
its size and CRC-32; a checkpoint whose files do not match it is not a checkpoint
(docs/checkpoints.md). :func:`latest` checks the sizes, :func:`verified` (what ``load`` calls)
the sums too, and every rank takes the same decision."""

from __future__ import annotations

import json
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from autoshard import comm

MANIFEST = "autoshard.json"
FORMAT = "autoshard-checkpoint/2"
#: formats still read; a checkpoint of format 1 lists no files, so it cannot be verified
READABLE = ("autoshard-checkpoint/1", FORMAT)
INCOMPLETE = ".incomplete"
_CHUNK = 2**20  # bytes read at a time when summing a file


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked (names the path and the cause)."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files are not what its manifest recorded: missing, of another
    size or with another checksum (names the checkpoint and the file)."""


def file_record(path: Path) -> dict[str, Any]:
    """A file's size and CRC-32, as the manifest records them."""
    return {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def _crc32(path: Path) -> str:
    # one buffer, read into again and again: checking a checkpoint as large as the model
    # must not add to the peak memory of the rank that loads it
    crc, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def latest(directory: str | os.PathLike, *, skip: Any = ()) -> Path | None:
    """The newest whole checkpoint in ``directory`` (by its step, then its time), or None:
    its manifest is readable and every file it lists is there at its recorded size (a cheap
    check; :func:`load` checks the sums). Newer checkpoints passed over are named in a
    warning, once per run; ``skip``: checkpoints not to take (ones that failed to load)."""
    found = []
    for entry in Path(directory).iterdir() if Path(directory).is_dir() else []:
        if entry.name.endswith((INCOMPLETE, ".old")) or not (entry / MANIFEST).exists():
            continue
        try:
            manifest = read_manifest(entry)
            step = manifest.get("step")
        except CheckpointError as err:
            manifest, step = None, str(err)
        when = (entry / MANIFEST).stat().st_mtime
        found.append((step if isinstance(step, int) else -1, when, entry, manifest))
    passed = []
    for _, _, entry, manifest in sorted(found, key=lambda f: f[:2], reverse=True):
        if entry in {Path(p) for p in skip}:
            continue
        problem = cut_short(entry, manifest) if manifest else "its manifest cannot be read"
        if problem is None:
            _warn_passed(passed, entry)
            return entry
        passed.append(f"{entry} ({problem})")
    _warn_passed(passed, None)
    return None


def damaged(directory: str | os.PathLike) -> tuple[bool, list[str]]:
    """Whether ``directory`` holds a checkpoint that :func:`latest` would take, and each
    checkpoint that it would pass over, named with why (a manifest that cannot be read, a
    file missing or of another size)."""
    whole, problems = False, []
    root = Path(directory)
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name.endswith((INCOMPLETE, ".old")) or not (entry / MANIFEST).exists():
            continue
        try:
            problem = cut_short(entry, read_manifest(entry))
        except CheckpointError as err:
            problem = " ".join(str(err).removeprefix(f"{entry}: ").split())
        whole = whole or problem is None
        if problem is not None:
            problems.append(f"{entry} ({problem})")
    return whole, problems


_warned: set[str] = set()


def _warn_passed(passed: list[str], taken: Path | None) -> None:
    if not passed or _rank_env() != 0:
        return
    text = f"autoshard: passed over damaged checkpoint(s) {'; '.join(passed)}; " + (
        f"taking {taken}" if taken else "no whole checkpoint left"
    )
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, UserWarning, stacklevel=3)


def _rank_env() -> int:
    return _rank() if _distributed() else int(os.environ.get("RANK", "0"))


def cut_short(path: Path, manifest: dict[str, Any]) -> str | None:
    """What is missing or of the wrong size among the files ``manifest`` lists, or None."""
    files = manifest.get("files", {".metadata": None})  # format 1 lists none
    for name, record in files.items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if record is not None and size != record["bytes"]:
            return f"{name} is {size} bytes, the manifest recorded {record['bytes']}"
    return None


def read_manifest(path: Path) -> dict[str, Any]:
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path} is not a complete autoshard checkpoint (no {MANIFEST})")
    try:
        saved = json.loads(manifest.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointDamaged(f"{path}: its {MANIFEST} cannot be read ({err})") from None
    if not isinstance(saved, dict) or saved.get("format") not in READABLE:
        found = saved.get("format") if isinstance(saved, dict) else saved
        raise CheckpointError(f"{path}: format {found!r}, expected {FORMAT!r}")
    return saved


def verified(path: Path, checksums: bool) -> dict[str, Any]:
    """The manifest of ``path`` once every rank found its files whole (a collective); the
    same error on every rank otherwise, and when ranks were given different paths."""
    try:
        saved, problem = read_manifest(path), None
    except CheckpointError as err:
        saved, problem = None, err
    if saved is not None:
        cut = cut_short(path, saved)
        if cut is None and checksums:
            cut = _bad_sum(path, saved.get("files", {}))
        if cut is not None:
            problem = CheckpointDamaged(f"checkpoint {path} is damaged: {cut}")
    mine = (str(path), None if problem is None else (type(problem).__name__, str(problem)))
    everyone = comm.all_gather_object(mine) if _distributed() else [mine]
    if len({p for p, _ in everyone}) > 1:
        paths = ", ".join(f"rank {r}: {p}" for r, (p, _) in enumerate(everyone))
        raise CheckpointError(f"the ranks were asked to load different checkpoints ({paths})")
    for _, found in everyone:
        if found is not None:
            kind, text = found
            raise (CheckpointDamaged if kind == "CheckpointDamaged" else CheckpointError)(text)
    assert saved is not None
    return saved


def _bad_sum(path: Path, files: dict[str, Any]) -> str | None:
    """The first of this rank's share of ``files`` whose CRC-32 is not the recorded one."""
    world = dist.get_world_size() if _distributed() else 1
    for i, (name, record) in enumerate(sorted(files.items())):
        if i % world == _rank() and _crc32(path / name) != record["crc32"]:
            return f"{name} does not have the checksum the manifest recorded (its bytes changed)"
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


__all__ = [
    "FORMAT",
    "INCOMPLETE",
    "MANIFEST",
    "CheckpointDamaged",
    "CheckpointError",
    "file_record",
    "latest",
    "read_manifest",
    "verified",
]
