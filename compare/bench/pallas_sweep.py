"""Block-size sweep of the JAX Pallas FlashAttention kernels on one GPU (`python -m compare.bench.pallas_sweep`).

--family portable (default), the portable family (Pallas's Triton lowering): for each head dim (--head-dims) it
times, bf16, B x S x H (Hkv) as given, causal and/or full:
  fwd   the forward kernel over FORWARD_CANDIDATES;
  dkdv  the backward (both kernels) over DKDV_CANDIDATES, the dQ kernel held at its table default;
  dq    the backward over DQ_CANDIDATES, the dK/dV kernel held at the best dkdv found;
then flash_attention fwd and fwd+bwd (as `compare.bench.kernel_bench` times them) with the table default and with
the best configs. A config that fails to compile (shared memory, registers) is recorded as an error; every
config's result is checked against the first one's (max_abs_diff), so a fast wrong config stands out.
Timing: block_until_ready, median of --repeats (20, as `bench kernels`) after two warm-up calls. At 5 one candidate's
median came out 5-6 % above its 20-repeat value in two runs while the others held theirs
(compare/results/kernels-dq-order-2026-12-01-h200): decide differences of a few percent at 20. TFLOP/s from
`weights.flops.attention_flops` (backward = 2.5 forwards). Prints one JSON object per line and a summary with
ready-to-paste `jax_impl.kernels.portable.config.GPU_CONFIGS` entries; writes all rows to --out. Every config
reaches the kernels as an argument (`config=`), so each timed function is its own trace.

--family hopper, the Hopper family (Mosaic GPU kernels): for each head dim and causal setting, every `HopperConfig` of
`jax_impl.kernels.hopper.config.autotune_space(D)` (the heuristic's default first) through
`flash_attention(backend="pallas_hopper", config=...)` (--select: only those with the given field values, beside the
default): fwd+bwd, and fwd once per distinct forward block sizes, timed as `bench kernels` times them, beside JAX
cuDNN on the same inputs. Each row keeps its fwd+bwd calls' times in call order (`fwdbwd_samples_ms`), so that a
drift or a second mode shows beside the median. Outputs and gradients are compared with the default config's
(max_abs_diff); a config that fails to compile is an error row. --budget-s (per point) stops starting new candidates
once spent (their rows say so), so a sweep fits a time-limited call.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import time
from pathlib import Path

from compare.args import OneLineParser, with_error_contract
from compare.bench.common import BUDGET_SPENT, config_field_value, point_deadline, selected_candidates
from compare.bench.kernel_bench import jax_median_ms, jax_times_ms, median_ms
from weights import BadInputError
from weights.flops import attention_flops

# (block_q, block_k, num_warps, num_stages). dkdv: block_k rows of K/V per program, block_q query rows per step.
FORWARD_CANDIDATES = [(bq, bk, w, s) for bq, bk, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
                      if not (bq == 64 and w == 8)]
DKDV_CANDIDATES = list(itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3)))
DQ_CANDIDATES = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)))
QUICK = {"fwd": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3)],
         "dkdv": [(32, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (128, 128, 8, 2)],
         "dq": [(128, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2)]}


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _config_value(text: str) -> tuple[str, object]:
    """FIELD=VALUE of --select: a field of the Mosaic kernels' HopperConfig (`common.config_field_value`)."""
    from jax_impl.kernels.hopper.config import HopperConfig
    return config_field_value(HopperConfig, text)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m compare.bench.pallas_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dims", type=_parse_ints, default=[128], help="e.g. 64,128")
    parser.add_argument("--causal", choices=("causal", "full", "both"), default="causal")
    parser.add_argument("--kernels", default="fwd,dkdv,dq", help="subset of fwd,dkdv,dq")
    parser.add_argument("--quick", action="store_true", help="5 candidates per kernel instead of the full grid")
    parser.add_argument("--family", choices=("portable", "hopper"), default="portable",
                        help="which Pallas kernel family to sweep (hopper: sm90 only)")
    parser.add_argument("--budget-s", type=float,
                        help="hopper: start no candidate after this many seconds into a point")
    parser.add_argument("--select", type=_config_value, action="append", default=[], metavar="FIELD=VALUE",
                        help="hopper: time only the candidates whose HopperConfig has FIELD=VALUE (repeatable; "
                             "all must hold), beside the default, e.g. bwd_query_rows=true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("out/pallas_sweep.json"))
    return parser


def _emit(row: dict) -> dict:
    print(json.dumps(row), flush=True)
    return row


def sweep_point(args, head_dim: int, causal: bool) -> list[dict]:
    """All kernels' candidates for one (head dim, causal) point; returns the rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_impl.kernels.flash_attention import flash_attention
    from jax_impl.kernels.portable.backward import portable_backward
    from jax_impl.kernels.portable.config import GPU_CONFIGS, KernelConfig, PortableConfig
    from jax_impl.kernels.portable.forward import portable_forward
    from jax_impl.kernels.tiles import padded_head_dim

    b, s, h, hkv = args.batch, args.seq_len, args.heads, args.kv_heads
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (b, s, heads, head_dim), jnp.bfloat16)
                     for key, heads in zip(keys, (h, hkv, hkv, h)))
    scale = head_dim ** -0.5
    fwd_flops = attention_flops(b, h, s, s, head_dim, causal, backward=False)
    default = GPU_CONFIGS[padded_head_dim(head_dim)]
    out, lse = jax.jit(functools.partial(portable_forward, causal=causal, softmax_scale=scale,
                                         out_dtype=jnp.dtype(jnp.bfloat16), config=default.forward,
                                         interpret=False))(q, k, v)
    point = dict(S=s, batch=b, heads=h, kv_heads=hkv, head_dim=head_dim, causal=causal)
    rows, best = [], {"fwd": default.forward, "dkdv": default.backward_dkdv, "dq": default.backward_dq}

    def run(kernel: str, config: KernelConfig):
        if kernel == "fwd":
            fn = functools.partial(portable_forward, causal=causal, softmax_scale=scale,
                                   out_dtype=jnp.dtype(jnp.bfloat16), config=config, interpret=False)
            return jax.jit(fn), (q, k, v), fwd_flops
        dkdv, dq = (config, default.backward_dq) if kernel == "dkdv" else (best["dkdv"], config)
        fn = functools.partial(portable_backward, causal=causal, softmax_scale=scale, dkdv_config=dkdv, dq_config=dq,
                               interpret=False)
        return jax.jit(fn), (dout, q, k, v, out, lse), 2.5 * fwd_flops

    candidates = {"fwd": FORWARD_CANDIDATES, "dkdv": DKDV_CANDIDATES, "dq": DQ_CANDIDATES}
    for kernel in [x for x in ("fwd", "dkdv", "dq") if x in args.kernels.split(",")]:
        first, timed = None, []
        for values in (QUICK[kernel] if args.quick else candidates[kernel]):
            config = KernelConfig(*values)
            row = dict(point, kernel=kernel, config=list(values))
            try:
                fn, inputs, flops = run(kernel, config)
                result = [np.asarray(x, np.float32) for x in jax.tree.leaves(fn(*inputs))]
                first = first or result
                row["max_abs_diff"] = max(float(np.max(np.abs(a - c))) for a, c in zip(result, first))
                row["ms"] = jax_median_ms(fn, *inputs, repeats=args.repeats)
                row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
                timed.append((row["ms"], config))
            except Exception as err:  # a config that does not compile or run is a result, not a crash
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            rows.append(_emit(row))
        if timed:
            best[kernel] = min(timed)[1]

    tuned = PortableConfig(best["fwd"], best["dkdv"], best["dq"])
    for label, config in (("table", default), ("best", tuned)):
        attention = functools.partial(flash_attention, causal=causal, backend="pallas_portable", config=config)

        def loss(q, k, v, dout):  # dout an argument: closed over, XLA would fold it at compile time
            return jnp.sum(attention(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

        fwd_ms = jax_median_ms(jax.jit(attention), q, k, v, repeats=args.repeats)
        fwdbwd_ms = jax_median_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, dout, repeats=args.repeats)
        rows.append(_emit(dict(point, kernel="flash_attention", sizes=label, block_sizes=repr(config),
                               fwd_ms=fwd_ms, fwd_tflops=fwd_flops / (fwd_ms * 1e-3) / 1e12, fwdbwd_ms=fwdbwd_ms,
                               fwdbwd_tflops=3.5 * fwd_flops / (fwdbwd_ms * 1e-3) / 1e12)))
    print(f"# head_dim {head_dim} causal={causal}: {padded_head_dim(head_dim)}: {tuned!r},", flush=True)
    return rows


def sweep_hopper_point(args, head_dim: int, causal: bool) -> list[dict]:
    """Every Hopper (Mosaic) candidate of `autotune_space(head_dim)` and JAX cuDNN at one point; returns the rows."""
    deadline = point_deadline(args.budget_s)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_impl.kernels.flash_attention import flash_attention
    from jax_impl.kernels.hopper.config import autotune_space

    b, s, h, hkv = args.batch, args.seq_len, args.heads, args.kv_heads
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (b, s, heads, head_dim), jnp.bfloat16)
                     for key, heads in zip(keys, (h, hkv, hkv, h)))
    fwd_flops = attention_flops(b, h, s, s, head_dim, causal, backward=False)
    point = dict(S=s, batch=b, heads=h, kv_heads=hkv, head_dim=head_dim, causal=causal)

    def timed(attend) -> dict:
        def loss(q, k, v, dout):  # dout an argument: closed over, XLA would fold it at compile time
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        samples = jax_times_ms(grads, q, k, v, dout, repeats=args.repeats)
        ms = median_ms(samples)
        return dict(fwdbwd_ms=ms, fwdbwd_tflops=3.5 * fwd_flops / (ms * 1e-3) / 1e12,
                    fwdbwd_samples_ms=[round(t, 4) for t in samples],
                    results=[np.asarray(x, np.float32) for x in (jax.jit(attend)(q, k, v), *grads(q, k, v, dout))])

    def forward_ms(attend) -> dict:
        ms = jax_median_ms(jax.jit(attend), q, k, v, repeats=args.repeats)
        return dict(fwd_ms=ms, fwd_tflops=fwd_flops / (ms * 1e-3) / 1e12)

    cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    row = dict(point, impl="jax_cudnn")
    try:
        row |= forward_ms(cudnn) | {key: value for key, value in timed(cudnn).items() if key != "results"}
    except Exception as err:  # cuDNN's absence is a result of the sweep, not its end
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    rows, first, forward_rows = [_emit(row)], None, {}
    for config in selected_candidates(autotune_space(head_dim), args.select):
        row = dict(point, impl="pallas_hopper", config=dataclasses.asdict(config))
        if time.monotonic() > deadline:
            rows.append(_emit(row | {"error": BUDGET_SPENT}))
            continue
        attend = functools.partial(flash_attention, causal=causal, backend="pallas_hopper", config=config)
        try:
            result = timed(attend)
            first = first or result["results"]
            row["max_abs_diff"] = max(float(np.max(np.abs(a - c))) for a, c in zip(result.pop("results"), first))
            forward = (config.block_q, config.block_kv, config.num_stages)
            if forward not in forward_rows:
                forward_rows[forward] = forward_ms(attend)
            row |= forward_rows[forward] | result
        except Exception as err:  # a config that does not compile or run is a result, not a crash
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(_emit(row))
    timed_rows = [r for r in rows if r["impl"] == "pallas_hopper" and "fwdbwd_ms" in r]
    if timed_rows:
        best = min(timed_rows, key=lambda r: r["fwdbwd_ms"])
        print(f"# D={head_dim} causal={causal}: best fwd+bwd {best['fwdbwd_tflops']:.0f} TF/s with {best['config']}; "
              f"default {timed_rows[0]['fwdbwd_tflops']:.0f}", flush=True)
    return rows


def main(argv=None) -> int:
    """Bad input (arguments, no GPU) is one line on stderr and exit 2 (`with_error_contract`)."""
    return with_error_contract(lambda: _main(argv))


def _main(argv) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = build_parser().parse_args(argv)
    import jax
    if jax.default_backend() != "gpu":
        raise BadInputError("pallas_sweep needs jax with a GPU backend (the kernels are timed compiled, not "
                            "interpreted)")
    print(json.dumps({"meta": {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}}), flush=True)
    causals = {"causal": (True,), "full": (False,), "both": (True, False)}[args.causal]
    if args.family == "hopper":
        rows = [row for head_dim in args.head_dims for causal in causals
                for row in sweep_hopper_point(args, head_dim, causal)]
    else:
        rows = [row for head_dim in args.head_dims for causal in causals for row in sweep_point(args, head_dim, causal)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"# wrote {len(rows)} rows to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
