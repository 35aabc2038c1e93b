"""The project's house rules that code review keeps forgetting, checked on the source text (CPU, no imports of the
code under test): no absolute path of a development machine in any tracked file, no import cycle among the
project's modules, no private name imported from another module of the library, a docstring at the top of every
module. Each check has a negative control, so that it cannot pass by finding nothing.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("weights", "torch_impl", "jax_impl", "compare")

# A path that only exists on one machine: a root folder of home directories, scratch space, mounts or installed
# software, not preceded by a word character, a dot or `$`/`<` (so URLs, `$OUT/...`, `<site-packages>/...` and
# relative paths such as `compare/results/...` pass). The folder names are spelled in pieces so that this file
# does not match itself.
_MACHINE_ROOTS = ("wo" + "rk", "ho" + "me", "ro" + "ot", "tm" + "p", "Us" + "ers", "mn" + "t", "scr" + "atch",
                  "op" + "t", "va" + "r", "priv" + "ate")
MACHINE_PATH = re.compile(r"(?<![\w.$<>~-])/(?:" + "|".join(_MACHINE_ROOTS) + r")/[\w.+-]")


def _tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def _library_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def machine_paths(text: str) -> list[str]:
    return [match.group(0) for match in MACHINE_PATH.finditer(text)]


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (function-level imports count: a cycle through a
    deferred import is still a cycle), resolved to modules where `from package import module` names one."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def private_imports(source: str) -> list[str]:
    """`from x import _name` in `source` (dunder names and __future__ aside)."""
    return [alias.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module != "__future__"
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


# ---------------------------------------------------------------------------------------------------------------

def test_no_machine_path_in_any_tracked_file():
    offenders = []
    for path in _tracked_files():
        data = path.read_bytes()
        if b"\0" in data:  # binary (the report's PNGs)
            continue
        offenders += [f"{path.relative_to(ROOT)}: {hit}" for hit in machine_paths(data.decode("utf-8", "replace"))]
    assert not offenders, "machine paths (write them project-relative):\n" + "\n".join(offenders[:20])


def test_machine_path_rule_catches_machine_paths_and_passes_project_relative_ones():
    home, scratch = "/" + "home" + "/alice/llama/config.json", "--out /" + "tm" + "p/x"
    assert machine_paths(f"loaded {home}") == [home[:7]]
    assert machine_paths(scratch) and machine_paths("/" + "ro" + "ot/out/ring.json")
    for fine in ("compare/results/ring.json", "$OUT/ring.json", "<site-packages>/jax/_src/array.py",
                 "https://example.org/home/page", "out/compare-tiny", "./train.py", "/dev/null"):
        assert not machine_paths(fine), fine


def test_no_import_cycle_among_the_project_modules():
    modules = _library_modules()
    graph = {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 50  # the resolver sees the imports at all
    assert graph["compare.cli"] >= {"compare.args", "compare.commands.train"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_private_name_imported_across_library_modules():
    found = {(str(path.relative_to(ROOT)), name) for path in _library_modules().values()
             for name in private_imports(path.read_text())}
    assert found == set()
    assert private_imports("from a.b import _x, y, __version__\nfrom __future__ import annotations") == ["_x"]


@pytest.mark.parametrize("package", [*PACKAGES, "tests"])
def test_every_module_opens_with_a_docstring(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    missing = [str(path.relative_to(ROOT)) for path in files if ast.get_docstring(ast.parse(path.read_text())) is None]
    assert not missing
    assert ast.get_docstring(ast.parse("import os\n'''not a docstring'''")) is None
