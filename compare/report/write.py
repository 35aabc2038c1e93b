"""Writing `twinflash compare`'s report: out_dir/report.json, report.md, report.html and plots/*.png from the dict
that compare/commands/compare.py builds (format "twinflash-compare/1", each key described in
compare/report/schema.json). Owns the schema check (`validate_report`) and the peers' numbers (`load_peers`:
compare/report/peers.json with its provenance, measured on H200 with the anchor scripts that the RUN.md of
compare/results/anchors-2026-11-21-h200x4/ names, beside their raw results); the renderings are
compare/report/render.py's, the plots compare/report/plots.py's.

`rerender(out_dir)` writes report.md and report.html again from out_dir/report.json (a report made by an older
renderer, read with today's: no plot or work file of the run is needed, and report.json and the plots stay as they
are).

`write_report(report, out_dir)` validates first and writes nothing for an invalid report (ValueError, one line
naming the first violation's path); otherwise each file goes to a temporary name in out_dir and is renamed into
place once all are rendered (`weights.atomic.atomic_file`). report.json's "plots" lists the PNGs written (a plot
without data is left out, not drawn empty); a "plots" list in the input is replaced.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings
from pathlib import Path
from typing import Any

from compare.report import plots
from compare.report.render import render_html, render_markdown
from weights.atomic import atomic_file

SCHEMA_PATH = Path(__file__).with_name("schema.json")
PEERS_PATH = Path(__file__).with_name("peers.json")
PEERS_CITATION = "compare/report/peers.json"  # PEERS_PATH as the project names it (a report cites it so)


@functools.cache
def _schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def validate_report(report: dict) -> None:
    """Raises ValueError (one line: the path of the first violation and what is wrong) unless `report` matches
    compare/report/schema.json. Needs jsonschema (a dependency of twinflash; a machine with only the backends'
    own packages, such as a GPU image, skips the check with a warning)."""
    try:
        import jsonschema
    except ModuleNotFoundError:
        warnings.warn("jsonschema is not installed: report.json was not checked against its schema", stacklevel=2)
        return
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(_schema()).iter_errors(report))
    if error is not None:
        path = "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ValueError(f"invalid compare report at {path}: {' '.join(error.message.split())[:300]}")


def load_peers() -> list[dict]:
    """The peers' measurements of compare/report/peers.json: [{work, peer, value, unit, source, machine,
    command}], `source` citing the file, the raw results and the machine."""
    kept = json.loads(PEERS_PATH.read_text(encoding="utf-8"))
    return [{"work": p["work"], "peer": p["peer"], "value": p["value"], "unit": p["unit"],
             "source": (f"{PEERS_CITATION} ({p['setup']}; raw: {kept['raw']}, key {p['raw_key']}; measured "
                        f"{kept['measured']} on {kept['machine']})"),
             "machine": kept["machine"], "command": f"{p['command']} (in {kept['scripts']})"}
            for p in kept["peers"]]


def _numpy_scalar(value: Any) -> Any:
    """json.dumps' fallback: numpy scalars (the schema takes them as numbers) as Python numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _renderings(data: dict) -> dict[str, str]:
    return {"report.md": render_markdown(data), "report.html": render_html(data)}


def write_report(report: dict, out_dir: Path) -> None:
    """Checks `report` (ValueError, nothing written) and writes out_dir/report.json ("plots" filled in),
    report.md, report.html and out_dir/plots/*.png; each file is renamed into place once all are rendered."""
    data = {**report, "plots": []} if isinstance(report, dict) else report
    validate_report(data)
    out_dir = Path(out_dir)
    figures = plots.figures(data)
    data["plots"] = [f"plots/{name}.png" for name, _ in figures]
    texts = {"report.json": json.dumps(data, indent=1, default=_numpy_scalar) + "\n", **_renderings(data)}
    (out_dir / "plots" if figures else out_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as staged:  # every file renamed into place only once all are written
        for name, fig in figures:
            fig.savefig(staged.enter_context(atomic_file(out_dir / "plots" / f"{name}.png", "wb")), format="png")
        for name, text in texts.items():
            staged.enter_context(atomic_file(out_dir / name)).write(text)


def rerender(out_dir: Path) -> None:
    """Writes out_dir/report.md and report.html again from out_dir/report.json (checked against the schema first;
    ValueError and nothing written for an invalid one), leaving report.json and the plots as they are."""
    out_dir = Path(out_dir)
    data = json.loads((out_dir / "report.json").read_text(encoding="utf-8"))
    validate_report(data)
    texts = _renderings(data)
    with contextlib.ExitStack() as staged:
        for name, text in texts.items():
            staged.enter_context(atomic_file(out_dir / name)).write(text)
