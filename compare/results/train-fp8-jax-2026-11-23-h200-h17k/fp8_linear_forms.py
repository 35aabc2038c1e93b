"""Forms of one FP8 linear (weights/fp8.py's recipe) on one GPU: forward + both backward matmuls of the 1B MLP's
shape (32k tokens, 2048 -> 8192), with the tokens as one device block and as (fsdp, sp) = (1, 2) blocks. For each
form: the GEMM custom calls in XLA's optimised HLO (target and result type), the large float32 arrays the entry
computation materialises (a float32 GEMM product, a float32 dequantised operand), the first compile's time, the
time of 20 calls, and how far its three products are from main's form (bf16 ulps). Writes one JSON file (argv[1]).

    python3 fp8_linear_forms.py OUT.json [tokens in out]
    FORMS="name;name" (run only these, in this order) REFERENCE="name" (the products compared against; default:
    "main (1,1)" / "main (1,2)", jax_impl.model.fp8_matmul at the commit run) python3 fp8_linear_forms.py ...

A scaled GEMM takes float8 operands and their float32 inverse scales (scalars: XLA's GEMM rewriter folds only
scalar scales into cuBLASLt's FP8 GEMM); the forms differ in how they write it."""
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.model import fp8_matmul, quantise

F8 = "float8_e4m3fn"


def _dims(contract):
    return (contract, ((), ()))


# one scaled GEMM: a_q, b_q float8 2-D, a_inv, b_inv float32 scalars -> bf16
def direct_f32(a_q, a_inv, b_q, b_inv, contract):  # main's arithmetic with scalar scales
    p = jax.lax.dot_general(a_q, b_q, _dims(contract), preferred_element_type=jnp.float32)
    return (p * (a_inv * b_inv)).astype(jnp.bfloat16)


def direct_bf16(a_q, a_inv, b_q, b_inv, contract):  # the float8 dot straight to bf16, the scale after
    p = jax.lax.dot_general(a_q, b_q, _dims(contract), preferred_element_type=jnp.bfloat16)
    return (p.astype(jnp.float32) * (a_inv * b_inv)).astype(jnp.bfloat16)


def direct_bf16_bf16scale(a_q, a_inv, b_q, b_inv, contract):  # as flax's fp8_scaled_dot_general (bf16 scale)
    p = jax.lax.dot_general(a_q, b_q, _dims(contract), preferred_element_type=jnp.bfloat16)
    return p * (a_inv * b_inv).astype(jnp.bfloat16)


def qdq_bf16(a_q, a_inv, b_q, b_inv, contract):  # flax's qdq: dequantise to bf16, bf16 dot
    a = a_q.astype(jnp.bfloat16) * a_inv.astype(jnp.bfloat16)
    b = b_q.astype(jnp.bfloat16) * b_inv.astype(jnp.bfloat16)
    return jax.lax.dot_general(a, b, _dims(contract))


