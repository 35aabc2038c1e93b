"""Tests of `twinflash bench kernels` (compare/bench/kernel_bench.py) that need no GPU: the FLOP count, the merge of the
two parts' rows into one table with ratios, the rendering, the JSON report and the no-CUDA exit; and the bad input of
its Nsight Compute driver (compare/bench/kernel_ncu.py); the JAX timing helpers the sweeps share."""

from __future__ import annotations

import datetime
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from compare.bench import kernel_bench, kernel_ncu
from weights.flops import attention_flops


def test_attention_flops():
    full = 4 * 1 * 32 * 4096 * 4096 * 128
    assert attention_flops(1, 32, 4096, 4096, 128, causal=False, backward=False) == full
    assert attention_flops(1, 32, 4096, 4096, 128, causal=True, backward=False) == full / 2
    assert attention_flops(1, 32, 4096, 4096, 128, causal=True, backward=True) == 3.5 * full / 2


def _row(impl, tflops=None, error=None, seq=4096, causal=True, kv_heads=32, part="torch"):
    row = dict(impl=impl, S=seq, causal=causal, kv_heads=kv_heads, heads=32, head_dim=128, batch=1, part=part)
    if error:
        row["error"] = error
    else:
        row.update(fwd_ms=1.0, fwd_tflops=tflops, fwdbwd_ms=3.0, fwdbwd_tflops=tflops / 2)
    return row


ROWS = [_row("triton", 500.0), _row("sdpa_flash", 250.0), _row("sdpa_cudnn", 400.0),
        _row("pallas", 300.0, part="jax"), _row("pallas_mha", error="RESOURCE_EXHAUSTED: out of memory", part="jax"),
        _row("jax_cudnn", 600.0, part="jax"),
        _row("triton", 100.0, seq=16384, causal=False, kv_heads=8),
        _row("sdpa_cudnn", error="RuntimeError: No available kernel", seq=16384, causal=False, kv_heads=8),
        dict(part="jax", impl="jax part", error="exited with code 1")]


def test_merge_rows_one_row_per_point_and_pass_with_ratios():
    table = kernel_bench.merge_rows(ROWS)
    assert [(e["S"], e["causal"], e["kv_heads"], e["pass"]) for e in table] == [
        (4096, True, 32, "fwd"), (4096, True, 32, "fwd+bwd"), (16384, False, 8, "fwd"), (16384, False, 8, "fwd+bwd")]
    fwd, fwdbwd = table[0], table[1]
    assert fwd["triton"] == 500.0 and fwdbwd["triton"] == 250.0
    assert fwd["ours/FA2"] == pytest.approx(2.0) and fwd["ours/cuDNN"] == pytest.approx(1.25)
    assert fwd["pallas/jax-cuDNN"] == pytest.approx(0.5)
    assert fwd["pallas_mha"].startswith("error: RESOURCE_EXHAUSTED") and "pallas/mha" not in fwd
    later = table[2]
    assert later["sdpa_cudnn"].startswith("error:") and "ours/cuDNN" not in later and "sdpa_flash" not in later


def test_render_table_shows_numbers_ratios_and_failures():
    console = Console(record=True, width=250)
    console.print(kernel_bench.render_table(kernel_bench.merge_rows(ROWS)))
    text = console.export_text()
    for expected in ("4k", "16k", "500", "1.25", "2.00", "OOM", "err", "ours/FA2", "pallas/mha"):
        assert expected in text


def test_report_writes_one_json_with_command_versions_rows_and_table(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    meta = {"gpu": "NVIDIA H200", "torch": "2.11.0", "jax": "0.11.2"}
    assert kernel_bench.report(ROWS, meta, ["--quick"], out) == out
    document = json.loads(out.read_text())
    assert document["command"] == "twinflash bench kernels --quick"
    assert document["versions"] == meta and document["rows"] == ROWS
    assert document["table"] == kernel_bench.merge_rows(ROWS)
    assert "error: pallas_mha" in capsys.readouterr().err


def test_default_out_path_names_date_and_gpu():
    path = kernel_bench.default_out_path({"gpu": "NVIDIA H200"}, datetime.date(2026, 11, 21))
    assert path == Path("out") / "kernels-2026-11-21-h200.json"


def test_bad_arguments_are_one_line_errors(capsys):
    assert kernel_bench.main(["--kv-heads", "5"]) == 2
    assert capsys.readouterr().err.strip() == "twinflash: error: --kv-heads: 5 does not divide --heads 32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_exits_2_with_one_line(capsys):
    assert kernel_bench.main(["--quick"]) == 2
    assert capsys.readouterr().err == f"twinflash: error: {kernel_bench.NO_CUDA}\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
@pytest.mark.parametrize("argv, message", [(["triton"], kernel_ncu.NO_CUDA),
                                           (["flash9"], "invalid choice: 'flash9'"),
                                           (["pallas", "--heads", "32", "--kv-heads", "5"], "multiple of --kv-heads 5"),
                                           (["fa3", "--seq-len", "0"], "--seq-len")])
def test_the_ncu_driver_s_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    """compare.bench.kernel_ncu without a GPU (this machine) or with bad arguments: one line, exit 2."""
    assert kernel_ncu.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinflash: error:") and err.count("\n") == 1 and message in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs the torch part to fail")
