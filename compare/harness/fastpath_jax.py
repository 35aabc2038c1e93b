"""The JAX backend's half of the fast path (compare/harness/fastpath.py) and of `--perturb`
(compare/harness/perturb.py), run by `worker_jax.py` in its process. Twin of `fastpath_torch.py`.

`attention`: the attention function the model is given (`jax_impl.parallel.ring_attention_fn` on the job's mesh,
its kernel, the run's ring variant and layout) under `jax.jit` on the fast path's inputs in bf16, global arrays in
the ring layout's order (batch over fsdp, sequence around sp, as the model's activations); out and the gradients
of <out, dout> for q, k and v (`jax.vjp`) written (float32, position order) to `<id>.safetensors`.
`ScaledAttention`: the attention perturbation, a wrapper around such a function, hashable (the train step's
`StepSpec.attention_wrapper`, part of its jit cache key); `perturb`: a job's perturbation applied to a built
training.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from compare.harness.fastpath import TENSORS, attention_inputs
from compare.harness.jobs import PERTURBATION, Job, SetupClock
from compare.harness import perturb as P
from compare.harness.perturb import attention_scaling, weight_scaling
from jax_impl.model import stack_layers, unstack_layers
from jax_impl.parallel import make_mesh, on_host, put_sharded, ring_attention_fn
from jax_impl.train import Training
from weights import open_weights
from weights.layout import inverse_order, layout_order
from weights.parallel import ACTIVATION_SHARDING, RING_LAYOUT


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scaled_gradient(x: jax.Array, factor: float) -> jax.Array:
    """The identity whose backward scales the gradient by `factor`."""
    return x


def _scaled_gradient_forward(x, factor):
    return x, None


def _scaled_gradient_backward(factor, _, grad):
    return (grad * factor,)


_scaled_gradient.defvjp(_scaled_gradient_forward, _scaled_gradient_backward)


class ScaledAttention(P.ScaledAttention):
    """The attention perturbation in JAX (`compare.harness.perturb.ScaledAttention`)."""

    constant = staticmethod(jax.lax.stop_gradient)
    scaled_gradient = staticmethod(_scaled_gradient)


def perturb(run: Training, value: str | None) -> None:
    """A job's perturbation (`Job.perturb`) on a built training: one weight scaled (the state stacks the layers'
    weights: perturbed by name, stacked again as it was), or its attention wrapped (in the step's spec)."""
    name, scaling = weight_scaling(value), attention_scaling(value)
    if name is not None:
        params = unstack_layers(run.state["model"])
        params[name] = params[name] * (1 + PERTURBATION)
        shardings = jax.tree.map(lambda p: p.sharding, run.state["model"])
        run.state["model"] = jax.device_put(stack_layers(params), shardings)
    if scaling is not None:
        run.spec = dataclasses.replace(run.spec, attention_wrapper=ScaledAttention(*scaling))


def attention(job: Job, work_dir: Path, devices: list, clock: SetupClock, host_arrays: dict) -> dict:
    """An "attention" job (module docstring)."""
    settings = job.settings()
    config = open_weights(job.model, job.seed).config
    mesh = make_mesh(settings.mesh, devices)
    fn = ring_attention_fn(mesh, backend=job.attention_backend, variant=settings.ring_variant)
    scaling = attention_scaling(job.perturb)
    if scaling is not None:
        fn = ScaledAttention(*scaling)(fn)
    inputs = attention_inputs(settings.batch, job.seq_len, config.num_heads, config.num_kv_heads, config.head_dim)
    clock.weights_loaded()
    order = layout_order(job.seq_len, settings.mesh.sp, RING_LAYOUT)

    @jax.jit
    def run(q, k, v, dout):
        out, backward = jax.vjp(fn, q, k, v)
        return (out, *backward(dout))

    # global arrays on the mesh, split as the model's activations are (a run spanning nodes holds no whole array)
    sharding = NamedSharding(mesh, PartitionSpec(*ACTIVATION_SHARDING["hidden"][:2], None, None))
    results = run(*(put_sharded(inputs[name][:, order].astype(jnp.bfloat16), sharding)
                    for name in ("q", "k", "v", "dout")))
    # C order: an index along axis 1 of a batch over 1 leaves strided arrays, which safetensors writes scrambled
    arrays = {name: np.ascontiguousarray(on_host(value.astype(jnp.float32))[:, inverse_order(order)])
              for name, value in zip(TENSORS, results)}
    save_file(arrays, str(work_dir / f"{job.id}.safetensors"))
    return {"status": "ok", "setup": clock.result()}
