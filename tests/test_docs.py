"""The project's Markdown reads on any screen (issue 36): no line of a Markdown file of the project (every *.md but
the measured results under compare/results/, which keep their logs' and tools' lines as written) is longer than
120 characters, and every relative link or image of README.md points at a file of the checkout."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINE = 120
RESULTS = Path("compare/results")
SKIPPED_DIRS = {".git", ".venv", "out", "node_modules", "__pycache__"}


def markdown_files(root: Path) -> list[Path]:
    """The checkout's Markdown files (tracked or new, not ignored; without git, a walk skipping virtual
    environments and outputs), relative to `root`, those under compare/results/ left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=root,
                                capture_output=True, text=True, check=True).stdout.split("\n")
        files = [Path(name) for name in listed if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(root) for p in root.rglob("*.md")
                 if not SKIPPED_DIRS & set(p.relative_to(root).parts)]
    return sorted(f for f in files if not f.is_relative_to(RESULTS) and (root / f).is_file())


def long_lines(text: str) -> list[tuple[int, int]]:
    """(line number, length) of every line over MAX_LINE characters."""
    return [(n, len(line)) for n, line in enumerate(text.splitlines(), 1) if len(line) > MAX_LINE]


def test_no_markdown_line_is_over_120_characters():
    files = markdown_files(ROOT)
    assert Path("README.md") in files and Path("compare/README.md") in files
    too_long = {str(f): long_lines((ROOT / f).read_text(encoding="utf-8")) for f in files}
    assert not {f: lines for f, lines in too_long.items() if lines}


def test_the_line_rule_sees_a_long_line_and_counts_characters_not_bytes():
    """The negative control: a line of 121 characters is named; one of 120 non-ASCII characters (more bytes) is not."""
    assert long_lines("ok\n" + "x" * 121 + "\nok") == [(2, 121)]
    assert long_lines("–" * 120) == []


def test_the_readmes_links_point_at_files_of_the_checkout():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert targets  # the report's screenshot at least
    assert [t for t in targets if not (ROOT / t).exists()] == []
