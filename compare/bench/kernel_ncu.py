"""One attention forward+backward for Nsight Compute: `ncu --profile-from-start off ... python3 -m
compare.bench.kernel_ncu IMPL`. The call is made four times untimed (compiles, autotuning, caches), once timed by the
wall clock (printed), then once between cudaProfilerStart and cudaProfilerStop, so that ncu profiles exactly the
kernels of one forward+backward. bf16, batch 1, [B, S, H, D] inputs from a fixed seed. IMPL:
  triton  ours in torch: `flash_attention_forward` then `flash_attention_backward` (the ring's pair-level calls)
  pallas  ours in JAX: `jax.vjp` of `flash_attention` (backend "pallas"), jitted
  fa3     FlashAttention-3 through flash-attn3-jax's `flash_mha` (the `peers` extra), the same way
Results of a run: compare/results/kernels-gluon-backward-ncu-2026-11-29-h200/ (its RUN.md has the ncu command).
"""

from __future__ import annotations

import argparse
import sys
import time

from compare.args import OneLineParser, integer, with_error_contract
from compare.bench.kernel_peers import PEERS_INSTALL
from weights import BadInputError

IMPLS = ("triton", "pallas", "fa3")
NO_CUDA = "compare.bench.kernel_ncu needs a CUDA GPU: it profiles kernels that run there"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python3 -m compare.bench.kernel_ncu", description=__doc__.splitlines()[0])
    parser.add_argument("impl", choices=IMPLS)
    parser.add_argument("--seq-len", type=integer(1), default=16384)
    parser.add_argument("--heads", type=integer(1), default=32)
    parser.add_argument("--kv-heads", type=integer(1), default=32)
    parser.add_argument("--head-dim", type=integer(1), default=128)
    parser.add_argument("--causal", choices=("causal", "full"), default="causal")
    return parser


def torch_call(args):
    """A function running one forward+backward of ours in torch, finished when it returns."""
    import torch

    from torch_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    causal = args.causal == "causal"
    generator = torch.Generator(device="cuda").manual_seed(0)

    def inputs(heads):
        return torch.randn((1, args.seq_len, heads, args.head_dim), device="cuda", dtype=torch.bfloat16,
                           generator=generator)

    q, k, v, dout = inputs(args.heads), inputs(args.kv_heads), inputs(args.kv_heads), inputs(args.heads)

    def call():
        out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=None)
        flash_attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=None)
        torch.cuda.synchronize()

    return call


def jax_call(args):
    """The same for the JAX implementations (ours or FA3)."""
    import jax
    import jax.numpy as jnp

    causal = args.causal == "causal"
    if args.impl == "fa3":
        try:
            from flash_attn3_jax import flash_mha
        except ImportError as err:
            raise BadInputError(f"fa3: {err} (an optional peer: {PEERS_INSTALL})") from err

        def attend(q, k, v):
            return flash_mha(q, k, v, is_causal=causal)
    else:
        from jax_impl.kernels.flash_attention import flash_attention

        def attend(q, k, v):
            return flash_attention(q, k, v, causal=causal, backend="pallas")

    keys = jax.random.split(jax.random.key(0), 4)
    heads = (args.heads, args.kv_heads, args.kv_heads, args.heads)
    q, k, v, dout = (jax.random.normal(key, (1, args.seq_len, h, args.head_dim), jnp.bfloat16)
                     for key, h in zip(keys, heads))

    @jax.jit
    def step(q, k, v, dout):
        _, vjp = jax.vjp(attend, q, k, v)
        return vjp(dout)

    return lambda: jax.block_until_ready(step(q, k, v, dout))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return with_error_contract(lambda: _main(argv))


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.heads % args.kv_heads:
        raise BadInputError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    import torch  # its cudaProfilerStart/Stop (the CUDA runtime's), for any implementation

    if not torch.cuda.is_available():
        raise BadInputError(NO_CUDA)
    call = torch_call(args) if args.impl == "triton" else jax_call(args)

    for _ in range(4):
        call()
    start = time.perf_counter()
    call()
    print(f"{args.impl} S={args.seq_len} D={args.head_dim} {args.causal}: one forward+backward "
          f"{(time.perf_counter() - start) * 1e3:.2f} ms (wall clock)")
    torch.cuda.profiler.start()
    call()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
