"""The JAX train step's memory plan (XLA's, compiled for abstract inputs on the 4 emulated host devices): with
activation checkpointing, the temporaries stay within a bound computed from the parameter count and the
activation sizes, and the structure before issue 19 (the whole compute-dtype model gathered before the first
layer, `StepSpec.gather_per_layer=False`) exceeds it: the negative control that shows the bound can fail."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jax_impl.parallel import make_mesh
from jax_impl.train import StepSpec, memory_plan
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


def _temporaries(remat: str, gather_per_layer: bool = True) -> int:
    spec = StepSpec(config=CONFIG, mesh=make_mesh(MESH), dtype="bf16", remat=remat, attention_backend="reference",
                    ring_variant="ring", loss_chunk_tokens=128, optimizer=OptimizerConfig(),
                    gather_per_layer=gather_per_layer)
    return memory_plan(spec, batch=1, seq_len=SEQ_LEN)["temporaries"]


def _bound() -> float:
    """Per device: the fp32 gradient shards and the compute-dtype shards of the weights and of their gradients
    (what the step must hold, divided over the devices); one layer's weights gathered in the compute dtype and its
    gradient in fp32 (the checkpointed layer being recomputed and differentiated); and an allowance of 8 hidden
    states per layer in fp32 for the saved activations (a layer input, the attention's output: bf16, but the CPU
    compile upcasts) and the working set of one layer and one loss chunk. Measured: 71 MiB with per-layer
    gathers (save-attention; full: 70), bound 116 MiB, 192 MiB for the old structure (which adds the whole model
    in bf16, 61 MiB, and its gradients)."""
    shapes = parameter_shapes(CONFIG)
    params = sum(int(np.prod(shape)) for shape in shapes.values())
    devices = MESH.size
    state = (4 + 2 * COMPUTE_BYTES) * params / devices
    one_layer = (COMPUTE_BYTES + 4) * params / CONFIG.num_layers
    activations = 8 * CONFIG.num_layers * (SEQ_LEN // devices) * CONFIG.hidden_size * 4
    return state + one_layer + activations


@pytest.mark.parametrize("remat", ["save-attention", "full"])
def test_checkpointed_step_plans_within_the_bound(remat):
    assert _temporaries(remat) < _bound()


def test_gathering_the_whole_model_first_exceeds_the_bound():
    # by half the bound at least: the old structure is far above it, not a near miss that noise could flip
    assert _temporaries("save-attention", gather_per_layer=False) > 1.5 * _bound()