def qdq_f32(a_q, a_inv, b_q, b_inv, contract):  # dequantise to float32, float32 dot, cast after
    a, b = a_q.astype(jnp.float32) * a_inv, b_q.astype(jnp.float32) * b_inv
    return jax.lax.dot_general(a, b, _dims(contract), preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def qdq_f32_out_bf16(a_q, a_inv, b_q, b_inv, contract):  # dequantise to float32, the dot's result bf16
    a, b = a_q.astype(jnp.float32) * a_inv, b_q.astype(jnp.float32) * b_inv
    return jax.lax.dot_general(a, b, _dims(contract), preferred_element_type=jnp.bfloat16)


GEMMS = {f.__name__: f for f in (direct_f32, direct_bf16, direct_bf16_bf16scale, qdq_bf16, qdq_f32,
                                 qdq_f32_out_bf16)}


def _q(x):
    q, scale = quantise(x, F8)
    return q, (1 / scale).reshape(())


def loop_linear(gemm, blocks):
    """x [T, in] @ w.T with the tokens in `blocks` equal blocks, each scaled on its own (a Python loop: scalar
    scales each); dW the float32 sum of the blocks' bf16 dW."""
    @jax.custom_vjp
    def linear(x, w):
        w_q, w_inv = _q(w)
        return jnp.concatenate([gemm(*_q(xb), w_q, w_inv, ((1,), (1,))) for xb in jnp.split(x, blocks)])

    def fwd(x, w):
        return linear(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        w_q, w_inv = _q(w)
        dx, dw = [], jnp.zeros(w.shape, jnp.float32)
        for xb, gb in zip(jnp.split(x, blocks), jnp.split(g, blocks)):
            g_q, g_inv = _q(gb)
            dx.append(gemm(g_q, g_inv, w_q, w_inv, ((1,), (0,))))
            dw = dw + gemm(g_q, g_inv, *_q(xb), ((0,), (0,))).astype(jnp.float32)
        return jnp.concatenate(dx), dw.astype(w.dtype)

    linear.defvjp(fwd, bwd)
    return linear


def vmap_linear(gemm, blocks):
    """As loop_linear with the blocks as a vmap (a batched dot whose scales are [blocks] vectors)."""
    @jax.custom_vjp
    def linear(x, w):
        w_q, w_inv = _q(w)
        y = jax.vmap(lambda xb: gemm(*_q(xb), w_q, w_inv, ((1,), (1,))))(x.reshape(blocks, -1, x.shape[-1]))
        return y.reshape(x.shape[0], -1)

    def fwd(x, w):
        return linear(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        w_q, w_inv = _q(w)

        def block(xb, gb):
            g_q, g_inv = _q(gb)
            return gemm(g_q, g_inv, w_q, w_inv, ((1,), (0,))), gemm(g_q, g_inv, *_q(xb), ((0,), (0,)))

        dx, dw = jax.vmap(block)(x.reshape(blocks, -1, x.shape[-1]), g.reshape(blocks, -1, g.shape[-1]))
        return dx.reshape(x.shape), dw.astype(jnp.float32).sum(0).astype(w.dtype)

    linear.defvjp(fwd, bwd)
    return linear


def five_d_qdq(scalar_scale):
    """The dequantised form on main's 5-D device-block view (blocks (1, 1)), the scale keepdims-shaped [1]*5 (as
    branch fp8-dequant) or reshaped to a scalar: which of the two stops XLA's FP8 rewrite."""
    def q5(x):
        q, scale = quantise(x.reshape(1, 1, 1, *x.shape), F8, (1, 3, 4))
        inv = 1 / scale
        return q, inv.reshape(()) if scalar_scale else inv

    def dq(q, inv):
        return q.astype(jnp.float32) * inv

    @jax.custom_vjp
    def linear(x, w):
        x_q, x_inv = q5(x)
        w_q, w_inv = _q(w)
        y = jax.lax.dot_general(dq(x_q, x_inv), dq(w_q, w_inv), _dims(((4,), (1,))),
                                preferred_element_type=jnp.bfloat16)
        return y.reshape(x.shape[0], -1)

    def fwd(x, w):
        return linear(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        w_q, w_inv = _q(w)
        g_q, g_inv = q5(g)
        x_q, x_inv = q5(x)
        dx = jax.lax.dot_general(dq(g_q, g_inv), dq(w_q, w_inv), _dims(((4,), (0,))),
                                 preferred_element_type=jnp.bfloat16)
        dw = jax.lax.dot_general(dq(g_q, g_inv), dq(x_q, x_inv), _dims(((0, 1, 2, 3), (0, 1, 2, 3))),
                                 preferred_element_type=jnp.bfloat16)
        return dx.reshape(x.shape), dw

    linear.defvjp(fwd, bwd)
    return linear


def hlo_summary(text):
    """GEMM custom calls (target, result shapes) and the entry computation's materialised float32 arrays of at
    least 4M elements (opcode, shape)."""
    gemms, big_f32, fusions = [], [], 0
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\(", line)
        if not m:
            continue
        name, shape, opcode = m.groups()
        fusions += opcode == "fusion"
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if opcode == "custom-call" and target and ("blas" in target.group(1) or "gemm" in target.group(1)):
            gemms.append(f"{target.group(1)} -> {shape}")
        if "triton_gemm" in line or '"kind":"__triton' in line:
            gemms.append(f"triton fusion {name} -> {shape}")
        for dims in re.findall(r"f32\[([\d,]+)\]", shape):
            if int(np.prod([int(d) for d in dims.split(",")])) >= 1 << 22:
                big_f32.append(f"{opcode} {name}: f32[{dims}]")
    return {"gemms": gemms, "big_f32": big_f32, "fusions": fusions}


def ulps(value, reference):
    """Largest |value - reference| in bf16 ulps at the reference's largest magnitude (2^-8 of it: a per-element ulp
    would blow up where sums cancel), and the fraction of elements that differ."""
    v, r = (np.asarray(a, np.float32) for a in (value, reference))
    return {"max_ulp": float(np.max(np.abs(v - r)) / (np.max(np.abs(r)) * 2.0 ** -8)),
            "differ": float(np.mean(v != r))}


def main():
    out = sys.argv[1]
    tokens, d_in, d_out = (int(a) for a in sys.argv[2:5]) if len(sys.argv) > 4 else (32768, 2048, 8192)
    x = jax.random.normal(jax.random.key(0), (tokens, d_in), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (d_out, d_in), jnp.bfloat16) * 0.02
    g = jax.random.normal(jax.random.key(2), (tokens, d_out), jnp.bfloat16)

    forms = {"bf16 einsum": lambda x, w: jnp.einsum("ti,oi->to", x, w),
             "main (1,1)": lambda x, w: fp8_matmul(x[None], w, (1, 1))[0]}
    forms.update({f"2-D {name}": loop_linear(gemm, 1) for name, gemm in GEMMS.items()})
    forms["5-D qdq_f32_out_bf16, [1]*5 scale"] = five_d_qdq(False)
    forms["5-D qdq_f32_out_bf16, scalar scale"] = five_d_qdq(True)
    forms["main (1,2)"] = lambda x, w: fp8_matmul(x[None], w, (1, 2))[0]
    for name in ("qdq_f32_out_bf16", "qdq_bf16", "direct_bf16", "direct_f32"):
        forms[f"(1,2) loop {name}"] = loop_linear(GEMMS[name], 2)
    forms["(1,2) vmap qdq_f32_out_bf16"] = vmap_linear(GEMMS["qdq_f32_out_bf16"], 2)

    if os.environ.get("FORMS"):
        forms = {name: forms[name] for name in os.environ["FORMS"].split(";")}
    reference_name = os.environ.get("REFERENCE")

    def step(fn):
        def f(x, w, g):
            y, vjp = jax.vjp(fn, x, w)
            return (y, *vjp(g))
        return jax.jit(f)

    results, outputs = {}, {}
    for name, fn in forms.items():
        try:
            began = time.perf_counter()
            compiled = step(fn).lower(x, w, g).compile()
            compile_s = time.perf_counter() - began
            products = jax.block_until_ready(compiled(x, w, g))
            for _ in range(2):
                jax.block_until_ready(compiled(x, w, g))
            times = []
            for _ in range(2):
                began = time.perf_counter()
                for _ in range(20):
                    last = compiled(x, w, g)
                jax.block_until_ready(last)
                times.append((time.perf_counter() - began) / 20 * 1e3)
            reference = outputs.get(reference_name or ("main (1,2)" if "(1,2)" in name else "main (1,1)"), products)
            results[name] = {"ms": min(times), "ms_rounds": times, "compile_s": compile_s,
                             **hlo_summary(compiled.as_text()),
                             "vs_main": {k: ulps(a, b) for k, a, b in zip(("y", "dx", "dw"), products, reference)}}
            if name.startswith("main") or name == reference_name:
                outputs[name] = products
            del compiled, products, last
        except Exception as error:  # a form XLA or JAX refuses is a result too
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        print(name, json.dumps(results[name])[:600], flush=True)
    record = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
              "shape": {"tokens": tokens, "in": d_in, "out": d_out}, "forms": results}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"\n{'form':40s} {'ms':>7s} {'compile s':>9s}  y/dx/dw vs main (ulp@max)  GEMMs")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:40s} ERROR {r['error'][:80]}")
            continue
        u = "/".join(f"{r['vs_main'][k]['max_ulp']:.2f}" for k in ("y", "dx", "dw"))
        targets = ",".join(sorted({s.split(" -> ")[0].replace("__cublas$lt$matmul", "lt") + ":" +
                                   s.split(" -> ")[1][:5].strip("(") for s in r["gemms"]}))
        print(f"{name:40s} {r['ms']:7.2f} {r['compile_s']:9.1f}  {u:22s}  {targets} f32big={len(r['big_f32'])}")


if __name__ == "__main__":
    main()
