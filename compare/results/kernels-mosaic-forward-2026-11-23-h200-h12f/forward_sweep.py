"""Forward-only timing of the Mosaic forward's candidate schedules against JAX cuDNN and tokamax, at issue 12's
points (the device calls of 2026-11-23, helper h12f). `compare.bench.pallas_sweep --family mosaic` times fwd+bwd
per candidate and keys forward timings by block sizes only, so it cannot tell the forward-only fields
(`compute_warpgroups`, `persistent`) apart; this times each forward on its own. One JSON object per line, all
rows to --out. Run from the repository root: python3 compare/results/<this folder>/forward_sweep.py --out X."""

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from compare.bench.kernel_bench import import_tokamax, jax_median_ms
from jax_impl.flash_attention import flash_attention_forward
from jax_impl.flash_hopper_forward import default_config
from weights.flops import attention_flops

CANDIDATES = {  # name: changes from default_config(D); the forward's fields only
    64: {"base": {}, "wg3": dict(compute_warpgroups=3), "kv256": dict(full_block_kv=256),
         "wg3-persistent": dict(full_compute_warpgroups=3, persistent=True),
         "kv256-persistent": dict(full_block_kv=256, persistent=True), "persistent": dict(persistent=True)},
    128: {"base": {}, "wg3": dict(full_compute_warpgroups=3), "persistent": dict(persistent=True),
          "wg3-persistent": dict(full_compute_warpgroups=3, persistent=True)},
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", default="16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--kv-heads", default="32,8")
    parser.add_argument("--causal", default="causal,full")
    parser.add_argument("--only", default="", help="candidate names to time (default: all)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=math.inf)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    try:
        tokamax = import_tokamax()
    except ImportError as err:
        tokamax = None
        print(json.dumps({"tokamax": f"skipped: {err}"[:200]}), flush=True)
    rows = []
    for s in map(int, args.seq_lens.split(",")):
        for d in map(int, args.head_dims.split(",")):
            for hkv in map(int, args.kv_heads.split(",")):
                for causal in (c == "causal" for c in args.causal.split(",")):
                    keys = jax.random.split(jax.random.key(0), 3)
                    q, k, v = (jax.random.normal(key, (1, s, heads, d), jnp.bfloat16)
                               for key, heads in zip(keys, (32, hkv, hkv)))
                    flops = attention_flops(1, 32, s, s, d, causal, backward=False)
                    impls = {"jax_cudnn": lambda q, k, v: jax.nn.dot_product_attention(
                        q, k, v, is_causal=causal, implementation="cudnn")}
                    if tokamax is not None:
                        impls["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
                            q, k, v, is_causal=causal, implementation="mosaic")
                    schedules = set()  # candidates whose forward is another's at this causality run once
                    for name, change in CANDIDATES[d].items():
                        config = dataclasses.replace(default_config(d), **change)
                        schedule = (config.block_q, config.num_stages, config.forward_schedule(causal))
                        if (args.only and name not in args.only.split(",")) or schedule in schedules:
                            continue
                        schedules.add(schedule)
                        impls[name] = lambda q, k, v, config=config: flash_attention_forward(
                            q, k, v, causal=causal, backend="pallas_mosaic", config=config)[0]
                    reference = None
                    for name, attend in impls.items():
                        row = dict(S=s, head_dim=d, kv_heads=hkv, heads=32, causal=causal, impl=name)
                        if time.monotonic() > deadline:
                            row["error"] = "skipped: --budget-s spent"
                        else:
                            try:
                                fn = jax.jit(attend)
                                out = np.asarray(fn(q, k, v), np.float32)
                                reference = out if reference is None else reference
                                ms = jax_median_ms(fn, q, k, v, repeats=args.repeats)
                                row |= dict(fwd_ms=ms, fwd_tflops=flops / (ms * 1e-3) / 1e12,
                                            max_abs_diff_vs_cudnn=float(np.max(np.abs(out - reference))))
                            except Exception as err:  # a candidate that fails to compile is a result
                                row["error"] = f"{type(err).__name__}: {err}"[:300]
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        with open(args.out, "w") as f:
                            json.dump(dict(command="forward_sweep.py " + " ".join(
                                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
                                           rows=rows), f, indent=1)
    print("S     D   Hkv causal  impl            fwd TF/s")
    for r in rows:
        print(f"{r['S']:<6}{r['head_dim']:<4}{r['kv_heads']:<4}{str(r['causal']):<8}{r['impl']:<16}"
              f"{r.get('fwd_tflops', float('nan')):7.1f} {r.get('error', '')[:60]}")


if __name__ == "__main__":
    main()
