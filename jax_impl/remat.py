"""Per-layer activation checkpointing (remat) for JAX: what a checkpointed decoder layer keeps for its backward.
Twin of `torch_impl/remat.py`. The modes, what each keeps and why: `weights.parallel.REMAT_MODES`.

`checkpointed_layer` wraps a layer in `jax.checkpoint`, for "save-attention" with a policy that saves the values
named by `keep_for_backward` (`checkpoint_name`). The attention custom_vjps (`jax_impl/flash_attention.py`,
`jax_impl/ring_attention.py`) name their forward's out and lse with it; their residuals q, k, v are recomputed
from the layer input, and XLA drops the attention forward that nothing then needs. Attention written as plain
autodiff math (`jax_impl/attention.py`) is not named, so with it both modes recompute the same.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

KEPT_FOR_BACKWARD = "twinflash_kept_for_backward"  # the checkpoint_name of the values "save-attention" keeps


def keep_for_backward(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`arrays` unchanged, named so that a "save-attention" checkpointed layer keeps them for its backward."""
    return tuple(checkpoint_name(array, KEPT_FOR_BACKWARD) for array in arrays)


def checkpointed_layer(layer: Callable, *, mode: str) -> Callable:
    """`layer` under `jax.checkpoint` as `mode` ("full" or "save-attention") says; see the module docstring."""
    if mode == "full":
        return jax.checkpoint(layer)
    if mode != "save-attention":
        raise ValueError(f"a checkpointed layer's mode is 'full' or 'save-attention', got {mode!r}")
    return jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names(KEPT_FOR_BACKWARD))
