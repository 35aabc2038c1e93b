"""Per-layer activation checkpointing (remat) for JAX: what a checkpointed decoder layer keeps for its backward.
Twin of `torch_impl/remat.py`. The modes, what each keeps and why: `weights.parallel.REMAT_MODES`.

`checkpointed_layer` wraps a layer in `jax.checkpoint`, for "save-attention" with a policy that saves the values
named by `keep_for_backward` (`checkpoint_name`). The attention custom_vjps (`jax_impl/kernels/flash_attention.py`,
`jax_impl/ring_attention.py`) name their forward's out and lse with it; their residuals q, k, v are recomputed
from the layer input, and XLA drops the attention forward that nothing then needs. Attention written as plain
autodiff math (`jax_impl/attention.py`) is not named, so with it both modes recompute the same.
With `--checkpointed-layers` (`weights.parallel.checkpointed_layers`) the layers outside the checkpointed ones run
as `kept_layer`s, and `checkpointed_scan` scans over runs of layers that mix both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from weights.parallel import CheckpointedLayers

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


def kept_layer(layer: Callable) -> Callable:
    """`layer` as a layer outside the checkpointed ones (`--checkpointed-layers`) runs: keeping its matmuls'
    outputs and the values `keep_for_backward` names (the attention's out and lse), from which XLA recomputes the
    elementwise work (norms, RoPE, SwiGLU) in the backward. Without a checkpoint XLA also keeps float32 elementwise
    intermediates: on 2 H200s the 8B step at 32k planned 3.7 GiB a layer against the torch twin's 1.5 (whose
    compiled elementwise regions keep about the matmuls' outputs too) and ran out of memory with 16 such layers."""
    policies = jax.checkpoint_policies
    return jax.checkpoint(layer, policy=policies.save_from_both_policies(
        policies.dots_saveable, policies.save_only_these_names(KEPT_FOR_BACKWARD)))


def checkpointed_scan(layer: Callable[[jax.Array, Any], jax.Array], x: jax.Array, weights: Any, *, mode: str,
                      dtype: Any = None, gather: Callable[[jax.Array], jax.Array] | None = None,
                      layers: CheckpointedLayers | None = None) -> jax.Array:
    """`layer(x, w)` applied for each layer's `w` of the pytree of stacks `weights` ([num_layers, ...] leaves),
    the calls `layers` names (`weights.parallel.checkpointed_layers`; None: all) checkpointed as `mode` says, each
    weight cast to `dtype` and then passed through `gather` (both optional) inside the layer; see the module
    docstring for the backward, which is JAX's own where `dtype` is the stacks' (or None). The scan runs over
    `layers`' runs of layers, one run per iteration: the stacks reshaped to [groups, group_size, ...] (a view;
    runs of one layer scan the stacks as they are). Inside a run, XLA recomputes its checkpointed layers together
    in the run's backward (as for the Python loop of checkpointed layers the scan replaced, `jax_impl/model.py`):
    a run with several of them holds their activations at once for a while."""
    num_layers = jax.tree.leaves(weights)[0].shape[0]
    layers = layers or CheckpointedLayers(num_layers, 1, 1)
    cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
    gather = gather or (lambda w: w)
    if layers.group_size == 1:
        runs, split = weights, lambda w: [w]
    else:
        runs = jax.tree.map(lambda w: w.reshape(layers.groups, layers.group_size, *w.shape[1:]), weights)
        split = lambda w: [jax.tree.map(lambda leaf: leaf[i], w) for i in range(layers.group_size)]  # noqa: E731
    kept_layout = {}  # the residuals' tree and which of them are the layer's weights (filled while tracing fwd)

    def prepare(w):
        return jax.tree.map(lambda leaf: gather(cast(leaf)), w)

    def run_layers(step_of):  # a run: its layers' weights in order, `step_of(checkpointed)` making each call
        def run(x, layer_weights):
            for index, w in enumerate(layer_weights):
                x = step_of(layers.checkpointed(index))(x, w)
            return x
        return run

    def call_of(fn, checkpointed: bool):  # one layer's call, checkpointed as `mode` says or kept
        return checkpointed_layer(fn, mode=mode) if checkpointed else kept_layer(fn)

    def run_plain(x, runs):  # the weights prepared inside the checkpoint: never saved for the backward
        step = run_layers(functools.partial(call_of, lambda x, w: layer(x, prepare(w))))
        return jax.lax.scan(lambda x, w: (step(x, split(w)), None), x, runs)[0]

    if dtype is None or all(jnp.dtype(dtype) == leaf.dtype for leaf in jax.tree.leaves(weights)):
        # nothing narrower to return the gradients in: JAX's transpose (measured: the custom backward planned
        # 8.5 GiB more for the 8B fp32 step at 32k on 2 devices)
        return run_plain(x, runs)
    run = jax.custom_vjp(run_plain)
    step = run_layers(functools.partial(call_of, layer))

    def forward_run(x, w):
        prepared = [prepare(layer_weights) for layer_weights in split(w)]
        y, backward = jax.vjp(step, x, prepared)
        residuals, tree = jax.tree.flatten(backward)
        weight_leaves = jax.tree.leaves(prepared)
        sources = [next((("weight", i) for i, leaf in enumerate(weight_leaves) if residual is leaf), None)
                   for residual in residuals]
        kept = [residual for residual, source in zip(residuals, sources) if source is None]
        kept_layout.update(tree=tree, sources=sources)
        return y, kept

    def run_forward(x, runs):
        y, kept = jax.lax.scan(forward_run, x, runs)
        return y, (kept, runs)

    def backward_run(ct_y, run_residuals):
        kept, w = run_residuals
        cast_w = jax.tree.map(cast, w)
        prepared, gather_backward = jax.vjp(lambda w: [jax.tree.map(gather, lw) for lw in split(w)], cast_w)
        weight_leaves, kept = jax.tree.leaves(prepared), iter(kept)
        residuals = [next(kept) if source is None else weight_leaves[source[1]]
                     for source in kept_layout["sources"]]
        ct_x, ct_prepared = jax.tree.unflatten(kept_layout["tree"], residuals)(ct_y)
        return ct_x, gather_backward(ct_prepared)[0]

    def run_backward(residuals, ct_y):
        kept, runs = residuals
        ct_x, ct_runs = jax.lax.scan(backward_run, ct_y, (kept, runs), reverse=True)
        return ct_x, jax.tree.map(lambda ct, w: ct.astype(w.dtype), ct_runs, runs)

    run.defvjp(run_forward, run_backward)
    return run(x, runs)
