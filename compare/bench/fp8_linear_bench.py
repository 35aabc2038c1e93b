"""One linear's forward and both backward matmuls in JAX's FP8 (`jax_impl.model.fp8_matmul`, weights/fp8.py's
recipe) against the same in bf16 (an einsum), on the first device, per shape (issue 40: FP8 faster than bf16).

`python -m compare.bench.fp8_linear_bench [--shapes 32768x2048x8192,16384x14336x4096] [--calls 20] [--out F.json]`,
a shape being tokens x in x out (one device block of tokens). Per shape and form: the best of 3 rounds of `--calls`
jitted fwd+bwd calls (ms), FP8's speedup over bf16, the GEMM custom calls XLA compiled, and the float8 transposes
it compiled with their fusion kind. A "kLoop" float8 transpose is the lone, loop-emitted kind that XLA's GEMM
rewriter adds after fusion when a dot's operand is not contraction-minor, at a tenth of the bandwidth of a
transpose-emitted ("kInput") one (`jax_impl.model._transposed_cast`). The table last, JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jax_impl.model import fp8_matmul
from weights.fp8 import GEMM_MULTIPLE

DEFAULT_SHAPES = "32768x2048x8192,16384x14336x4096"  # the 1B MLP's w1 at 32k tokens; the 8B's w2 at 16k (sp=2)
ROUNDS = 3
_TRANSPOSE = re.compile(r"%(\S*transpose\S*) = (f8\w+\[[\d,]*\])\S* fusion\(.*kind=(k\w+)")
_GEMM = re.compile(r'custom_call_target="([^"]*(?:gemm|matmul)[^"]*)"')


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """"TxIxO,..." -> [(tokens, in, out), ...]; ValueError naming the bad entry (each dim a positive multiple of
    weights.fp8.GEMM_MULTIPLE, which FP8 GEMMs need)."""
    shapes = []
    for entry in text.split(","):
        dims = entry.strip().split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 and int(d) % GEMM_MULTIPLE == 0 for d in dims):
            raise ValueError(f"--shapes entry {entry!r} is not TOKENSxINxOUT of positive multiples of "
                             f"{GEMM_MULTIPLE}")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def float8_transposes(hlo_text: str) -> list[tuple[str, str, str]]:
    """(name, shape, fusion kind) of each float8 transpose fusion in optimized HLO text."""
    return _TRANSPOSE.findall(hlo_text)


def forward_backward(linear):
    """(x, w, g) -> (linear(x, w), (dx, dw)) for the output gradient g, jitted."""
    def products(x, w, g):
        y, vjp = jax.vjp(linear, x, w)
        return y, vjp(g)
    return jax.jit(products)


FORMS = {"bf16": lambda x, w: jnp.einsum("bti,oi->bto", x, w),
         "fp8": lambda x, w: fp8_matmul(x, w, (1, 1))}


def _best_ms(fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(ROUNDS):
        began = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - began) / calls)
    return best * 1e3


def measure(shape: tuple[int, int, int], calls: int) -> list[dict]:
    """The rows of one shape, bf16 first."""
    tokens, fan_in, fan_out = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (1, tokens, fan_in), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (fan_out, fan_in), jnp.float32) / fan_in ** 0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (1, tokens, fan_out), jnp.bfloat16)
    rows = []
    for name, linear in FORMS.items():
        compiled = forward_backward(linear).lower(x, w, g).compile()  # timed as read: one compilation
        text = compiled.as_text()
        rows.append(dict(shape=list(shape), form=name, ms=_best_ms(compiled, (x, w, g), calls),
                         gemms=sorted(set(_GEMM.findall(text))),
                         float8_transposes=[" ".join(t) for t in float8_transposes(text)]))
    rows[-1]["speedup_over_bf16"] = rows[0]["ms"] / rows[-1]["ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="TOKENSxINxOUT,... (default %(default)s)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed round (default %(default)s)")
    parser.add_argument("--out", type=Path, help="JSON file to write (refused if it exists)")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.exit(2, f"fp8_linear_bench: {error}\n")
    if args.calls < 1:
        parser.exit(2, f"fp8_linear_bench: --calls {args.calls} is not a positive count\n")
    if args.out is not None and args.out.exists():
        parser.exit(2, f"fp8_linear_bench: {args.out} exists; refusing to overwrite it\n")
    rows = [row for shape in shapes for row in measure(shape, args.calls)]
    if args.out is not None:
        args.out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print(f"{'tokens x in x out':>22} {'form':>5} {'ms':>8} {'fp8/bf16':>8}  float8 transposes (fusion kind)")
    for row in rows:
        speedup = f"{row['speedup_over_bf16']:.2f}x" if "speedup_over_bf16" in row else ""
        kinds = ", ".join(t.split()[-1] for t in row["float8_transposes"]) or "-"
        print(f"{'x'.join(map(str, row['shape'])):>22} {row['form']:>5} {row['ms']:8.3f} {speedup:>8}  {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
