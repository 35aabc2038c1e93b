"""One-GPU check of the Hopper Triton path (issue 13): correctness of every path against a float64 oracle (rule:
error <= 2x a naive same-dtype implementation + 1e-4), the ring's external-LSE backward, and timings of the
Hopper configs against the portable kernels, cuDNN and FA2 (triton.testing.do_bench, median). Prints a table and
writes hopper_check.json under $OUT. Run from the repository root: python compare/results/hopper_check.py [stage..]
(stages: correct, sweep, compare; all by default)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from torch_impl.attention import reference_attention
from torch_impl.flash_attention import flash_attention, flash_attention_backward, flash_attention_forward
from torch_impl.flash_hopper_backward import backward_configs, hopper_backward
from torch_impl.flash_hopper_forward import forward_configs, hopper_forward
from weights.flops import attention_flops

# The float64 oracle and the autograd harness are the kernel tests' own, so that this check and the CPU/GPU tests
# judge the kernels by one definition. tests/ is not a package: its modules import each other by bare name.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import test_flash_attention_torch as kernel_tests  # noqa: E402

exact, with_grads = kernel_tests._exact, kernel_tests._with_grads

OUT = os.environ.get("OUT", ".")
RESULTS = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "argv": sys.argv}, "correct": [], "sweep": [], "compare": []}
NAMES = ("out", "lse", "dq", "dk", "dv")


def save():
    with open(os.path.join(OUT, "hopper_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)


def inputs(b, sq, sk, h, hkv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)]
    return [torch.randn(s, generator=g, device="cuda").to(dtype) for s in shapes]


def errors(result, ref):
    errs = {}
    for n in NAMES:
        got, want = result[n].double(), ref[n]
        fin = torch.isfinite(want)
        errs[n] = float((got - want)[fin].abs().max().detach()) if fin.any() else 0.0
        if not torch.equal(torch.isfinite(got), fin):
            errs[n] = float("nan")
    return errs


def ring_grads(q, k, v, dout, causal, scale, backend):
    """Gradients summed over two key chunks from the global out/lse, as a ring step computes them."""
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)
    half = k.shape[1] // 2
    n = q.shape[1] // 2
    dq = torch.zeros(q.shape, dtype=torch.float32, device="cuda")
    dk = torch.zeros(k.shape, dtype=torch.float32, device="cuda")
    dv = torch.zeros(v.shape, dtype=torch.float32, device="cuda")
    # (query rows, key rows, causal): chunk pairs of a 2-way ring over Sq == Sk.
    pairs = ([(slice(0, n), slice(0, half), True), (slice(n, None), slice(0, half), False),
              (slice(n, None), slice(half, None), True)] if causal else
             [(slice(None), slice(0, half), False), (slice(None), slice(half, None), False)])
    for rows, keys, pair_causal in pairs:
        g = flash_attention_backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                     lse[:, :, rows].contiguous(), causal=pair_causal, softmax_scale=scale,
                                     backend=backend)
        dq[:, rows] += g[0]
        dk[:, keys] += g[1]
        dv[:, keys] += g[2]
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def stage_correct():
    cases = [(1, 1000, 1000, 8, 2, 128, True, torch.bfloat16), (1, 777, 1200, 8, 2, 128, False, torch.bfloat16),
             (1, 1200, 777, 4, 4, 64, True, torch.bfloat16), (2, 1024, 1024, 4, 4, 64, False, torch.bfloat16),
             (1, 1000, 1000, 8, 2, 128, True, torch.float16), (1, 2048, 2048, 8, 8, 128, True, torch.bfloat16)]
    for b, sq, sk, h, hkv, d, causal, dtype in cases:
        q, k, v, dout = inputs(b, sq, sk, h, hkv, d, dtype)
        scale = 1 / math.sqrt(d)
        ref = exact(q, k, v, dout, causal, scale)
        naive = errors(with_grads(lambda *x: reference_attention(*x, causal=causal, softmax_scale=scale,
                                                                 return_lse=True), q, k, v, dout), ref)
        for backend in ("triton_hopper", "triton_portable", "triton", "sdpa_cudnn"):
            row = dict(case=[b, sq, sk, h, hkv, d, causal, str(dtype)], backend=backend)
            try:
                got = errors(with_grads(lambda *x: flash_attention(*x, causal=causal, softmax_scale=scale,
                                                                   return_lse=True, backend=backend),
                                        q, k, v, dout), ref)
                row.update(errors=got, naive=naive,
                           ok=all(got[n] <= 2 * naive[n] + 1e-4 for n in NAMES))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            RESULTS["correct"].append(row)
            print("correct", row, flush=True)
        if sq == sk and sq % 2 == 0:
            for backend in ("triton_hopper", "triton_portable"):
                row = dict(case=[b, sq, sk, h, hkv, d, causal, str(dtype)], backend=backend, ring=True)
                try:
                    got = errors(ring_grads(q, k, v, dout, causal, scale, backend), ref)
                    row.update(errors=got, naive=naive, ok=all(got[n] <= 2 * naive[n] + 1e-4 for n in NAMES))
                except Exception as err:
                    row["error"] = f"{type(err).__name__}: {err}"[:300]
                RESULTS["correct"].append(row)
                print("ring", row, flush=True)
        save()


def tflops(ms, s, causal, h, d, backward_only=False, fwdbwd=False):
    flops = attention_flops(1, h, s, s, d, causal, fwdbwd)
    if backward_only:
        flops = attention_flops(1, h, s, s, d, causal, True) - attention_flops(1, h, s, s, d, causal, False)
    return flops / (ms * 1e-3) / 1e12


def stage_sweep(s=16384, h=32, hkv=32, d=128, causal=True):
    q, k, v, dout = inputs(1, s, s, h, hkv, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    ref_out, ref_lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale,
                                               backend="triton_portable")
    ref_grads = flash_attention_backward(dout, q, k, v, ref_out, ref_lse, causal=causal, softmax_scale=scale,
                                         backend="triton_portable")
    for cfg in forward_configs(d):
        row = dict(kind="fwd", S=s, hkv=hkv, d=d, causal=causal, config=str(cfg))
        try:
            t0 = time.time()
            out, lse = hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=q.dtype, config=cfg)
            row["compile_s"] = time.time() - t0
            row["max_diff_vs_portable"] = float((out.float() - ref_out.float()).abs().max())
            ms = do_bench(lambda: hopper_forward(q, k, v, causal=causal, softmax_scale=scale, out_dtype=q.dtype,
                                                 config=cfg), warmup=10, rep=40, return_mode="median")
            row.update(ms=ms, tflops=tflops(ms, s, causal, h, d))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        RESULTS["sweep"].append(row)
        print("sweep", row, flush=True)
        save()
    sweep_backward(q, k, v, dout, ref_out, ref_lse, ref_grads, h, causal)


def sweep_backward(q, k, v, dout, out, lse, ref_grads, h, causal):
    """Each backward config on the same inputs: compile time, max relative difference to `ref_grads` (float32
    gradients) and the median time of a q.dtype backward."""
    s, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    scale = 1 / math.sqrt(d)
    for cfg in backward_configs(d):
        row = dict(kind="bwd", S=s, hkv=hkv, d=d, causal=causal, config=str(cfg))
        try:
            t0 = time.time()
            grads = hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                    grad_dtype=torch.float32, config=cfg)
            row["compile_s"] = time.time() - t0
            row["max_rel_diff_vs_portable"] = [float((a - b).abs().max() / b.abs().max())
                                               for a, b in zip(grads, ref_grads)]
            ms = do_bench(lambda: hopper_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                                  grad_dtype=q.dtype, config=cfg),
                          warmup=10, rep=40, return_mode="median")
            row.update(ms=ms, tflops=tflops(ms, s, causal, h, d, backward_only=True))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        RESULTS["sweep"].append(row)
        print("sweep", row, flush=True)
        save()


def stage_bwd_sweep(s=16384, h=32, hkv=32, d=128, causal=True):
    """The backward configs against the portable backward, same inputs, same timing."""
    from torch_impl.flash_backward import triton_backward

    q, k, v, dout = inputs(1, s, s, h, hkv, d, torch.bfloat16)
    scale = 1 / math.sqrt(d)
    out, lse = flash_attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend="triton_portable")
    ref = triton_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, grad_dtype=torch.float32)
    ms = do_bench(lambda: triton_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                          grad_dtype=q.dtype), warmup=10, rep=40, return_mode="median")
    RESULTS["sweep"].append(dict(kind="bwd", S=s, hkv=hkv, d=d, causal=causal, config="portable", ms=ms,
                                 tflops=tflops(ms, s, causal, h, d, backward_only=True)))
    print("sweep", RESULTS["sweep"][-1], flush=True)
    sweep_backward(q, k, v, dout, out, lse, ref, h, causal)


def stage_compare(points=((65536, True, 32), (65536, False, 32), (65536, True, 8)), h=32, d=128,
                  impls=("triton_hopper", "sdpa_cudnn")):
    for s, causal, hkv in points:
        for impl in impls:
            row = dict(impl=impl, S=s, causal=causal, hkv=hkv, d=d)
            try:
                if impl.startswith("triton"):
                    shape = [(1, s, n, d) for n in (h, hkv, hkv)]

                    def attend(q, k, v):
                        return flash_attention(q, k, v, causal=causal, backend=impl)
                else:
                    shape = [(1, n, s, d) for n in (h, hkv, hkv)]
                    backend = SDPBackend.CUDNN_ATTENTION if impl == "sdpa_cudnn" else SDPBackend.FLASH_ATTENTION

                    def attend(q, k, v):
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                  enable_gqa=hkv != h)
                leaves = [torch.randn(*x, device="cuda", dtype=torch.bfloat16, requires_grad=True) for x in shape]
                dout = torch.randn_like(leaves[0])
                fwd = do_bench(lambda: attend(*leaves), warmup=10, rep=50, return_mode="median")
                fwdbwd = do_bench(lambda: attend(*leaves).backward(dout), warmup=10, rep=50, return_mode="median",
                                  grad_to_none=leaves)
                row.update(fwd_ms=fwd, fwdbwd_ms=fwdbwd, fwd_tflops=tflops(fwd, s, causal, h, d),
                           fwdbwd_tflops=tflops(fwdbwd, s, causal, h, d, fwdbwd=True))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            RESULTS["compare"].append(row)
            print("compare", row, flush=True)
            save()
            torch.cuda.empty_cache()


def main():
    stages = sys.argv[1:] or ["sweep", "correct", "compare"]
    for stage in stages:
        try:
            {"correct": stage_correct, "sweep": stage_sweep, "bwd_sweep": stage_bwd_sweep,
             "compare": stage_compare}[stage]()
        except Exception:
            traceback.print_exc()
    print("\n== correctness (ok = within 2x naive error + 1e-4)")
    for r in RESULTS["correct"]:
        print(r["case"], r["backend"], "ring" if r.get("ring") else "", r.get("ok", r.get("error")))
    print("\n== sweep")
    for r in RESULTS["sweep"]:
        print(r["kind"], r["config"], f"{r.get('tflops', float('nan')):.0f} TF/s", r.get("error", ""))
    print("\n== compare (TF/s fwd / fwd+bwd)")
    for r in RESULTS["compare"]:
        print(r["impl"], r["S"], "causal" if r["causal"] else "full", r["hkv"],
              f"{r.get('fwd_tflops', float('nan')):.0f} / {r.get('fwdbwd_tflops', float('nan')):.0f}",
              r.get("error", ""))
    save()


if __name__ == "__main__":
    main()
