"""GPU probe 2: Mosaic backward correctness + fwd / fwd+bwd timings (not committed)."""
import json, os, sys, traceback
import jax, jax.numpy as jnp
OUT = os.environ.get("OUT", ".")
log = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "checks": [], "timings": []}
def tail(e): return "".join(traceback.format_exception(e))[-1500:]
from jax_impl import flash_hopper_forward as HF
from jax_impl.flash_attention import flash_attention, flash_attention_forward, flash_attention_backward
from jax_impl.attention import reference_attention_forward, reference_attention_backward
from weights.flops import attention_flops
def inputs(sq, sk, h, hkv, d, dtype=jnp.bfloat16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(kk, s, dtype) for kk, s in zip(ks, [(1, sq, h, d), (1, sk, hkv, d), (1, sk, hkv, d), (1, sq, h, d)])]
for sq, sk, h, hkv, d, causal in [(1000, 1000, 4, 1, 128, False), (4096, 4096, 4, 4, 128, True), (256, 256, 2, 2, 128, True), (333, 200, 3, 1, 64, True), (777, 2048, 6, 2, 64, True), (2048, 2048, 8, 2, 128, False)]:
    q, k, v, do = inputs(sq, sk, h, hkv, d)
    rec = dict(shape=[sq, sk, h, hkv, d], causal=causal)
    try:
        o, l = flash_attention_forward(q, k, v, causal=causal, out_dtype=jnp.float32, backend="pallas_mosaic")
        ro, rl = reference_attention_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=jnp.float32)
        rec["fwd_fp32out_err"] = float(jnp.abs(o - ro).max())
        g = flash_attention_backward(do, q, k, v, ro, rl, causal=causal, backend="pallas_mosaic")
        rg = reference_attention_backward(do, q, k, v, ro, rl, causal=causal, softmax_scale=d ** -0.5)
        tg = flash_attention_backward(do, q, k, v, ro, rl, causal=causal, backend="pallas_triton")
        rec["bwd_err"] = [float(jnp.abs(a - b).max()) for a, b in zip(g, rg)]
        rec["triton_bwd_err"] = [float(jnp.abs(a - b).max()) for a, b in zip(tg, rg)]
        rec["nan"] = any(bool(jnp.isnan(a).any()) for a in g)
    except Exception as e:
        rec["error"] = tail(e)
    print("CHECK", json.dumps(rec)[:2500], flush=True); log["checks"].append(rec)
if "checks" in sys.argv:
    json.dump(log, open(f"{OUT}/probe2_checks.json", "w"), indent=1); sys.exit(0)
from probe_bench import bench
def impls(causal, d):
    r = {b: (lambda b: lambda q, k, v: flash_attention(q, k, v, causal=causal, backend=b))(b) for b in ("pallas_mosaic", "pallas_triton")}
    r["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return r
points = [(16384, True, 32, 128), (16384, True, 8, 128), (65536, True, 32, 128), (16384, False, 32, 128), (16384, True, 32, 64)]
for S, causal, hkv, d in points:
    q, k, v, do = inputs(S, S, 32, hkv, d)
    row = dict(S=S, causal=causal, Hkv=hkv, D=d)
    for name, fn in impls(causal, d).items():
        loss = lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
        try:
            row[name + "_fwd"] = attention_flops(1, 32, S, S, d, causal, False) / (bench(jax.jit(fn), q, k, v) * 1e-3) / 1e12
            row[name + "_fwdbwd"] = attention_flops(1, 32, S, S, d, causal, True) / (bench(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v) * 1e-3) / 1e12
        except Exception as e:
            row[name] = "error: " + tail(e)[-500:]
    print("TIME", json.dumps(row), flush=True); log["timings"].append(row)
# config variants (forward block_kv / stages, backward stages) at 16k causal
for d in (64, 128):
    q, k, v, do = inputs(16384, 16384, 32, 32, d)
    for cfg in (HF.HopperConfig(block_kv=64), HF.HopperConfig(num_stages=3), HF.HopperConfig(bwd_num_stages=3), HF.HopperConfig(block_kv=64, num_stages=3)):
        row = dict(S=16384, causal=True, D=d, config=str(cfg))
        try:
            fn = lambda q, k, v: flash_attention_forward(q, k, v, causal=True, backend="pallas_mosaic", hopper_config=cfg)[0]
            row["fwd"] = attention_flops(1, 32, 16384, 16384, d, True, False) / (bench(jax.jit(fn), q, k, v) * 1e-3) / 1e12
            o, l = flash_attention_forward(q, k, v, causal=True, backend="pallas_mosaic")
            bw = lambda do, q, k, v, o, l: flash_attention_backward(do, q, k, v, o, l, causal=True, backend="pallas_mosaic", hopper_config=cfg)
            row["bwd_ms"] = bench(jax.jit(bw), do, q, k, v, o, l)
        except Exception as e:
            row["error"] = tail(e)[-400:]
        print("CFG", json.dumps(row), flush=True); log["timings"].append(row)
json.dump(log, open(f"{OUT}/probe2.json", "w"), indent=1)
for r in log["timings"]: print({k: (round(v) if isinstance(v, float) else v if not isinstance(v, str) else v[-150:]) for k, v in r.items()})
