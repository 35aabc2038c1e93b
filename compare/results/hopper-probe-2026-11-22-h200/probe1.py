"""GPU probe for the Mosaic kernels: API check, correctness vs reference, timings vs cuDNN (not committed)."""
import inspect, json, os, sys, traceback, math, difflib
import jax, jax.numpy as jnp, numpy as np
OUT = os.environ.get("OUT", ".")
log = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "checks": [], "timings": []}
def tail(e): return "".join(traceback.format_exception(e))[-2500:]
import jax.experimental.pallas.mosaic_gpu as plgpu
for name in ("kernel", "wgmma", "copy_smem_to_gmem", "copy_gmem_to_smem", "barrier_wait", "layout_cast", "SMEM", "Barrier", "CompilerParams"):
    try: print(name, inspect.signature(getattr(plgpu, name)))
    except Exception as e: print(name, "ERR", e)
print("has InterpretGPUParams", hasattr(plgpu, "InterpretGPUParams"), "force_gpu_interpret_mode", hasattr(plgpu, "force_gpu_interpret_mode"))
try:
    import jax.experimental.pallas.ops.gpu.attention_mgpu as am
    new = open(am.__file__).read().splitlines(); old = open(".probe/attention_mgpu_0.10.2.py").read().splitlines()
    d = list(difflib.unified_diff(old, new, "0.10.2", jax.__version__, lineterm=""))
    open(f"{OUT}/attention_mgpu_diff.txt", "w").write("\n".join(d)); print("attention_mgpu diff lines:", len(d)); print("\n".join(d[:60]))
except Exception as e: print("diff ERR", tail(e))
from jax_impl import flash_hopper_forward as HF
from jax_impl.attention import reference_attention_forward
def inputs(sq, sk, h, hkv, d, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(kk, s, dtype) for kk, s in zip(ks, [(1, sq, h, d), (1, sk, hkv, d), (1, sk, hkv, d)])]
for sq, sk, h, hkv, d, causal, odt in [(256, 256, 2, 2, 128, False, None), (256, 256, 2, 2, 128, True, None), (200, 333, 6, 2, 64, True, None),
        (333, 200, 3, 1, 64, True, None), (1000, 1000, 4, 1, 128, False, jnp.float32), (4096, 4096, 4, 4, 128, True, jnp.float32), (777, 4096, 4, 2, 64, True, None)]:
    q, k, v = inputs(sq, sk, h, hkv, d)
    try:
        o, l = HF.mosaic_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=odt or q.dtype, config=HF.default_config(d), interpret=False)
        ro, rl = reference_attention_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=jnp.float32)
        nq, nl = reference_attention_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=q.dtype)
        fin = jnp.isfinite(rl)
        rec = dict(shape=[sq, sk, h, hkv, d], causal=causal, out_dtype=str(odt), out_err=float(jnp.abs(o.astype(jnp.float32) - ro).max()),
                   naive_out_err=float(jnp.abs(nq.astype(jnp.float32) - ro).max()), lse_err=float(jnp.where(fin, jnp.abs(l - rl), 0).max()),
                   inf_match=bool((jnp.isinf(l) == jnp.isinf(rl)).all()), nan=bool(jnp.isnan(o.astype(jnp.float32)).any()))
    except Exception as e:
        rec = dict(shape=[sq, sk, h, hkv, d], causal=causal, error=tail(e))
    print("CHECK", json.dumps(rec)[:3000], flush=True); log["checks"].append(rec)
from probe_bench import bench
from weights.flops import attention_flops
for S in (16384, 65536):
    for causal in (True, False):
        for d in (128, 64):
            if d == 64 and S == 65536: continue
            q, k, v = inputs(S, S, 32, 32, d)
            fl = attention_flops(1, 32, S, S, d, causal, False)
            row = dict(S=S, causal=causal, D=d)
            for name, fn in [("mosaic", jax.jit(lambda q, k, v: HF.mosaic_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=q.dtype, config=HF.default_config(d), interpret=False)[0])),
                             ("cudnn", jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")))]:
                try: row[name] = fl / (bench(fn, q, k, v) * 1e-3) / 1e12
                except Exception as e: row[name] = "error: " + tail(e)[-600:]
            print("TIME", json.dumps(row), flush=True); log["timings"].append(row)
json.dump(log, open(f"{OUT}/probe1.json", "w"), indent=1)
for r in log["timings"]: print({k: (round(v) if isinstance(v, float) else v if not isinstance(v, str) else v[-200:]) for k, v in r.items()})
