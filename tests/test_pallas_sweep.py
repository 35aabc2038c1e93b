"""`python -m compare.bench.pallas_sweep` on CPU: its --select (which Hopper candidates a sweep times) and its bad
input, one line and exit 2 (the sweep itself times compiled kernels on a GPU: its rows are results, not tests)."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest

from compare.bench.pallas_sweep import build_parser, selected_candidates
from jax_impl.kernels.hopper.config import autotune_space, default_config


def test_select_keeps_the_default_and_the_candidates_with_every_value():
    space = autotune_space(128)
    select = build_parser().parse_args(["--family", "hopper", "--select", "bwd_query_rows=true",
                                        "--select", "bwd_form=one_kernel"]).select
    assert select == [("bwd_query_rows", True), ("bwd_form", "one_kernel")]
    chosen = selected_candidates(space, select)
    assert chosen[0] == default_config(128) and len(chosen) > 1
    assert all(c.bwd_query_rows and c.bwd_form == "one_kernel" for c in chosen[1:])
    assert selected_candidates(space, []) == space  # no --select: every candidate
    # the negative control: a value no candidate has leaves the default alone
    assert selected_candidates(space, [("bwd_producer_registers", 96)]) == space[:1]
    assert build_parser().parse_args(["--select", "bwd_producer_registers=40", "--select", "full_block_kv=none",
                                      "--select", "full_block_kv=256"]).select == [
        ("bwd_producer_registers", 40), ("full_block_kv", None), ("full_block_kv", 256)]


@pytest.mark.parametrize("argv,message", [
    (["--select", "no_such_field=1"], "is not FIELD=VALUE with FIELD one of"),
    (["--select", "bwd_query_rows"], "is not FIELD=VALUE"),
    (["--select", "bwd_query_rows=2"], "bwd_query_rows takes true or false, got '2'"),
    (["--select", "bwd_producer_registers=many"], "bwd_producer_registers takes an integer, got 'many'"),
    (["--select", "full_block_kv=wide"], "full_block_kv takes an integer, got 'wide'"),
    pytest.param(["--family", "hopper"], "pallas_sweep needs jax with a GPU backend",
                 marks=pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU would start the sweep")),
])
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = subprocess.run([sys.executable, "-m", "compare.bench.pallas_sweep", *argv], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
