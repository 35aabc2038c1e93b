"""What the GPU benchmarks share: their argument rules and the rows of earlier runs (--rows-from; `bench kernels`,
`bench ring`), the config sweeps' --select (`pallas_sweep`, `gluon_sweep`), where and how a result JSON is written
(under out/, which git ignores, unless --out says; atomically), and how a benchmark whose rows are held against ours
ends (`finish_rows`; `bench hf`, `bench train-peer`). A result worth keeping is copied into compare/results/ with its
RUN.md."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

from compare.args import recorded_command
from weights import BadInputError
from weights.atomic import write_text_atomically

BUDGET_SPENT = "skipped: --budget-s spent"  # the error of a sweep's candidates that its point's budget left out
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


def config_field_value(config_class: type, text: str) -> tuple[str, object]:
    """FIELD=VALUE of a sweep's --select: a field of the dataclass `config_class` and a value of its type (true/false,
    an integer, a name; "none" for a field whose default is None). Raises argparse.ArgumentTypeError naming the
    cause."""
    field, _, value = text.partition("=")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    if field not in fields or not value:
        raise argparse.ArgumentTypeError(f"{text!r} is not FIELD=VALUE with FIELD one of {', '.join(fields)}")
    default = getattr(config_class(), field)
    if isinstance(default, bool):
        if value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{field} takes true or false, got {value!r}")
        return field, value.lower() == "true"
    if default is None and value.lower() == "none":
        return field, None
    if isinstance(default, int) or default is None:
        try:
            return field, int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{field} takes an integer, got {value!r}") from None
    return field, value


def selected_candidates(space, select: list[tuple[str, object]]) -> tuple:
    """A sweep's candidates (a sequence, the default first) under --select: the default and those of the rest with
    every field value."""
    return tuple(space[:1]) + tuple(config for config in space[1:]
                             if all(getattr(config, field) == value for field, value in select))


def point_deadline(budget_s: float | None) -> float:
    """When a sweep's point (`--budget-s` seconds from now; None: no limit) starts no more candidates, in
    time.monotonic() seconds; the candidates not started are rows with the error BUDGET_SPENT."""
    return time.monotonic() + (budget_s if budget_s is not None else math.inf)


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


def finish_rows(name: str, argv: list[str], meta: dict, rows: list[dict], failures: list[str], tolerance: float,
                render: Callable[[list[dict]], str], out: Path | None, **fields) -> int:
    """The end of a benchmark whose rows are held against ours (`bench hf`, `bench train-peer`; rows as
    `compare.harness.hf_rows.compare_rows` leaves them): a row that disagrees beyond `tolerance` becomes the first
    failure; the JSON (`out`, default out/<name>-<date>-<gpu>.json: the command, date, versions, `fields`, rows,
    failure) is written and the table printed; exit code 1 on any failure, else 0."""
    disagreeing = [row["model"] for row in rows if row.get("agrees") is False]
    if disagreeing:
        failures = [f"{', '.join(disagreeing)}: loss or gradient norm beyond {tolerance:.0e} (relative) of ours",
                    *failures]
    failure = "; ".join(failures) or None
    path = out or default_out_path(name, meta, datetime.date.today())
    write_json(path, {"command": recorded_command(["twinflash", "bench", name, *argv]),
                      "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": meta, **fields,
                      "rows": rows, "failure": failure})
    if rows:
        print(render(rows))
    print(f"[{name} bench] wrote {path}" + (f"; {failure}" if failure else ""))
    return 1 if failure else 0
