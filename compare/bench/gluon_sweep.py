"""Config sweep of the Hopper family's Gluon sm_90 kernels (`torch_impl.kernels.hopper.forward`, `.backward`) on
one GPU (`python -m compare.bench.gluon_sweep`), beside the portable Triton kernel and SDPA cuDNN
in the same process.

For each head dim (--head-dims) and causal setting (--causal), bf16, B=1, S (--seq-len), H (--heads), Hkv
(--kv-heads): one direction (--direction) alone, timed with triton.testing.do_bench (median, CUDA events) as
`kernel_bench` times it; TFLOP/s from `weights.flops.attention_flops` (the backward credited 2.5 forwards). Every
Gluon config's result is compared with the portable kernel's (max_abs_diff: float32 out, or float32 dq/dk/dv from
the Gluon forward's out/lse), so a fast wrong config stands out; a config that does not fit (shared memory) or
fails is recorded as an error row and the sweep goes on. --select FIELD=VALUE (repeatable; a field of the
direction's config, HopperConfig or HopperBackwardConfig) times only the candidates with every value, beside the
default, as `pallas_sweep --select` does for the JAX twin; --budget-s (per head dim and causal setting) starts no
candidate once spent (their rows say so), so that a sweep fits a time-limited call. Prints one JSON object per
row, writes them all to --out after each row (a run cut short keeps what it measured), and a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from compare.args import OneLineParser, with_error_contract
from compare.bench.common import BUDGET_SPENT, config_field_value, point_deadline, selected_candidates
from weights import BadInputError
from weights.flops import attention_flops


def candidates(head_dim: int, causal: bool):
    """HopperConfigs to time: the default first and the other schedule (ping-pong or not); at D=128 nothing more (3
    stages or 256-key tiles do not fit shared memory, 64-key tiles ran 537-543 TF/s against 587-591 in
    compare/results/kernels-gluon-2026-11-22-h200); at D=64 the two-consumer shape that was the default until
    compare/results/kernels-gluon-forward-2026-11-23-h200-h13e, and three consumer warpgroups (192 query rows,
    FlashAttention-3's D=64 block) with 2-4 stages (256-key tiles: ptxas serializes the matmuls of two consumers,
    short of registers)."""
    from torch_impl.kernels.hopper.config import HopperConfig, forward_config, three_consumers

    default = forward_config(head_dim, causal, 0)
    space = [default, HopperConfig(**{**vars(default), "pingpong": not default.pingpong})]
    if head_dim == 64:
        space += [HopperConfig(num_stages=3, pingpong=False)]
        space += [three_consumers(num_stages=s, pingpong=False) for s in (2, 3, 4)]
        space += [three_consumers(num_stages=3, pingpong=True)]
    return list(dict.fromkeys(space))


def backward_candidates(head_dim: int, causal: bool):
    """HopperBackwardConfigs to time: the default first, then the best lockstep form (compare/results/
    kernels-gluon-backward-2026-11-23-h200-tuning) and the warp-specialised form (FlashAttention-3's structure)
    around it: D=128, 2 Q/dO stages with two float32 dQ tiles per consumer or 3 stages with one (shared memory
    holds one or the other); D=64, 64-row query blocks (128 rows spill) with 3 or 4 stages, and K and V in
    registers (at D=128 they do not fit), all with dQ in register order; the default with dQ staged row-major
    (dq_register_order False, the default until compare/results/kernels-gluon-dq-register-order-2026-12-03-h200)
    at the 32- and the 128-byte swizzle (config.DQ_SWIZZLES), or with the log-sum-exp read after the first matmuls
    (lse_first False); without a causal mask, also the default with each key block's walk starting at a different
    query block (stagger True, the default until compare/results/kernels-gluon-stagger-2026-12-03-h200, where it ran
    1.5-3.3 % slower); and the default with a GQA group's query heads shared among programs (head_splits
    GQA_HEAD_SPLITS; the default's kernel where there is no GQA: sweep with --kv-heads below --heads).
    """
    from torch_impl.kernels.hopper.config import (GQA_HEAD_SPLITS, HopperBackwardConfig, backward_config,
                                                  lockstep_config)

    if head_dim == 128:
        shapes = [dict(num_stages=2, dq_buffers=2), dict(num_stages=3, dq_buffers=1)]
    else:
        shapes = [dict(block_m=64, num_stages=s) for s in (3, 4)] + [dict(block_m=64, num_stages=3, kv_in_regs=True)]
    default = backward_config(head_dim, False, 0)
    space = [default] + [dataclasses.replace(default, **field) for field in (
        dict(dq_register_order=False), dict(dq_register_order=False, dq_swizzle=128), dict(lse_first=False),
        dict(head_splits=GQA_HEAD_SPLITS))]
    space.append(lockstep_config(head_dim))
    space += [HopperBackwardConfig(warp_specialize=True, dq_register_order=True, **shape) for shape in shapes]
    if not causal:  # a causal walk starts at its diagonal: staggered anyway
        space.append(dataclasses.replace(default, stagger=True))
    return list(dict.fromkeys(space))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m compare.bench.gluon_sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--causal", choices=("both", "causal", "full"), default="both")
    parser.add_argument("--direction", choices=("forward", "backward"), default="forward")
    parser.add_argument("--budget-s", type=float, help="start no candidate after this many seconds into a point")
    parser.add_argument("--select", action="append", default=[], metavar="FIELD=VALUE",
                        help="only the candidates with this field value, beside the default (repeatable)")
    parser.add_argument("--out", type=Path, required=True)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, --select as (field, value) pairs of the direction's config class."""
    from torch_impl.kernels.hopper.config import HopperBackwardConfig, HopperConfig

    parser = build_parser()
    args = parser.parse_args(argv)
    config_class = HopperConfig if args.direction == "forward" else HopperBackwardConfig
    try:
        args.select = [config_field_value(config_class, text) for text in args.select]
    except argparse.ArgumentTypeError as err:
        parser.error(f"--select ({args.direction}): {err}")
    return args


def main(argv=None) -> int:
    """Bad input (arguments, no GPU) is one line on stderr and exit 2 (`with_error_contract`)."""
    return with_error_contract(lambda: _main(argv))


def _main(argv) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        raise BadInputError("gluon_sweep needs a CUDA GPU (the kernels are timed compiled, not interpreted)")
    from torch_impl.kernels.portable.forward import portable_forward
    from torch_impl.kernels.hopper.forward import hopper_forward

    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        document = {"gpu": torch.cuda.get_device_name(), "args": vars(args) | {"out": str(args.out)}, "rows": rows}
        args.out.write_text(json.dumps(document, indent=1) + "\n")

    causals = {"both": (True, False), "causal": (True,), "full": (False,)}[args.causal]
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        q = torch.randn(1, args.seq_len, args.heads, head_dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, args.seq_len, args.kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        scale = head_dim ** -0.5
        heads_major = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
        dout = torch.randn_like(q)
        for causal in causals:
            deadline = point_deadline(args.budget_s)
            flops = attention_flops(1, args.heads, args.seq_len, args.seq_len, head_dim, causal, False)
            point = dict(S=args.seq_len, heads=args.heads, kv_heads=args.kv_heads, head_dim=head_dim, causal=causal)
            key = "fwd" if args.direction == "forward" else "bwd"
            flops *= 1.0 if args.direction == "forward" else 2.5

            def timed(name, fn, **extra):
                try:
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    record(impl=name, **point, **{f"{key}_ms": ms, f"{key}_tflops": flops / (ms * 1e-3) / 1e12},
                           **extra)
                except Exception as err:  # a config that does not fit is a result, not a crash
                    record(impl=name, **point, error=f"{type(err).__name__}: {err}"[:300], **extra)

            if args.direction == "backward":
                _sweep_backward(timed, record, point, q, k, v, dout, causal, scale, args.select, deadline)
                torch.cuda.empty_cache()
                continue

            want, _ = portable_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32)
            timed("triton_portable", lambda: portable_forward(q, k, v, causal=causal, softmax_scale=scale,
                                                              out_dtype=q.dtype))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                timed("sdpa_cudnn", lambda: F.scaled_dot_product_attention(
                    *heads_major, is_causal=causal, enable_gqa=args.kv_heads != args.heads))
            for config in selected_candidates(candidates(head_dim, causal), args.select):
                if time.monotonic() > deadline:
                    record(impl="triton_hopper", **point, config=str(config), error=BUDGET_SPENT)
                    continue
                try:
                    got, _ = hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=torch.float32,
                                            config=config)
                    diff = (got - want).abs().max().item()
                except Exception as err:
                    record(impl="triton_hopper", **point, config=str(config),
                           error=f"{type(err).__name__}: {err}"[:300])
                    continue
                timed("triton_hopper", lambda: hopper_forward(q, k, v, causal=causal, softmax_scale=scale,
                                                             out_dtype=q.dtype, config=config),
                      config=str(config), max_abs_diff=diff)
            torch.cuda.empty_cache()

    print(f"{'D':>4} {'causal':>6} {'impl':<16} {args.direction[:3] + ' TF/s':>8} {'diff':>9}  config")
    for row in rows:
        tflops = row.get("fwd_tflops", row.get("bwd_tflops"))
        tflops = f"{tflops:8.1f}" if tflops is not None else "   error"
        diff = f"{row['max_abs_diff']:9.2e}" if "max_abs_diff" in row else " " * 9
        print(f"{row['head_dim']:>4} {str(row['causal']):>6} {row['impl']:<16} {tflops} {diff}  "
              f"{row.get('config', '')}{row.get('error', '')[:100]}")
    return 0