def test_a_part_that_crashes_is_one_error_row():
    args = kernel_bench.build_parser().parse_args(["--quick"])
    kernel_bench._check_args(args)
    meta, rows = kernel_bench.run_part("torch", args)
    assert rows == [dict(part="torch", impl="torch part", error="exited with code 1")]


def test_head_dims_are_points_and_impls_select_what_a_part_measures(capsys):
    args = kernel_bench.build_parser().parse_args(["--seq-lens", "4k", "--kv-heads", "8", "--causal", "causal",
                                                   "--head-dim", "128,64", "--impls",
                                                   "pallas_hopper,pallas_hopper_two_kernel,tokamax"])
    kernel_bench._check_args(args)
    assert kernel_bench._points(args) == [(4096, True, 8, 128), (4096, True, 8, 64)]
    assert kernel_bench._part_impls(args, "jax") == ("pallas_hopper", "tokamax", "pallas_hopper_two_kernel")
    assert kernel_bench._part_impls(args, "torch") == ()
    child = kernel_bench._child_args(args)
    assert child[child.index("--head-dim") + 1] == "128,64" and "pallas_hopper_two_kernel" in child[-1]
    rows = [_row("pallas_hopper", 500.0, part="jax"), dict(_row("pallas_hopper", 300.0, part="jax"), head_dim=64),
            _row("pallas_hopper_two_kernel", 400.0, part="jax")]
    table = kernel_bench.merge_rows(rows)
    assert [(e["D"], e["pass"]) for e in table] == [(128, "fwd"), (128, "fwd+bwd"), (64, "fwd"), (64, "fwd+bwd")]
    assert table[0]["mosaic/two-kernel"] == pytest.approx(500 / 400) and table[2]["pallas_hopper"] == 300.0
    assert "pallas_hopper_two_kernel" not in kernel_bench.merge_rows(ROWS)[0]
    assert kernel_bench.main(["--impls", "pallas,flash9"]) == 2
    assert "unknown implementation(s) flash9" in capsys.readouterr().err


def test_forced_triton_paths_get_their_own_column(capsys):
    rows = ROWS + [_row("triton_hopper", 450.0)]
    table = kernel_bench.merge_rows(rows)
    assert table[0]["triton_hopper"] == 450.0 and "triton_hopper" not in kernel_bench.merge_rows(ROWS)[0]
    console = Console(record=True, width=300)  # wide enough for every column's full name
    console.print(kernel_bench.render_table(table))
    assert "triton_hopper" in console.export_text()
    assert kernel_bench.main(["--triton-paths", "triton_fast"]) == 2
    assert "unknown Triton path(s) triton_fast" in capsys.readouterr().err


def test_fa3_is_a_jax_peer_with_a_ratio_to_the_mosaic_kernels():
    assert "fa3" in kernel_bench.IMPLS["jax"] and "fa3" in kernel_bench.KNOWN_IMPLS
    assert ("mosaic/fa3", "pallas_hopper", "fa3") in kernel_bench.RATIOS
    fa3 = dict(_row("fa3", 400.0, part="jax"), max_err_vs_cudnn=0.0078)
    table = kernel_bench.merge_rows([_row("pallas_hopper", 500.0, part="jax"), fa3])
    assert table[0]["fa3"] == 400.0 and table[0]["mosaic/fa3"] == pytest.approx(500 / 400)
    assert "max err vs cuDNN 0.0078" in kernel_bench._progress(fa3)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn3_jax") is not None, reason="checks the row of an absent FA3")
def test_jax_part_without_flash_attn3_jax_has_an_fa3_row_naming_the_install(capsys):
    args = kernel_bench.build_parser().parse_args(["--part", "jax", "--impls", "fa3", "--seq-lens", "4k",
                                                   "--kv-heads", "8", "--causal", "causal"])
    kernel_bench._check_args(args)
    kernel_bench._jax_part(args)
    rows = [json.loads(line)["row"] for line in capsys.readouterr().out.splitlines() if '"row"' in line]
    assert [(r["impl"], r["S"], r["kv_heads"]) for r in rows] == [("fa3", 4096, 8)]
    assert rows[0]["error"].startswith("skipped: ") and 'pip install -e ".[peers]"' in rows[0]["error"]
    assert "flash_attn3_jax" in rows[0]["error"]


def test_jax_times_are_every_timed_call_after_two_warm_ups_and_the_median_is_the_upper_one():
    import jax.numpy as jnp

    calls = []

    def fn(x):
        calls.append(len(calls))
        return jnp.asarray(x) + len(calls)
    samples = kernel_bench.jax_times_ms(fn, 1.0, repeats=4)
    assert len(calls) == 6 and len(samples) == 4 and all(t >= 0 for t in samples)
    assert kernel_bench.median_ms([3.0, 1.0, 2.0, 10.0]) == 3.0 and kernel_bench.median_ms([2.0, 9.0, 1.0]) == 2.0
