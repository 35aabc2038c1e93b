"""The project's layers and their one-way arrows, checked on the source text (CPU, quick, no imports of the code
under test but one table): the backends never import compare/; weights/ imports no backend nor any framework;
inside compare/ the harness never imports the report, the commands, the CLI or the benches, the report reads only
the harness (and the leaf `compare.args`), the benches never import the report or the commands, only the CLI
imports the commands; no project module is reached by a string (`importlib.import_module`, `runpy`, `__import__`,
`-m "dotted.name"`); every module stays under `MAX_LINES`; compare/results/ holds data, no scripts. Each rule has a
negative control, so that it cannot pass by finding nothing. compare/__init__.py's docstring draws the arrows.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("weights", "torch_impl", "jax_impl", "compare")
MAX_LINES = 500
SCRIPT_SUFFIXES = (".py", ".sh", ".ipynb")

# (the modules a rule holds for, the names they must not import, why): a module or name matches a prefix when it
# is that name or a dotted name under it.
FORBIDDEN = (
    (("torch_impl", "jax_impl"), ("compare",), "the backends never import compare/"),
    (("weights",), ("torch_impl", "jax_impl", "torch", "jax", "jaxlib", "flax", "triton", "compare"),
     "weights/ is framework-neutral ground: no backend, no framework, not compare/"),
    (("compare.harness",), ("compare.report", "compare.commands", "compare.cli", "compare.bench"),
     "the harness makes the data; the commands ask it and the report writes it"),
    (("compare.bench",), ("compare.report", "compare.commands", "compare.cli"),
     "the benches sit below the commands and beside the report"),
    (("compare.args",), ("compare",), "compare.args is the leaf every layer imports"),
    (("compare.launch", "compare.nodes"), ("compare.harness", "compare.report", "compare.commands", "compare.cli",
                                           "compare.bench"), "the process plumbing sits below every layer"),
)
# What the report may import from compare/: the harness's data types, itself and the leaf compare.args.
REPORT_READS = ("compare.harness", "compare.report", "compare.args")


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _project_modules() -> dict[str, str]:
    """Dotted module name -> source, for every module of the project's packages (a package as its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path.read_text()
    return modules


