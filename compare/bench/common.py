"""What the GPU benchmarks (`bench kernels`, `bench ring`) share: their argument rules, the rows of earlier runs
(--rows-from), and where and how a result JSON is written (under out/, which git ignores, unless --out says;
atomically). A result worth keeping is copied into compare/results/ with its RUN.md."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

from weights import BadInputError
from weights.atomic import write_text_atomically

OUT_DIR = Path("out")  # relative to the working directory: the checkout's out/ (git-ignored), when run from its root


def check_parts_and_heads(args, choices: tuple[str, ...]) -> None:
    """The benchmarks' shared argument rules: `--parts` (comma list, may be empty) within `choices`, each
    `--kv-heads` value dividing `--heads`. Sets `args.parts` to the parsed tuple."""
    args.parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(args.parts) - set(choices)
    if unknown:
        raise BadInputError(f"--parts: unknown {', '.join(sorted(unknown))} (choices: {', '.join(choices)})")
    for kv in args.kv_heads:
        if kv < 1 or args.heads % kv:
            raise BadInputError(f"--kv-heads: {kv} does not divide --heads {args.heads}")


def previous_rows(paths: list[Path]) -> tuple[dict, list[dict]]:
    """(versions, rows) of earlier result JSONs (--rows-from), merged in order."""
    meta, rows = {}, []
    for path in paths:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise BadInputError(f"--rows-from {path}: {err}") from None
        meta.update(document.get("versions", {}))
        rows += document.get("rows", [])
    return meta, rows


def default_out_path(kind: str, meta: dict, today: datetime.date) -> Path:
    """out/<kind>-<date>-<gpu>.json."""
    gpu = meta.get("gpu", "unknown-gpu").lower().replace("nvidia", "").strip()
    return OUT_DIR / f"{kind}-{today.isoformat()}-{re.sub(r'[^a-z0-9]+', '-', gpu).strip('-')}.json"


def write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(document, indent=1) + "\n")
