"""Our attention kernels on packed documents, one GPU (`python -m compare.bench.document_kernels --framework
torch|jax`): the forward and the backward of the framework's pair functions as the ring calls them
(`flash_attention_forward` / `_backward`, gradients in float32) on the key spans of segment ids made once,
beside the same calls without them (causal over the whole sequence), the default kernel family either way (the
Hopper one on sm90: Gluon / Mosaic), bf16, batch 1. Documents: "corpus", one window of the stdlib files as
`twinflash train --pack` packs them (`weights.data.packed_text_batches`), and "short", uniform 32 to 512 tokens
(`compare.bench.document_balance.short_documents`).

TFLOP/s count the attention really done: 4 * H * D per attending pair, the causal pairs of each document counted
as FlashAttention counts a sequence, L^2 / 2 (`weights.documents.causal_pairs`; S^2 / 2 without documents), the
backward 2.5 forwards (`weights.flops.attention_flops`' convention), so a rate with documents and one without
compare at equal work. Timing as `bench kernels`: torch with triton.testing.do_bench (median, CUDA events), JAX with
block_until_ready around jitted calls (median after two warm-ups). Prints a Markdown table; writes its rows as
JSON to --out (default out/document-kernels-<framework>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

from compare.args import ints, lengths
from compare.bench.common import OUT_DIR, write_json
from compare.bench.document_balance import short_documents
from compare.bench.kernel_bench import jax_median_ms
from weights.data import BYTE_VOCAB, packed_text_batches
from weights.documents import causal_pairs

REPEATS = 20  # JAX calls timed per point


def segment_ids(documents: str, seq_len: int):
    """int32 [1, seq_len] segment ids of the "corpus" or "short" documents, or None for "none"."""
    if documents == "none":
        return None
    if documents == "short":
        return short_documents(1, seq_len, seed=0)
    return packed_text_batches(1, 1, seq_len, BYTE_VOCAB, seed=0)[1][0]


def attention_tflops(ms: float, ids, seq_len: int, heads: int, head_dim: int, backward: bool) -> float:
    """TFLOP/s of a call taking `ms` (module docstring: the attention really done)."""
    pairs = seq_len * seq_len / 2 if ids is None else float(causal_pairs(ids)[0])
    return 4.0 * heads * head_dim * pairs * (3.5 if backward else 1.0) / (ms * 1e-3) / 1e12


def torch_timings(seq_len, heads, kv_heads, head_dim, ids) -> tuple[float, float]:
    """(forward ms, forward + backward ms)."""
    import torch
    from triton.testing import do_bench

    from torch_impl.documents import document_spans
    from torch_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    q, k, v, dout = (torch.randn(1, seq_len, h, head_dim, device="cuda", dtype=torch.bfloat16)
                     for h in (heads, kv_heads, kv_heads, heads))
    spans = None if ids is None else document_spans(torch.from_numpy(ids).cuda(), causal=False)

    def forward():
        return flash_attention_forward(q, k, v, causal=True, softmax_scale=None, spans=spans)
    out, lse = forward()
    forward_ms = do_bench(forward, return_mode="median")
    backward_ms = do_bench(lambda: flash_attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=None,
                                                            spans=spans), return_mode="median")
    return forward_ms, forward_ms + backward_ms


def jax_timings(seq_len, heads, kv_heads, head_dim, ids) -> tuple[float, float]:
    """(forward ms, forward + backward ms)."""
    import jax
    import jax.numpy as jnp

    from jax_impl.documents import document_spans
    from jax_impl.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (1, seq_len, h, head_dim), jnp.bfloat16)
                     for key, h in zip(keys, (heads, kv_heads, kv_heads, heads)))
    spans = None if ids is None else document_spans(jnp.asarray(ids), causal=False)
    forward = jax.jit(lambda q, k, v, spans: flash_attention_forward(q, k, v, causal=True, spans=spans))
    backward = jax.jit(lambda dout, q, k, v, out, lse, spans: flash_attention_backward(
        dout, q, k, v, out, lse, causal=True, spans=spans))
    out, lse = forward(q, k, v, spans)
    forward_ms = jax_median_ms(forward, q, k, v, spans, repeats=REPEATS)
    return forward_ms, forward_ms + jax_median_ms(backward, dout, q, k, v, out, lse, spans, repeats=REPEATS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("torch", "jax"), required=True)
    parser.add_argument("--seq-lens", type=lengths, default=(16384, 32768), help="e.g. 16k,32k")
    parser.add_argument("--head-dims", type=ints, default=(64, 128))
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.framework == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    timings = torch_timings if args.framework == "torch" else jax_timings
    rows = []
    print("| S | D | documents | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s |\n|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        for head_dim in args.head_dims:
            for documents in ("none", "corpus", "short"):
                ids = segment_ids(documents, seq_len)
                fwd_ms, fwdbwd_ms = timings(seq_len, args.heads, args.kv_heads, head_dim, ids)
                row = {"framework": args.framework, "seq_len": seq_len, "head_dim": head_dim, "heads": args.heads,
                       "kv_heads": args.kv_heads, "documents": documents, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                       "fwd_tflops": attention_tflops(fwd_ms, ids, seq_len, args.heads, head_dim, False),
                       "fwdbwd_tflops": attention_tflops(fwdbwd_ms, ids, seq_len, args.heads, head_dim, True)}
                rows.append(row)
                print(f"| {seq_len} | {head_dim} | {documents} | {fwd_ms:.2f} | {row['fwd_tflops']:.0f} | "
                      f"{fwdbwd_ms:.2f} | {row['fwdbwd_tflops']:.0f} |", flush=True)
    date = datetime.date.today().isoformat()
    write_json(args.out or OUT_DIR / f"document-kernels-{args.framework}-{date}.json", {"rows": rows})


if __name__ == "__main__":
    main()
