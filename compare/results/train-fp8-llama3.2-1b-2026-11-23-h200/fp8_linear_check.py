"""One FP8 linear of the 1B MLP shape (32k tokens, 2048 -> 8192) forward + backward on one GPU: which GEMM
custom calls XLA compiled and the time, against the bf16 einsum. Prints one JSON line."""
import json, re, sys, time
import jax, jax.numpy as jnp
from jax_impl.model import fp8_matmul, quantise

def _direct(a, b, contract, batch=((), ())):
    return jax.lax.dot_general(a, b, (contract, batch), preferred_element_type=jnp.float32)

@jax.custom_vjp
def fp8_direct(x, w):  # the form before: dot of the float8 arrays, the float32 product rescaled after
    x_q, xs = quantise(x, "float8_e4m3fn"); w_q, ws = quantise(w, "float8_e4m3fn")
    return (_direct(x_q, w_q, ((2,), (1,))) * (1 / xs * (1 / ws))).astype(x.dtype)

def _fwd(x, w):
    return fp8_direct(x, w), (x, w)

def _bwd(res, g):
    x, w = res
    g_q, gs = quantise(g, "float8_e4m3fn"); w_q, ws = quantise(w, "float8_e4m3fn"); x_q, xs = quantise(x, "float8_e4m3fn")
    dx = (_direct(g_q, w_q, ((2,), (0,))) * (1 / gs * (1 / ws))).astype(x.dtype)
    dw = (_direct(g_q, x_q, ((0, 1), (0, 1))) * (1 / gs * (1 / xs)).reshape(())).astype(w.dtype)
    return dx, dw

fp8_direct.defvjp(_fwd, _bwd)

tokens, d_in, d_out = 32768, 2048, 8192
key = jax.random.key(0)
x = jax.random.normal(key, (1, tokens, d_in), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (d_out, d_in), jnp.bfloat16) * 0.02
g = jax.random.normal(jax.random.key(2), (1, tokens, d_out), jnp.bfloat16)

def step(fn):
    def f(x, w, g):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(g))
    return jax.jit(f)

result = {}
for name, fn in (("fp8", lambda x, w: fp8_matmul(x, w, (1, 1))), ("fp8_direct", fp8_direct),
                 ("bf16", lambda x, w: jnp.einsum("bti,oi->bto", x, w))):
    compiled = step(fn).lower(x, w, g).compile()
    text = compiled.as_text()
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    fusions = len(re.findall(r"\bfusion\(", text))
    for _ in range(3):
        jax.block_until_ready(compiled(x, w, g))
    began = time.perf_counter()
    for _ in range(20):
        out = compiled(x, w, g)
    jax.block_until_ready(out)
    result[name] = {"ms": (time.perf_counter() - began) / 20 * 1e3, "custom_calls": calls, "fusions": fusions}
print(json.dumps(result))
