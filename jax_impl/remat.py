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

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class _Kind:
    """The layers of one kind in every run of `CheckpointedLayers`: checkpointed or kept, `count` of them per run
    from the run's layer `first` on."""
    checkpointed: bool
    first: int
    count: int


def checkpointed_scan(layer: Callable[[jax.Array, Any], jax.Array], x: jax.Array, weights: Any, *, mode: str,
                      dtype: Any = None, gather: Callable[[jax.Array], jax.Array] | None = None,
                      layers: CheckpointedLayers | None = None) -> jax.Array:
    """`layer(x, w)` applied for each layer's `w` of the pytree of stacks `weights` ([num_layers, ...] leaves),
    the calls `layers` names (`weights.parallel.checkpointed_layers`; None: all) checkpointed as `mode` says, each
    weight cast to `dtype` and then passed through `gather` (both optional) inside the layer.

    A scan over `layers`' runs of layers, and inside each run one scan over its checkpointed layers and one over its
    kept ones (a kind with one layer a run is called without a scan), each layer reading its weights from the
    stacks by index: no run's weights are copied. Where every layer is alike (all checkpointed or all kept) and
    `dtype` is the stacks' (or None), the scan of layers is JAX's to transpose; otherwise the backward is the
    scan's own (`jax.custom_vjp`). Its forward keeps each layer's residuals but not its weights, which the
    backward casts and gathers again; it walks the layers in reverse, one at a time (one layer's recomputation and
    backward values live at a time), writing each layer's weight gradients by index into compute-dtype stacks
    that are cast to the weights' dtype once at the end. The scan this replaced ran each run's layers as a
    Python loop in its body, whose backward held every layer's backward values and weight gradients of the run at
    once: the bf16 8B step at 32k on 2 devices planned 218 GiB of temporaries with 1 checkpointed layer in 32 (one
    run of 32 layers), 102 with 4, against 65 with none; now 70 and 62
    (compare/results/remat-runs-plan-2026-11-29-cpu/RUN.md)."""
    num_layers = jax.tree.leaves(weights)[0].shape[0]
    layers = layers or CheckpointedLayers(num_layers, 1, 1)
    cast = (lambda w: w) if dtype is None else (lambda w: w.astype(dtype))
    gather = gather or (lambda w: w)
    kinds = [kind for kind in (_Kind(True, 0, layers.checkpointed_per_group),
                               _Kind(False, layers.checkpointed_per_group,
                                     layers.group_size - layers.checkpointed_per_group)) if kind.count]

    def prepare(w):
        return jax.tree.map(lambda leaf: gather(cast(leaf)), w)

    def call_of(fn, checkpointed: bool):  # one layer's call, checkpointed as `mode` says or kept
        return checkpointed_layer(fn, mode=mode) if checkpointed else kept_layer(fn)

    if layers.group_size == 1 and (dtype is None or all(jnp.dtype(dtype) == leaf.dtype
                                                        for leaf in jax.tree.leaves(weights))):
        # nothing narrower to return the gradients in and one kind of layer: JAX's transpose of the plain scan
        # (the weights prepared inside the checkpoint, never saved for the backward). It plans less there: the
        # custom backward planned 58.1 GiB of temporaries against 51.3 for the 8B fp32 step at 32k on 2 devices
        # with every layer checkpointed, 132.3 against 127.3 with none. (Runs mixing both kinds are the custom
        # backward's whatever the dtype: JAX's transpose of the scans below planned 176.2 GiB with 4 checkpointed
        # layers, the custom backward 124.6.)
        step = call_of(lambda x, w: layer(x, prepare(w)), kinds[0].checkpointed)
        return jax.lax.scan(lambda x, w: (step(x, w), None), x, weights)[0]

    def layer_weights(weights, i):
        return jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, i, keepdims=False), weights)

    def over_layers(visit, carry, per_run=None, reverse=False):
        """`carry` through every layer in order (or `reverse`): `visit(kind, carry, i, slot, run_value)` for layer
        i, `slot` its place among its kind's layers, `run_value` the outer scan's xs entry of a kind with one layer
        a run (`per_run`'s entry for the kind, or None). Returns (carry, {kind.checkpointed: what `visit` returned
        beside the carry for a kind with one layer a run, stacked over the runs})."""
        def run(carry, xs):
            group, per_run = xs
            outs = {}
            for kind in reversed(kinds) if reverse else kinds:
                first = group * layers.group_size + kind.first
                if kind.count == 1:
                    carry, outs[kind.checkpointed] = visit(kind, carry, first, group, per_run.get(kind.checkpointed))
                    continue

                def one(carry, j, kind=kind, first=first):
                    return visit(kind, carry, first + j, group * kind.count + j, None)[0], None
                carry = jax.lax.scan(one, carry, jnp.arange(kind.count), reverse=reverse)[0]
            return carry, outs
        return jax.lax.scan(run, carry, (jnp.arange(layers.groups), per_run or {}), reverse=reverse)

    def run_plain(x, weights):  # the scan without gradients (the weights prepared inside the checkpoint)
        def visit(kind, x, i, slot, run_value):
            return call_of(lambda x, w: layer(x, prepare(w)), kind.checkpointed)(x, layer_weights(weights, i)), None
        return over_layers(visit, x)[0]

    layouts = {}  # per kind: the residuals' tree and which of them are the layer's weights (filled while tracing)

    def forward_layer(kind, x, weights, i):  # (the layer's output, its residuals other than its weights)
        prepared = prepare(layer_weights(weights, i))
        y, backward = jax.vjp(call_of(layer, kind.checkpointed), x, prepared)
        residuals, tree = jax.tree.flatten(backward)
        weight_leaves = jax.tree.leaves(prepared)
        sources = [next((j for j, leaf in enumerate(weight_leaves) if residual is leaf), None)
                   for residual in residuals]
        layouts[kind.checkpointed] = tree, sources
        return y, [residual for residual, source in zip(residuals, sources) if source is None]

    def run_forward(x, weights):
        # a kind with several layers a run writes their residuals by slot into zeroed buffers carried through the
        # scans: the inner scan's stacked outputs, as residuals, were copied by XLA (78 GiB of the 8B step at 32k
        # with 4 checkpointed layers); a kind with one layer a run returns them as the outer scan's outputs
        buffers = {kind.checkpointed: [jnp.zeros((layers.groups * kind.count, *r.shape), r.dtype) for r in
                                       jax.eval_shape(lambda x, w, kind=kind: forward_layer(kind, x, w, 0)[1],
                                                      x, weights)]
                   for kind in kinds if kind.count > 1}

        def visit(kind, carry, i, slot, run_value):
            x, buffers = carry
            y, residuals = forward_layer(kind, x, weights, i)
            if kind.count == 1:
                return (y, buffers), residuals
            written = [jax.lax.dynamic_update_index_in_dim(buffer, residual, slot, 0)
                       for buffer, residual in zip(buffers[kind.checkpointed], residuals)]
            return (y, {**buffers, kind.checkpointed: written}), None

        (y, buffers), per_run = over_layers(visit, (x, buffers))
        return y, (buffers, per_run, weights)

    def run_backward(saved, ct_y):
        buffers, per_run, weights = saved

        def visit(kind, carry, i, slot, run_value):
            ct, grads = carry
            kept = iter(run_value if kind.count == 1 else [jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False)
                                                           for buffer in buffers[kind.checkpointed]])
            prepared, gather_backward = jax.vjp(lambda w: jax.tree.map(gather, w),
                                                jax.tree.map(cast, layer_weights(weights, i)))
            weight_leaves = jax.tree.leaves(prepared)
            tree, sources = layouts[kind.checkpointed]
            residuals = [next(kept) if source is None else weight_leaves[source] for source in sources]
            ct, ct_prepared = jax.tree.unflatten(tree, residuals)(ct)
            grads = jax.tree.map(lambda stack, g: jax.lax.dynamic_update_index_in_dim(stack, g, i, 0),
                                 grads, gather_backward(ct_prepared)[0])
            return (ct, grads), None

        # the gradients in the compute dtype until the loop is done: half the stacks' bytes in bf16
        grads = jax.tree.map(lambda w: jnp.zeros(w.shape, w.dtype if dtype is None else dtype), weights)
        (ct_x, grads), _ = over_layers(visit, (ct_y, grads), per_run, reverse=True)
        return ct_x, jax.tree.map(lambda g, w: g.astype(w.dtype), grads, weights)

    run = jax.custom_vjp(run_plain)
    run.defvjp(run_forward, run_backward)
    return run(x, weights)