def imported_names(name: str, source: str, is_package: bool = False) -> set[str]:
    """Every dotted name `name` imports anywhere in `source` (function-level imports count), relative imports
    resolved: `import a.b` gives a.b, `from a import b` gives a.b."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                anchor = parts[: len(parts) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def layering_violations(modules: dict[str, str], packages: set[str] = frozenset()) -> list[str]:
    """'importer -> imported: why' for every import that breaks an arrow; `packages`: the names that are packages
    (their relative imports anchor on themselves)."""
    violations = []
    for name, source in modules.items():
        imports = imported_names(name, source, name in packages)
        for holders, forbidden, why in FORBIDDEN:
            if any(_under(name, holder) for holder in holders):
                violations += [f"{name} -> {imported}: {why}" for imported in sorted(imports)
                               if any(_under(imported, bad) for bad in forbidden) and not _under(imported, name)]
        if _under(name, "compare.report"):
            violations += [f"{name} -> {imported}: the report reads the harness's data only" for imported in
                           sorted(imports) if _under(imported, "compare")
                           and not any(_under(imported, allowed) for allowed in REPORT_READS)]
        if name != "compare.cli" and not _under(name, "compare.commands"):
            violations += [f"{name} -> {imported}: only compare.cli imports the commands" for imported in
                           sorted(imports) if _under(imported, "compare.commands")]
        if _under(name, "compare.commands"):
            violations += [f"{name} -> {imported}: a command imports no other command" for imported in
                           sorted(imports) if _under(imported, "compare.commands") and imported != "compare.commands"]
    return violations


def reaches_by_string(source: str, project_modules: set[str]) -> list[str]:
    """The places in `source` that reach a module by a string: importlib.import_module / __import__ / runpy, and
    any string constant that names a project module (a `python -m` command line, say); a name's module object
    (`module.__name__`, `__spec__.name`) is the way."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__", "run_module", "run_path"):
                found.append(f"line {node.lineno}: {called}(...)")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [alias.name for alias in node.names]
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if "runpy" in names or module == "runpy" or (module == "importlib" and "import_module" in names):
                found.append(f"line {node.lineno}: imports {module or ', '.join(names)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in project_modules:  # a package's bare name is also a word ("compare", "weights")
            found.append(f"line {node.lineno}: the string {node.value!r}")
    return found


def oversized(line_counts: dict[str, int]) -> list[str]:
    return [f"{path}: {count} lines" for path, count in sorted(line_counts.items()) if count > MAX_LINES]


def scripts(paths: list[str]) -> list[str]:
    return [path for path in paths if path.endswith(SCRIPT_SUFFIXES)]


# ---------------------------------------------------------------------------------------------------------------

def test_the_layers_import_one_way():
    modules = _project_modules()
    packages = {name for name in modules if (ROOT / name.replace(".", "/") / "__init__.py").exists()}
    assert sum(len(imported_names(n, s, n in packages)) for n, s in modules.items()) > 300  # the parser sees them
    assert "compare.commands.compare" in modules and "compare.report.data" in modules
    assert layering_violations(modules, packages) == []


@pytest.mark.parametrize("module, source", [
    ("torch_impl.model", "from compare.cli import main"),
    ("jax_impl.train", "def f():\n    import compare.harness.jobs"),
    ("weights.flops", "import torch"),
    ("weights.data", "from jax import numpy"),
    ("weights.layout", "from triton import language"),
    ("weights.config", "from torch_impl.model import Llama"),
    ("weights.training", "from compare import args"),
    ("compare.harness.jobs", "from compare.report.data import report_dict"),
    ("compare.harness.plan", "from ..commands import train"),
    ("compare.harness.plan", "from compare import cli"),
    ("compare.harness.launches", "from compare.bench import common"),
    ("compare.report.data", "from compare.bench.common import write_json"),
    ("compare.report.render", "from compare.launch import owned_process"),
    ("compare.bench.ring_bench", "from compare.report.write import load_peers"),
    ("compare.bench.kernel_bench", "from compare.commands import bench"),
    ("compare.nodes", "from compare.commands.train import run_command"),
    ("compare.commands.check", "from compare.commands import train"),
    ("compare.args", "from compare.launch import Interrupted"),
    ("compare.launch", "from compare.harness import jobs"),
    ("compare.nodes", "from compare.bench.common import write_json"),
])
def test_each_arrow_rule_flags_a_wrong_import(module, source):
    assert layering_violations({module: source}), f"{module}: {source!r} passed"


def test_the_arrows_let_the_right_imports_through():
    allowed = {"compare.report.data": "from compare.harness import jobs as J\nfrom compare.args import names\n"
                                      "from weights import LlamaConfig\nfrom . import fields",
               "compare.cli": "from compare.commands import bench, train",
               "compare.commands.compare": "from compare.report.write import write_report\n"
                                           "from compare.harness.launches import run_jobs",
               "compare.bench.ring_bench_workers": "from compare.harness.jobs import union_seconds",
               "weights.flops": "import numpy as np\nfrom weights.config import LlamaConfig",
               "torch_impl.model": "import torch\nfrom weights import LlamaConfig"}
    assert layering_violations(allowed, {"compare.report"}) == []


def test_no_project_module_is_reached_by_a_string():
    modules = _project_modules()
    found = {name: hits for name, source in modules.items() if (hits := reaches_by_string(source, set(modules)))}
    assert found == {}


@pytest.mark.parametrize("source", [
    "import importlib\nimportlib.import_module('compare.commands.train')",
    "from importlib import import_module",
    "import runpy",
    "__import__('weights')",
    "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'compare.harness.worker_torch'])",
    "TRAIN_MODULE = 'compare.commands.train'",
    "reached = f'{backend}_impl.checkpointing'\nimportlib.import_module(reached)",
])
def test_the_string_rule_flags_a_reach_by_string(source):
    assert reaches_by_string(source, {"compare.commands.train", "compare.harness.worker_torch", "weights.data"})


def test_the_string_rule_passes_module_objects_and_other_strings():
    fine = ("import importlib.util\nimportlib.util.find_spec('torch')\n"
            "from compare.harness import worker_torch\ncommand = ['-m', worker_torch.__name__, '-m', __spec__.name]\n"
            "other = ['-m', 'torch.distributed.run', 'weights.json', 'python -m compare.cli train']")
    assert reaches_by_string(fine, {"compare.harness.worker_torch", "compare.cli", "weights"}) == []


def test_every_module_stays_under_the_size_limit():
    counts = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
              for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    assert len(counts) > 50
    assert oversized(counts) == [], f"modules over {MAX_LINES} lines: split them"
    assert oversized({"a.py": MAX_LINES, "b.py": MAX_LINES + 1}) == ["b.py: 501 lines"]


def test_results_hold_data_not_scripts():
    listed = subprocess.run(["git", "ls-files", "compare/results"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    assert len(listed) > 100  # the results are tracked, and seen
    assert scripts(listed) == [], "a script that made a result: a maintained tool under compare/bench/, or removed"
    assert scripts(["compare/results/x/call.sh", "compare/results/a.py", "compare/results/n.ipynb",
                    "compare/results/x/RUN.md", "compare/results/x/rows.json"]) == [
        "compare/results/x/call.sh", "compare/results/a.py", "compare/results/n.ipynb"]


def test_the_harness_roles_name_attention_backends_the_backends_define():
    from compare.harness.plan import KERNELS
    from weights.training import ATTENTION_BACKENDS, BACKENDS

    assert tuple(KERNELS) == BACKENDS
    assert all(set(roles.values()) <= set(ATTENTION_BACKENDS[backend]) for backend, roles in KERNELS.items())
    assert all(roles["ours"] == ATTENTION_BACKENDS[backend][0] for backend, roles in KERNELS.items())  # ours first
