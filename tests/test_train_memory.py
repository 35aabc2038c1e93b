"""The JAX train step's memory plan (XLA's, compiled for abstract inputs on the 4 emulated host devices): with
activation checkpointing, the temporaries stay within a bound computed from the parameter count and the
activation sizes, and the structure before issue 19 (the whole compute-dtype model gathered before the first
layer, `StepSpec.layer_weights="whole-model"`) exceeds it: the negative control that shows the bound can fail.
The scan over the layers runs over the training state's own stacked fp32 shards: the step holds no compute-dtype
copy of that stack, which issue 19's first fix ("stacked-copy") made: that structure plans a stack more."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_impl.parallel import make_mesh
from jax_impl.memory_plan import memory_plan
from jax_impl.train import StepSpec
from weights import parameter_shapes, preset
from weights.parallel import MeshShape
from weights.schedule import OptimizerConfig

MESH = MeshShape(fsdp=1, sp=4)
SEQ_LEN = 1024
# Weights dominate the activations here, as in the long-context 8B step, so that where the weights live shows:
# ~32M parameters, 256 tokens per device.
CONFIG = dataclasses.replace(preset("tiny"), hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=4,
                             num_kv_heads=2, head_dim=128, vocab_size=512)
COMPUTE_BYTES = 2  # bf16


def _spec(remat: str, layer_weights: str = "in-layer") -> StepSpec:
    return StepSpec(config=CONFIG, mesh=make_mesh(MESH), dtype="bf16", remat=remat, attention_backend="reference",
                    ring_variant="ring", loss_chunk_tokens=128, optimizer=OptimizerConfig(),
                    layer_weights=layer_weights)


def _temporaries(remat: str, layer_weights: str = "in-layer") -> int:
    return memory_plan(_spec(remat, layer_weights), batch=1, seq_len=SEQ_LEN)["temporaries"]


def _bound() -> float:
    """Per device: the fp32 gradient shards (what the step must hold, divided over the devices); one layer's
    weights gathered in the compute dtype and its gradient in fp32 (the checkpointed layer being recomputed and
    differentiated); and an allowance of 8 hidden states per layer in fp32 for the saved activations (a layer
    input, the attention's output: bf16, but the CPU compile upcasts) and the working set of one layer and one
    loss chunk. Measured: 57 MiB (save-attention; full: 54), bound 85 MiB, 208 MiB for the structure before issue
    19 (which adds the whole model in bf16, 61 MiB, and its gradients)."""
    shapes = parameter_shapes(CONFIG)
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    gradients = 4 * params / MESH.size
    one_layer = (COMPUTE_BYTES + 4) * params / CONFIG.num_layers
    activations = 8 * CONFIG.num_layers * (SEQ_LEN // MESH.size) * CONFIG.hidden_size * 4
    return gradients + one_layer + activations


@pytest.mark.parametrize("remat", ["save-attention", "full"])
def test_checkpointed_step_plans_within_the_bound(remat):
    assert _temporaries(remat) < _bound()


def test_gathering_the_whole_model_first_exceeds_the_bound():
    # by half the bound at least: the old structure is far above it, not a near miss that noise could flip
    assert _temporaries("save-attention", layer_weights="whole-model") > 1.5 * _bound()


def test_the_layer_scan_keeps_no_compute_dtype_stack_of_the_weights():
    """The structure of issue 19's first fix ("stacked-copy": the stacked weights cast to the compute dtype before
    the layers) holds that stack beside what the step now holds: measured 71.6 MiB against 56.6, one stack of
    15.0 MiB more (full checkpointing: 69.4 against 54.4). Three quarters of a stack at least: a copy that came
    back would fail, scheduling noise of a few MiB would not."""
    layer_params = sum(int(np.prod(shape)) for name, shape in parameter_shapes(CONFIG).items()
                       if name.startswith("layers."))
    stack = COMPUTE_BYTES * layer_params / MESH.size
    assert _temporaries("save-attention", "stacked-copy") - _temporaries("save-attention") > 0.75 * stack
