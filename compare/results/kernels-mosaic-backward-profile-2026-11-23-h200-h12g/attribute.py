"""Where the Mosaic backward's time goes (task h12g; `python3 attribute.py OUT_DIR [--quick]` from the repository root).

Times `jax_impl.flash_hopper_backward.mosaic_backward` alone (bf16, B=1, H=Hkv=32, S=16k, causal, D=128; median
of 10 calls after 2 warm-ups; credited TFLOP/s = 2.5 forwards) for the two-kernel and one-kernel forms, and for
variants that drop one piece of a one-kernel step at a time. The pieces are dropped at trace time by
substituting module attributes of `flash_hopper_backward` (its `plgpu`, `jnp`, `_matmul_tn_sum`, `_dq_call`,
`_dkdv_kernel`), so the kernel source stays as committed; dropped pieces give wrong gradients (timing only).
Then, at S=2k with H=Hkv=16 (a trace that fits shared memory), one call of each form with Mosaic GPU's
in-kernel profiler (`plgpu.CompilerParams(profile_space, profile_dir)`), which records the kernel's
`jax.named_scope` regions per warpgroup; summarised as each region's share of the compute warpgroups' time.
With --call2: the private-dQ one-kernel form's variants and profile instead, then each form's backward alone
and fwd+bwd beside JAX cuDNN at D 128 and 64, causal and full (`compare_forms`).
Writes OUT_DIR/attribution.json and prints a table."""

import dataclasses
import functools
import glob
import json
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from compare.bench.kernel_bench import jax_median_ms
from jax_impl import flash_hopper_backward as fhb
from jax_impl.flash_hopper_forward import default_config, mosaic_forward
from weights.flops import attention_flops


class Proxy(types.SimpleNamespace):
    """A module stand-in: `overrides` first, then the module's own attributes."""
    def __init__(self, base, **overrides):
        super().__init__(**overrides)
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)


SKIP = object()  # stands in for the ds_ready barrier / ds_smem of a variant that drops them


def _copy(src, dst, *args, reduction_op=None, **kw):
    if reduction_op is None:
        return plgpu.copy_smem_to_gmem(src, dst, *args, **kw)


def _arrive(ref, *a, **kw):
    return None if ref is SKIP else plgpu.barrier_arrive(ref, *a, **kw)


def _wait(ref, *a, **kw):
    return None if ref is SKIP else plgpu.barrier_wait(ref, *a, **kw)


class _NoStore:
    """ds_smem of a variant without the dS store: every view swallows writes."""
    def __getattr__(self, name):
        return self

    def __getitem__(self, idx):
        return self

    def __setitem__(self, idx, value):
        pass


def _zeros_tn(pairs, *, interpret):
    _, b = pairs[0]  # dS^T tiles are square in the one-kernel form (bwd_block_q == bwd_block_kv)
    return plgpu.layout_cast(jnp.zeros(b.shape, jnp.float32), plgpu.Layout.WGMMA)


def patches(drop: set[str], profile: tuple[int, str] | None):
    """Module attributes of flash_hopper_backward for a variant dropping `drop`."""
    plgpu_over, out = {}, {}
    if "reduce_add" in drop:
        plgpu_over["copy_smem_to_gmem"] = _copy
    if "dq_mma" in drop:
        out["_matmul_tn_sum"] = _zeros_tn
    if "dq_kernel" in drop:
        out["_dq_call"] = lambda inputs, dq_shape, **kw: jnp.zeros(dq_shape, jnp.float32)
    if "exp2" in drop:
        out["jnp"] = Proxy(jnp, exp2=lambda x: x)
    if drop & {"ds_barrier", "ds_store"}:
        plgpu_over |= dict(barrier_arrive=_arrive, barrier_wait=_wait)
        kernel = fhb._dkdv_kernel

        def dkdv(*args, ds_ready, ds_smem, **kw):
            return kernel(*args, ds_ready=SKIP if "ds_barrier" in drop else ds_ready,
                          ds_smem=_NoStore() if "ds_store" in drop else ds_smem, **kw)
        out["_dkdv_kernel"] = dkdv
    if profile is not None:
        space, path = profile
        plgpu_over["CompilerParams"] = lambda **kw: plgpu.CompilerParams(**kw, profile_space=space,
                                                                         profile_dir=path)
    if plgpu_over:
        out["plgpu"] = Proxy(plgpu, **plgpu_over)
    return out


def call(config, drop, profile, *args, causal=True):
    saved = {name: getattr(fhb, name) for name in patches(drop, profile)}
    jax.clear_caches()
    try:
        for name, value in patches(drop, profile).items():
            setattr(fhb, name, value)
        fn = jax.jit(functools.partial(fhb.mosaic_backward, causal=causal, softmax_scale=args[1].shape[-1] ** -0.5,
                                       config=config, interpret=False))
        jax.block_until_ready(fn(*args))  # traced with the patches in place
    finally:
        for name, value in saved.items():
            setattr(fhb, name, value)
    return fn


