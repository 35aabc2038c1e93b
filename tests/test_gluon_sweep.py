"""`python -m compare.bench.gluon_sweep` on CPU: its --select (which Gluon candidates a sweep times, parsed against
the direction's config class) and its bad input, one line and exit 2 (the sweep itself times compiled kernels on a
GPU: its rows are results, not tests). The twin of tests/test_pallas_sweep.py."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from compare.bench.common import point_deadline, selected_candidates
from compare.bench.gluon_sweep import backward_candidates, candidates, parse_args
from torch_impl.kernels.hopper.config import GQA_HEAD_SPLITS, backward_config, forward_config


def test_backward_select_keeps_the_default_and_the_candidates_with_every_value():
    space = backward_candidates(128, causal=False)
    select = parse_args(["--direction", "backward", "--out", "x.json", "--select", f"head_splits={GQA_HEAD_SPLITS}",
                         "--select", "warp_specialize=true"]).select
    assert select == [("head_splits", GQA_HEAD_SPLITS), ("warp_specialize", True)]
    chosen = selected_candidates(space, select)
    assert chosen[0] == backward_config(128, False, 0) and len(chosen) == 2
    assert chosen[1].head_splits == GQA_HEAD_SPLITS and chosen[1].warp_specialize
    assert selected_candidates(space, []) == tuple(space)  # no --select: every candidate
    # the negative control: a value no candidate has leaves the default alone
    assert selected_candidates(space, [("head_splits", 3)]) == (space[0],)


def test_forward_select_takes_the_forward_config_fields():
    select = parse_args(["--out", "x.json", "--select", "pingpong=false"]).select
    space = candidates(128, causal=True)
    chosen = selected_candidates(space, select)
    assert chosen[0] == forward_config(128, True, 0)
    assert len(chosen) > 1 and not any(config.pingpong for config in chosen[1:])


def test_budget_sets_each_points_deadline():
    """--budget-s: a point starts no candidate after its deadline; without it there is none."""
    assert parse_args(["--out", "x.json"]).budget_s is None and point_deadline(None) == math.inf
    budget = parse_args(["--out", "x.json", "--budget-s", "30"]).budget_s
    before = time.monotonic()
    assert before + budget <= point_deadline(budget) <= time.monotonic() + budget
    assert point_deadline(0) <= time.monotonic()  # the negative control: a spent budget is already past


@pytest.mark.parametrize("argv,message", [
    (["--select", "head_splits=8"], "--select (forward): 'head_splits=8' is not FIELD=VALUE with FIELD one of"),
    (["--direction", "backward", "--select", "pingpong=true"], "'pingpong=true' is not FIELD=VALUE"),
    (["--direction", "backward", "--select", "stagger=2"], "stagger takes true or false, got '2'"),
    (["--direction", "backward", "--select", "head_splits=many"], "head_splits takes an integer, got 'many'"),
    (["--direction", "sideways"], "argument --direction: invalid choice"),
    (["--budget-s", "soon"], "argument --budget-s: invalid float value: 'soon'"),
    pytest.param([], "gluon_sweep needs a CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would start the sweep")),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path):
    result = subprocess.run([sys.executable, "-m", "compare.bench.gluon_sweep", "--out", str(tmp_path / "x.json"),
                             *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "x.json").exists()  # nothing written before the sweep starts
