"""JAX's FP8 matmul (`jax_impl.model.fp8_matmul`) in the operand layouts cuBLASLt's FP8 GEMMs read: as traced (CPU)
and as XLA compiles it for a GPU; and the bench that times it (`compare/bench/fp8_linear_bench.py`). Its numbers are
tests/test_fp8.py's (which needs torchao, absent from the GPU image)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import jaxprs_in_params

from compare.bench.fp8_linear_bench import FORMS, float8_transposes, forward_backward, main
from jax_impl.model import fp8_matmul

IN, OUT = 128, 96  # tests/test_fp8.py's product's dims


def _fp8_dots_and_barriers(blocks):
    """The float8 dot_generals (their operands' ranks and contracting dims) and optimization barriers of JAX's fp8
    matmul, forward and backward, as traced."""
    x = jnp.zeros((2, 32, IN), jnp.bfloat16)
    w, g = jnp.zeros((OUT, IN), jnp.bfloat16), jnp.zeros((2, 32, OUT), jnp.bfloat16)

    dots, barriers = [], 0

    def walk(jaxpr):
        nonlocal barriers
        for eqn in jaxpr.eqns:
            barriers += eqn.primitive.name == "optimization_barrier"
            if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.dtype == jnp.float8_e4m3fn:
                (lhs, rhs), _ = eqn.params["dimension_numbers"]
                dots.append(((eqn.invars[0].aval.ndim, eqn.invars[1].aval.ndim), (tuple(lhs), tuple(rhs))))
            for sub in jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(forward_backward(lambda x, w: fp8_matmul(x, w, blocks)))(x, w, g).jaxpr)
    return dots, barriers


@pytest.mark.parametrize("blocks", [(1, 1), (1, 2)], ids=["one_block", "blocks_1x2"])
def test_fp8_gemms_take_both_operands_contraction_minor(blocks):
    """cuBLASLt's FP8 GEMMs read both operands with the contracted dim minor. Every float8 dot contracts the last
    dim of each operand, and the three transposed casts (the activation, the output gradient, the weight) sit
    behind optimization barriers, which keep XLA from folding them into the dots (then its GEMM rewriter put them
    back as slow lone float8 transposes: jax_impl.model._transposed_cast). A dot contracting the tokens as they
    come (the form before) fails the first check."""
    dots, barriers = _fp8_dots_and_barriers(blocks)
    assert len(dots) == 3, dots
    for (lhs_rank, rhs_rank), contracting in dots:
        assert contracting == ((lhs_rank - 1,), (rhs_rank - 1,)), dots
    assert barriers == 3


@pytest.mark.gpu
def test_gpu_fp8_matmul_compiles_no_lone_float8_transpose():
    """On a GPU, XLA compiles the fp8 matmul's forward and backward (one device block, the 1B MLP's dims at 4k
    tokens) with every float8 transpose inside a transpose-emitted fusion (kind kInput), none as a lone loop-emitted
    one (kLoop; `_transposed_cast`), and the three GEMMs as cuBLASLt FP8 GEMMs."""
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs a GPU")
    x, g = jnp.zeros((1, 4096, 2048), jnp.bfloat16), jnp.zeros((1, 4096, 8192), jnp.bfloat16)
    w = jnp.zeros((8192, 2048), jnp.bfloat16)

    text = forward_backward(FORMS["fp8"]).lower(x, w, g).compile().as_text()
    transposes = float8_transposes(text)
    assert [kind for _, _, kind in transposes] == ["kInput"] * 3, transposes
    assert text.count('custom_call_target="__cublas$lt$matmul$f8"') == 3


def test_the_fp8_linear_bench_times_both_forms_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--shapes", "64x128x96", "--calls", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["form"] for r in rows] == ["bf16", "fp8"] and all(r["ms"] > 0 for r in rows)
    assert rows[1]["speedup_over_bf16"] > 0
    for argv, cause in ((["--shapes", "64x100x96"], "64x100x96"), (["--calls", "0"], "--calls 0"),
                        (["--out", str(out)], "exists")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert cause in capsys.readouterr().err
    assert json.loads(out.read_text())["rows"] == rows  # the refused run left the file as it was