def inputs(s, h, d):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (1, s, h, d), jnp.bfloat16) for key in keys)
    out, lse = mosaic_forward(q, k, v, causal=True, softmax_scale=d ** -0.5, out_dtype=jnp.dtype(jnp.bfloat16),
                              config=default_config(d), interpret=False)
    return dout, q, k, v, out, lse


PRIVATE = {"bwd_form": "one_kernel_private"}
VARIANTS_2 = [  # call 2: the private-dQ one-kernel form (after call 1 found the shared form's dQ wgmma the cost)
    ("two_kernel", {}, set()),
    ("one_kernel", {"bwd_form": "one_kernel"}, set()),
    ("one_kernel_private", PRIVATE, set()),
    ("one_kernel_private no overlap", PRIVATE | {"bwd_overlap": False}, set()),
    ("one_kernel_private -reduce_add", PRIVATE, {"reduce_add"}),
    ("one_kernel_private -dq_mma", PRIVATE, {"dq_mma"}),
    ("one_kernel_private -reduce_add -dq_mma", PRIVATE, {"reduce_add", "dq_mma"}),
]
VARIANTS = [  # call 1: (label, config changes, dropped pieces)
    ("two_kernel", {}, set()),
    ("two_kernel dkdv only", {}, {"dq_kernel"}),
    ("two_kernel dkdv only, no exp2", {}, {"dq_kernel", "exp2"}),
    ("two_kernel dkdv only, no overlap", {"bwd_overlap": False}, {"dq_kernel"}),
    ("one_kernel", {"bwd_form": "one_kernel"}, set()),
    ("one_kernel no overlap", {"bwd_form": "one_kernel", "bwd_overlap": False}, set()),
    ("one_kernel -reduce_add", {"bwd_form": "one_kernel"}, {"reduce_add"}),
    ("one_kernel -reduce_add -dq_mma", {"bwd_form": "one_kernel"}, {"reduce_add", "dq_mma"}),
    ("one_kernel -reduce_add -dq_mma -barrier", {"bwd_form": "one_kernel"}, {"reduce_add", "dq_mma", "ds_barrier"}),
    ("one_kernel -reduce_add -dq_mma -barrier -ds_store", {"bwd_form": "one_kernel"},
     {"reduce_add", "dq_mma", "ds_barrier", "ds_store"}),
    ("one_kernel -dq_mma (reduce-add kept)", {"bwd_form": "one_kernel"}, {"dq_mma"}),
    ("one_kernel -barrier (races)", {"bwd_form": "one_kernel"}, {"ds_barrier"}),
    ("one_kernel no overlap -reduce_add -dq_mma", {"bwd_form": "one_kernel", "bwd_overlap": False},
     {"reduce_add", "dq_mma"}),
]


def summarise_trace(path):
    """Per region: summed duration over compute-warpgroup traces / summed span of those traces."""
    events = json.load(open(path))["traceEvents"]
    per_tid, open_at = {}, {}
    for e in events:
        tid = e["tid"]
        span = per_tid.setdefault(tid, {"first": e["ts"], "last": e["ts"], "regions": {}})
        span["last"] = e["ts"]
        key = (tid, e["name"])
        if e["ph"] == "B":
            open_at.setdefault(key, []).append(e["ts"])
        else:
            start = open_at[key].pop()
            span["regions"][e["name"]] = span["regions"].get(e["name"], 0.0) + e["ts"] - start
    total = sum(s["last"] - s["first"] for s in per_tid.values())
    names = sorted({n for s in per_tid.values() for n in s["regions"]})
    return {"traces": len(per_tid), "span_sum": total,
            "share": {n: sum(s["regions"].get(n, 0.0) for s in per_tid.values()) / total for n in names}}


