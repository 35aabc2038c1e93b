"""XLA's memory plan of the JAX train step: what `jax_impl/train.py`'s step would hold per device, from a compile for
abstract inputs, before any weight is read or GPU spent (`twinflash train --plan-memory`, the memory tests). JAX's
alone: torch allocates as it runs and has no plan to read."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_impl.parallel import activation_sharding, make_mesh, parameter_shardings, state_shapes
from jax_impl.train import StepSpec, step_scalars, step_spec, train_step
from weights import open_weights
from weights.settings import TrainSettings
from weights.training import adamw_coefficients, check_attention_backend


def step_memory_plan(settings: TrainSettings, devices: Sequence[jax.Device] | None = None) -> dict[str, int]:
    """XLA's plan of the train step of `settings` per device (`memory_plan`); no weights are read or made."""
    check_attention_backend(settings)
    mesh = make_mesh(settings.mesh, devices)
    config = open_weights(settings.model, settings.seed).config
    return memory_plan(step_spec(settings, config, mesh), settings.batch, settings.seq_len)


def memory_plan(spec: StepSpec, batch: int, seq_len: int) -> dict[str, int]:
    """XLA's plan of the train step of `spec` on a [batch, seq_len] batch per device, in bytes: "arguments" (the
    sharded training state and batch), "outputs", "aliased" (outputs reusing donated arguments) and "temporaries"
    (everything the step allocates while it runs). The step is compiled for abstract inputs (shapes and
    shardings): nothing is made or run, so a configuration can be checked before a GPU is spent on it. A plan
    compiled for CPU devices is larger than the GPU's (CPU fuses less and keeps bf16 work in fp32: before issue 19
    the 8B step at 32k tokens on 4 devices planned 127 GiB of temporaries plus 22 GiB of state on CPU and peaked
    at 82 GiB on an H200), so compare CPU plans with each other."""
    plan = lowered_step(spec, batch, seq_len).compile(_plan_compiler_options(spec.mesh)).memory_analysis()
    return {"arguments": plan.argument_size_in_bytes, "outputs": plan.output_size_in_bytes,
            "aliased": plan.alias_size_in_bytes, "temporaries": plan.temp_size_in_bytes}


def abstract_inputs(spec: StepSpec, batch: int, seq_len: int) -> tuple[dict, jax.ShapeDtypeStruct,
                                                                         jax.ShapeDtypeStruct]:
    """(float32 parameters, tokens [batch, seq_len], positions [seq_len]) of `spec`'s step as shapes and shardings,
    nothing made: what a function of the model is lowered for (targets take the tokens' shape)."""
    shapes = state_shapes(spec.config)
    shardings = parameter_shardings(spec.mesh, shapes)
    params = {name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=shardings[name])
              for name, shape in shapes.items()}
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=activation_sharding(spec.mesh, "tokens"))
    positions = jax.ShapeDtypeStruct((seq_len,), jnp.int32, sharding=activation_sharding(spec.mesh, "positions"))
    return params, tokens, positions


def lowered_step(spec: StepSpec, batch: int, seq_len: int) -> jax.stages.Lowered:
    """The train step of `spec` lowered for abstract inputs (`abstract_inputs`, with the optimizer state), ready to
    compile (also compare/bench/jax_compile_profile.py)."""
    params, tokens, positions = abstract_inputs(spec, batch, seq_len)
    state = {"model": params, "optimizer": {"exp_avg": params, "exp_avg_sq": params}}
    scalars = step_scalars(adamw_coefficients(spec.optimizer, 0))
    return train_step.lower(state, tokens, tokens, positions, scalars, spec=spec)


def _plan_compiler_options(mesh: Mesh) -> dict[str, str]:
    """XLA options of a planning compile. On CPU, XLA emulates each bf16 dynamic slice of the activations that the
    checkpointed layers saved (a slice per layer in the backward loop) on a float32 copy of the whole stack, and
    loop-invariant code motion then hoists that conversion out of the loop: two float32 copies of every layer's
    saved activations (16 GiB per device for the 8B step at 32k tokens on 2 devices) that a GPU, which slices
    bf16 natively, never makes. The plan leaves that pass out on CPU."""
    if mesh.devices.flat[0].platform != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
