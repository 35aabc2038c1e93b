"""Per-layer activation checkpointing (remat) for PyTorch: what a checkpointed decoder layer keeps for its backward.
Twin of `jax_impl/remat.py`. The modes, what each keeps and why: `weights.parallel.REMAT_MODES`.

`checkpointed_layer` runs one layer under `torch.utils.checkpoint` (non-reentrant). For "save-attention" it gives
the checkpoint a pair of contexts (its `context_fn`): while the forward runs, `keep_for_backward` stores what it
computes; while the backward recomputes that layer, `keep_for_backward` hands the stored tensors back instead of
computing them. The attention autograd Functions (`torch_impl/kernels/flash_attention.py`,
`torch_impl/ring_attention.py`) wrap their forward work in `keep_for_backward`, the twin of the JAX backend's
`checkpoint_name`. Attention written as plain autograd math (`torch_impl/attention.py`) is not wrapped, so with it
both modes recompute the same.
With `--checkpointed-layers` (`weights.parallel.checkpointed_layers`) the model runs the other layers plainly
(`torch_impl/model.py`): autograd keeps their activations.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint


class _KeptTensors:
    """What one checkpointed call of a layer keeps: the results of its `keep_for_backward` calls, in call order."""

    def __init__(self):
        self.results: list[tuple[torch.Tensor, ...]] = []
        self.replaying = False


_active: contextvars.ContextVar[_KeptTensors | None] = contextvars.ContextVar("twinflash_kept_tensors", default=None)


@contextlib.contextmanager
def _keeping(kept: _KeptTensors, *, replaying: bool) -> Iterator[None]:
    kept.replaying = replaying
    token = _active.set(kept)
    try:
        yield
    finally:
        _active.reset(token)


def keep_for_backward(compute: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """`compute()`, except inside a "save-attention" checkpointed layer: the forward stores the result and the
    backward's recomputation of the layer gets the stored tensors back (in the same call order) without computing."""
    kept = _active.get()
    if kept is None:
        return compute()
    if kept.replaying:
        if not kept.results:
            raise RuntimeError("a save-attention checkpointed layer was recomputed more often than it ran forward "
                               "(a second backward through the same graph is not supported)")
        return kept.results.pop(0)
    result = compute()
    kept.results.append(tuple(t.detach() for t in result))
    return result


def checkpointed_layer(layer: Callable[..., torch.Tensor], *args, mode: str) -> torch.Tensor:
    """`layer(*args)` checkpointed as `mode` ("full" or "save-attention") says; see the module docstring."""
    if mode == "full":
        return checkpoint(layer, *args, use_reentrant=False)
    if mode != "save-attention":
        raise ValueError(f"a checkpointed layer's mode is 'full' or 'save-attention', got {mode!r}")
    kept = _KeptTensors()
    return checkpoint(layer, *args, use_reentrant=False,
                      context_fn=lambda: (_keeping(kept, replaying=False), _keeping(kept, replaying=True)))
