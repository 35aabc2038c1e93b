"""Where a JAX train step's compilation goes on one GPU, and whether Mosaic GPU's per-process kernel cache can spare
a step the compilation of attention kernels compiled before (issue 14: compare's per-job setup).

`python -m compare.bench.jax_compile_profile [--model llama3.2-1b] [--seq-len 16384] [--out FILE.json]`, fsdp=1 x
sp=1 on the first GPU, bf16, nothing run: the seconds of (1) the ring attention's forward+backward lowered and
compiled alone, (2) the same again from a new lowering (a hit of Mosaic's cache, which keys compiled kernels by a
hash of their bytes, would make it fast), (3) the train step at that length (its kernels compiled before by 1),
(4) the step at half the length (nothing before), (5) the step with cuDNN attention; and how many of the step's
Mosaic kernel hashes the attention alone shares. A table last, JSON to --out.

`--check-layers N` times instead what compare's float32 equivalence check compiles first (`worker_jax.
check_loss_grads_and_logits`: the loss, its gradients and the logits of the model's first N layers, float32, at
`--check-precision` "highest" as the check runs on GPUs, or "default"), with `--check-attention` (pallas: ours;
reference: plain math), and nothing else: XLA's autotuning results are shared by every compilation of a process, so
an A/B of XLA_FLAGS (recorded in the JSON) or of these options takes one process each (on one H200 the check's 1B
shape spent 148 s in this compilation at 8 layers, compare/results/compare-jax-check-compile-2026-11-29-h200; at 4
layers 64.9 s, 10.4 s with XLA's autotuning off, which the check's own compiler options now ask: the JSON records
them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec

from compare.harness.worker_jax import CHECK_COMPILER_OPTIONS, check_loss_grads_and_logits
from jax_impl.memory_plan import abstract_inputs, lowered_step
from jax_impl.model import DTYPES
from jax_impl.parallel import make_mesh, ring_attention_fn
from jax_impl.train import step_spec
from weights.checkpoint import open_weights
from weights.parallel import ACTIVATION_SHARDING, MeshShape
from weights.settings import TrainSettings


def kernel_hashes(lowered) -> set[str]:
    """The `kernel_hash` attributes of the Mosaic GPU custom calls in a lowered function."""
    return set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', lowered.as_text()))


def timed(fn):
    began = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - began


def attention_lowered(mesh, config, seq_len: int):
    """The ring attention's forward and backward at a step's shapes (its output as its own cotangent), lowered."""
    attention = ring_attention_fn(mesh)
    sharding = NamedSharding(mesh, PartitionSpec(*ACTIVATION_SHARDING["hidden"][:2], None, None))
    q = jax.ShapeDtypeStruct((1, seq_len, config.num_heads, config.head_dim), DTYPES["bf16"], sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, seq_len, config.num_kv_heads, config.head_dim), DTYPES["bf16"], sharding=sharding)

    def forward_and_backward(q, k, v):
        out, pullback = jax.vjp(attention, q, k, v)
        return pullback(out)
    return jax.jit(forward_and_backward).lower(q, kv, kv)


def step_lowered(model: str, seq_len: int, backend: str, mesh):
    settings = TrainSettings(backend="jax", model=model, seq_len=seq_len, steps=1, batch=1, mesh=MeshShape(),
                             dtype="bf16", attention_backend=backend)
    return lowered_step(step_spec(settings, open_weights(model).config, mesh), 1, seq_len)


def check_lowered(model: str, layers: int, seq_len: int, attention: str, precision: str, mesh):
    """The float32 equivalence check's loss, gradients and logits (compare's JAX worker) for the first `layers`
    layers of `model`, lowered for abstract inputs."""
    settings = TrainSettings(backend="jax", model=model, seq_len=seq_len, steps=1, batch=1, mesh=MeshShape(),
                             dtype="fp32", attention_backend=attention)
    config = dataclasses.replace(open_weights(model).config, num_layers=layers)
    spec = step_spec(settings, config, mesh)
    params, tokens, positions = abstract_inputs(spec, 1, seq_len)
    with jax.default_matmul_precision(None if precision == "default" else precision):
        return check_loss_grads_and_logits.lower(params, tokens, tokens, positions, spec=spec, with_logits=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3.2-1b")
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--check-layers", type=int)
    parser.add_argument("--check-attention", choices=("pallas", "reference"), default="pallas")
    parser.add_argument("--check-precision", choices=("highest", "default"), default="highest")
    parser.add_argument("--out")
    args = parser.parse_args()
    mesh = make_mesh(MeshShape(), jax.devices()[:1])
    if args.check_layers:
        lowered, lower_s = timed(lambda: check_lowered(args.model, args.check_layers, args.seq_len,
                                                       args.check_attention, args.check_precision, mesh))
        _, compile_s = timed(lowered.compile)
        result = {"model": args.model, "seq_len": args.seq_len, "layers": args.check_layers,
                  "attention": args.check_attention, "precision": args.check_precision,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""), "compiler_options": dict(CHECK_COMPILER_OPTIONS),
                  "lowered_s": lower_s, "compiled_s": compile_s,
                  "jax": jax.__version__, "device": jax.devices()[0].device_kind}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        print(json.dumps(result))
        return
    config = open_weights(args.model).config
    rows = {}
    ahead, rows["attention lowered"] = timed(lambda: attention_lowered(mesh, config, args.seq_len))
    _, rows["attention compiled"] = timed(ahead.compile)
    again, rows["attention lowered again"] = timed(lambda: attention_lowered(mesh, config, args.seq_len))
    _, rows["attention compiled again"] = timed(again.compile)
    step, rows["step lowered (kernels ahead)"] = timed(lambda: step_lowered(args.model, args.seq_len, "pallas", mesh))
    _, rows["step compiled (kernels ahead)"] = timed(step.compile)
    other_len = args.seq_len // 2
    cold, rows["step lowered (other length)"] = timed(lambda: step_lowered(args.model, other_len, "pallas", mesh))
    _, rows["step compiled (other length)"] = timed(cold.compile)
    vendor, rows["step lowered (cuDNN)"] = timed(lambda: step_lowered(args.model, args.seq_len, "cudnn", mesh))
    _, rows["step compiled (cuDNN)"] = timed(vendor.compile)
    step_kernels, ahead_kernels = kernel_hashes(step), kernel_hashes(ahead)
    result = {"model": args.model, "seq_len": args.seq_len, "other_seq_len": other_len, "seconds": rows,
              "step_kernels": len(step_kernels), "ahead_kernels": len(ahead_kernels),
              "step_kernels_ahead": len(step_kernels & ahead_kernels), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    for name, seconds in rows.items():
        print(f"{name:34s} {seconds:7.2f} s")
    print(f"Mosaic kernels: step {len(step_kernels)}, ahead {len(ahead_kernels)}, shared "
          f"{len(step_kernels & ahead_kernels)}")


if __name__ == "__main__":
    main()