def _sweep_backward(timed, record, point, q, k, v, dout, causal, scale, select, deadline):
    """The portable backward and cuDNN's (aten's op on heads-major copies made beforehand, from its own forward's
    out/lse; H = Hkv only), then each Gluon backward config, from the Gluon forward's out/lse; bf16 gradients timed,
    float32 ones compared with the portable kernel's."""
    import torch

    from torch_impl.kernels.portable.backward import portable_backward
    from torch_impl.kernels.hopper.backward import hopper_backward
    from torch_impl.kernels.hopper.forward import hopper_forward

    out, lse = hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=q.dtype)
    want = portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, grad_dtype=torch.float32)
    timed("triton_portable", lambda: portable_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                                     grad_dtype=q.dtype))
    if k.shape[2] == q.shape[2]:
        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, dout))
        cudnn_out, cudnn_lse = cudnn(qt, kt, vt, None, True, 0.0, causal, False, scale=scale)[:2]
        rng = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed/offset: read only with dropout
        timed("sdpa_cudnn", lambda: torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dot, qt, kt, vt, cudnn_out, cudnn_lse, rng, rng, None, None, None, q.shape[1], k.shape[1], 0.0, causal,
            scale=scale))
    for config in selected_candidates(backward_candidates(q.shape[-1], causal), select):
        if time.monotonic() > deadline:
            record(impl="triton_hopper", **point, config=str(config), error=BUDGET_SPENT)
            continue
        try:
            got = hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                  grad_dtype=torch.float32, config=config)
            diff = max((g - w).abs().max().item() for g, w in zip(got, want))
        except Exception as err:
            record(impl="triton_hopper", **point, config=str(config), error=f"{type(err).__name__}: {err}"[:300])
            continue
        timed("triton_hopper", lambda: hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                                      grad_dtype=q.dtype, config=config),
              config=str(config), max_abs_diff=diff)


if __name__ == "__main__":
    raise SystemExit(main())