def compare_forms(d, causal, forms, repeats=10):
    """Backward alone (mosaic_backward) per form, and fwd+bwd (flash_attention under jax.grad) per form and JAX
    cuDNN (whose backward alone is fwd+bwd minus its forward), bf16, B=1, H=Hkv=32, S=16k."""
    from jax_impl.flash_attention import flash_attention
    s, h = 16384, 32
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (1, s, h, d), jnp.bfloat16) for key in keys)
    out, lse = mosaic_forward(q, k, v, causal=causal, softmax_scale=d ** -0.5, out_dtype=jnp.dtype(jnp.bfloat16),
                              config=default_config(d), interpret=False)
    fwd_flops = attention_flops(1, h, s, s, d, causal, backward=False)
    rows = []

    def fwdbwd_ms(attend):
        def loss(q, k, v, dout):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))
        return jax_median_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, dout, repeats=repeats)

    for form in forms:
        config = dataclasses.replace(default_config(d), bwd_form=form)
        row = dict(impl=f"mosaic {form}", head_dim=d, causal=causal, S=s, heads=h)
        try:
            fn = jax.jit(functools.partial(fhb.mosaic_backward, causal=causal, softmax_scale=d ** -0.5,
                                           config=config, interpret=False))
            row["bwd_ms"] = jax_median_ms(fn, dout, q, k, v, out, lse, repeats=repeats)
            row["fwdbwd_ms"] = fwdbwd_ms(functools.partial(flash_attention, causal=causal, backend="pallas_mosaic",
                                                           config=config))
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        rows.append(row)
    cudnn = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    row = dict(impl="jax_cudnn", head_dim=d, causal=causal, S=s, heads=h)
    try:
        row["fwd_ms"] = jax_median_ms(jax.jit(cudnn), q, k, v, repeats=repeats)
        row["fwdbwd_ms"] = fwdbwd_ms(cudnn)
        row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"[:400]
    rows.append(row)
    for row in rows:
        for key, flops in (("bwd", 2.5 * fwd_flops), ("fwdbwd", 3.5 * fwd_flops)):
            if f"{key}_ms" in row:
                row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
        print(json.dumps(row), flush=True)
    return rows


def main():
    out_dir = sys.argv[1]
    quick = "--quick" in sys.argv
    second = "--call2" in sys.argv
    s, h, d = (1024, 2, 128) if quick else (16384, 32, 128)
    args = inputs(s, h, d)
    flops = 2.5 * attention_flops(1, h, s, s, d, True, backward=False)
    base = default_config(d)
    rows = []
    for label, change, drop in (VARIANTS_2 if second else VARIANTS):
        row = dict(variant=label, S=s, heads=h, head_dim=d, causal=True)
        try:
            t0 = time.monotonic()
            fn = call(dataclasses.replace(base, **change), drop, None, *args)
            row["compile_s"] = time.monotonic() - t0
            row["ms"] = jax_median_ms(fn, *args, repeats=10)
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as err:  # a variant that fails is a result
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        print(json.dumps(row), flush=True)
        rows.append(row)
    profiles = []
    ps, ph = (1024, 2) if quick else (2048, 16)
    pargs = inputs(ps, ph, d)
    for form in ("one_kernel_private",) if second else ("two_kernel", "one_kernel"):
        path = os.path.join(out_dir, f"trace-{form}")
        os.makedirs(path, exist_ok=True)
        row = dict(form=form, S=ps, heads=ph, head_dim=d)
        try:
            steps = ps // base.bwd_block_q
            # the two-kernel form's dQ kernel has no shared memory left for a trace buffer: its dK/dV kernel alone
            call(dataclasses.replace(base, bwd_form=form), {"dq_kernel"} if form == "two_kernel" else set(),
                 (10 * steps + 16, path), *pargs)
            files = sorted(glob.glob(os.path.join(path, "*dkdv*trace.json")))
            row["file"] = os.path.basename(files[-1])
            row |= summarise_trace(files[-1])
            for f in glob.glob(os.path.join(path, "*.json")):
                os.remove(f)  # hundreds of MB: only the summary comes back
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:400]
        print(json.dumps(row), flush=True)
        profiles.append(row)
    forms = [row for d, causal in ((128, True), (128, False), (64, True), (64, False)) if second
             for row in compare_forms(d, causal, ("two_kernel", "one_kernel_private"))]
    json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows, "profiles": profiles,
               "forms": forms},
              open(os.path.join(out_dir, "attribution.json"), "w"), indent=1)
    print(f"{'variant':52s} {'ms':>7s} {'TF/s':>6s}")
    for r in rows:
        print(f"{r['variant']:52s} {r.get('ms', float('nan')):7.2f} {r.get('tflops', float('nan')):6.0f}"
              + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))
    print(f"{'D':>3s} {'causal':6s} {'impl':28s} {'bwd ms':>7s} {'bwd TF/s':>8s} {'f+b ms':>7s} {'f+b TF/s':>8s}")
    for r in forms:
        print(f"{r['head_dim']:3d} {str(r['causal']):6s} {r['impl']:28s} {r.get('bwd_ms', 0):7.2f} "
              f"{r.get('bwd_tflops', 0):8.0f} {r.get('fwdbwd_ms', 0):7.2f} {r.get('fwdbwd_tflops', 0):8.0f}"
              + (f"  ERROR {r['error'][:80]}" if "error" in r else ""))
    for p in profiles:
        print(p["form"], p.get("error", "")[:200] or " ".join(f"{n}={v:.3f}" for n, v in p["share"].items()))


if __name__ == "__main__":
    main()
