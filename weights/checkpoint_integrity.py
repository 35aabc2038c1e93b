"""The integrity rules of training checkpoints, the same for both backends (framework-neutral, stdlib only): the
manifest each checkpoint directory carries, its verification, and which checkpoint a resume may read.

A checkpoint directory (torch: step-XXXXXXXX, orbax: step_XXXXXXXX) is valid only with MANIFEST, written last
(after every other file of the checkpoint is complete): {"format", "meta" (the run metadata and step the
checkpoint records, `weights.training.run_metadata`), "files": {relative path: {"bytes", "sha256"}}}. A missing
manifest means an incomplete checkpoint; a file whose size or SHA-256 differs means a corrupt one. The manifest's
"backend" lets a run recognise the other backend's checkpoints in its --ckpt-dir, whose directory names it does not
list. Checkpoints that a resume passes over are set aside (renamed to invalid-<name>, kept for inspection, never
listed again), so that the resumed run can write its own steps under those names.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from weights.atomic import atomic_file

MANIFEST = "twinflash-manifest.json"
MANIFEST_FORMAT = "twinflash-manifest/1"
SET_ASIDE_PREFIX = "invalid-"
_READ_BYTES = 1 << 24


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_READ_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[Path]:
    """Every file under `directory` but the manifest, sorted, as paths relative to it."""
    return sorted(p.relative_to(directory) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, meta: dict[str, Any]) -> None:
    """Seals the complete checkpoint in `directory`: the size and SHA-256 of every file in it, with `meta`,
    written atomically and flushed to disk (the last file of a checkpoint)."""
    directory = Path(directory)
    files = {str(rel): {"bytes": (directory / rel).stat().st_size, "sha256": file_sha256(directory / rel)}
             for rel in _checkpoint_files(directory)}
    with atomic_file(directory / MANIFEST) as handle:
        handle.write(json.dumps({"format": MANIFEST_FORMAT, "meta": meta, "files": files}, indent=1) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of `directory`, or None where it is missing or unreadable."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT else None


def checkpoint_problem(directory: Path, *, checksums: bool = True) -> str | None:
    """Why checkpoint `directory` cannot be resumed from (incomplete or corrupt), or None when every file the
    manifest lists is there with its size and (with `checksums`) its checksum. Without `checksums` only sizes are
    compared: for a process whose launcher has just verified the same checkpoint (hashing an 8B checkpoint with its
    optimizer state reads ~100 GB)."""
    manifest = read_manifest(directory)
    if manifest is None or not manifest.get("files"):
        return f"incomplete (no readable {MANIFEST})"
    for rel, expected in sorted(manifest["files"].items()):
        path = Path(directory) / rel
        if not path.is_file():
            return f"incomplete ({rel} is missing)"
        if path.stat().st_size != expected["bytes"] or (checksums and file_sha256(path) != expected["sha256"]):
            return f"corrupt ({rel} does not match its checksum)"
    return None


def backends_in(ckpt_dir: Path) -> dict[str, list[str]]:
    """{backend: [checkpoint directory names]} of the sealed checkpoints directly in `ckpt_dir`."""
    found: dict[str, list[str]] = {}
    if not Path(ckpt_dir).is_dir():
        return found
    for child in sorted(Path(ckpt_dir).iterdir()):
        manifest = read_manifest(child) if child.is_dir() and not child.name.startswith(SET_ASIDE_PREFIX) else None
        if manifest is not None:
            found.setdefault(str(manifest.get("meta", {}).get("backend")), []).append(child.name)
    return found


def newest_valid(candidates: list[Path], *, checksums: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest valid checkpoint of `candidates` (oldest first), or None; the newer ones passed over, newest
    first, with why); `checksums` as in `checkpoint_problem`."""
    passed_over = []
    for path in reversed(candidates):
        problem = checkpoint_problem(path, checksums=checksums)
        if problem is None:
            return path, passed_over
        passed_over.append((path, problem))
    return None, passed_over


def set_aside(paths: list[Path]) -> None:
    """Renames each checkpoint directory to invalid-<name> beside it (replacing an earlier one of that name)."""
    for path in paths:
        target = path.parent / f"{SET_ASIDE_PREFIX}{path.name}"
        if target.exists():
            shutil.rmtree(target)
        os.replace(path, target)
