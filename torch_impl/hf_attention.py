"""Our kernels and ring as attention implementations of Hugging Face transformers' Llama: this module owns their
registration with transformers' supported API, the mask they go with, and the helpers that shard a batch for the
ring and put the loss, logits and gradients of the shards back together.

    ring = register()             # "twin_attention" (one device) and "twin_ring" (the ring over the world)
    model = LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="twin_ring")
    loss = model(**ring.shard(tokens, labels=tokens)).loss      # this rank's share of the full-sequence loss
    loss.backward(); ring.sum_gradients(model)                  # every rank now holds the full loss's gradients

The names hold no "flash": transformers 5 takes any implementation name containing it for a flash-attention kernel
to fetch from its hub (`is_flash_attention_requested`), and fails to load the model.

How transformers calls an attention implementation (4.53 to 5.x, read in their sources): each layer calls
`fn(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)` with query [B, H, S, D] and key /
value [B, Hkv, S, D] after RoPE, GQA not expanded (sdpa and eager repeat K/V themselves; our kernels read the
grouped heads as they are), and takes back (out [B, S, H, D], attention weights or None). `attention_mask` is
whatever the mask function registered under the same name with `AttentionMaskInterface` returned; for a name with
no mask function transformers passes None (its "no mask needed" exit), so a padding mask is dropped silently, and
so is causality for an implementation that reads it from the mask. Our mask function therefore returns a
`TwinflashMask`, and the attention refuses anything else with one line: an implementation whose mask was not
registered fails instead of computing something else. sdpa's `is_causal` is the module's (`module.is_causal`,
True in Llama's decoder; a keyword `is_causal` overrides it) and holds only where no mask tensor is given; here it
is the module's flag and the mask function's base mask together (transformers' bidirectional mask -> not causal).

What is refused, each with one ValueError line (on the ring, by every rank alike: the first layer of each forward
agrees on the verdict with one tiny collective, so that no rank is left waiting in a transfer): padding (a 2-D
attention_mask with a zero), a prepared 4-D mask, sliding windows and mask overlays, dropout, a KV cache holding
earlier tokens (generation: these implementations compute whole sequences), and position_ids other than the
layout's positions of this rank (packed documents, or a batch not sharded by `HFRing.shard`).

The loss on shards: labels are shifted on the full sequence BEFORE it is sharded (the token before a shard
boundary predicts the first token of the next shard, which lives on another rank), passed as HF's `shift_labels`,
with `num_items_in_batch` the full batch's count of predicted tokens; HF's loss on a rank is then its share of the
full-sequence mean, and the shares sum to it over the ranks.

transformers is not a dependency of the rest of torch_impl: this module is imported only by those who use it, and
`register` refuses an installed transformers outside TRANSFORMERS_RANGE with one line (the `hf` extra pins it).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from packaging.version import Version

from torch_impl.kernels.flash_attention import flash_attention
from torch_impl.ring_attention import gather_from_ring, ring_attention
from torch_impl.ring_comm import Ring
from weights.attention import check_ring_choices
from weights.layout import rank_positions
from weights.training import IGNORE_INDEX

ONE_DEVICE = "twin_attention"
RING = "twin_ring"
TRANSFORMERS_RANGE = ">=4.53,<6"  # 4.53: AttentionMaskInterface; the `hf` extra of pyproject.toml says the same
_OLDEST, _TOO_NEW = Version("4.53"), Version("6")

# What the first layer of a forward checks on each rank; every rank raises the same line for a code any rank found.
_PROBLEMS = {
    1: "padding masks are not supported (the attention_mask has a zero): pass full sequences without padding",
    2: "the attention_mask does not cover this rank's tokens: pass none, or ones over the local tokens",
    3: "sliding-window attention is not supported",
    4: "mask overlays (or/and mask functions) are not supported",
    5: "position_ids are not this rank's positions in the layout: shard the batch with HFRing.shard "
       "(packed documents, whose positions restart, are not supported)",
}


def check_transformers_version(version: str) -> None:
    """ValueError (one line) unless `version` lies in TRANSFORMERS_RANGE."""
    if not _OLDEST <= Version(version) < _TOO_NEW:
        raise ValueError(f"transformers {version} is installed; torch_impl.hf_attention needs transformers"
                         f"{TRANSFORMERS_RANGE} (AttentionInterface and AttentionMaskInterface): "
                         "pip install 'twinflash[hf]'")


class TwinflashMask:
    """What our mask function hands the attention layers instead of a mask tensor: whether the base mask is causal
    and what, if anything, it refuses (a `_PROBLEMS` code). `checked` is set by the first layer of the forward,
    which reported the verdict (and, on the ring, agreed on it with the other ranks), so the other layers and the
    recomputation of a checkpointed layer skip those host round trips."""

    def __init__(self, causal: bool, problem: int = 0):
        self.causal, self.problem, self.checked = causal, problem, False


@dataclasses.dataclass(frozen=True)
class HFRing:
    """The ring `register` set up for "twin_ring", and the helpers that put a batch on it and back."""
    group: dist.ProcessGroup | None
    layout: str
    variant: str
    backend: str

    def rank_and_world(self) -> tuple[int, int]:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def shard(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
              ignore_index: int = IGNORE_INDEX) -> dict:
        """This rank's part of a full batch [B, S], as keyword arguments of an HF causal LM's forward:
        `input_ids` and `position_ids` (the global positions of the local tokens, for RoPE) in the ring's
        layout, `use_cache=False`, and with `labels` the loss's inputs (module docstring): the next-token labels
        made on the full sequence, then sharded (`labels` and `shift_labels`), and `num_items_in_batch`."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}")
        rank, world = self.rank_and_world()
        positions = rank_positions(input_ids.shape[1], world, rank, self.layout)
        local = torch.from_numpy(positions).to(input_ids.device)
        batch = dict(input_ids=input_ids[:, local], position_ids=local.expand(input_ids.shape[0], -1),
                     use_cache=False)
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have input_ids' shape {list(input_ids.shape)}, "
                                 f"got {list(labels.shape)}")
            following = torch.full_like(labels[:, :1], ignore_index)
            shifted = torch.cat([labels[:, 1:], following], dim=1)  # before sharding: across shard boundaries
            batch.update(labels=shifted[:, local], shift_labels=shifted[:, local],
                         num_items_in_batch=(shifted != ignore_index).sum())
        return batch

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The full sequence's logits [B, S, vocab] in position order on every rank (a collective)."""
        return gather_from_ring(logits, self.group, self.layout, dim=1)

    def full_loss(self, loss_share: torch.Tensor) -> torch.Tensor:
        """The full-sequence loss: every rank's share summed (a collective; detached, for reporting)."""
        total = loss_share.detach().clone()
        if self.rank_and_world()[1] > 1:
            dist.all_reduce(total, group=self.group)
        return total

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """In place: each parameter's gradient summed over the ring's ranks. A rank's backward gives the gradient
        of its loss share through its own tokens (the ring sends the K/V gradients back to their owners); the full
        loss's gradient is the sum. With DDP over the ring's group instead, scale the loss by the ranks: DDP
        averages."""
        if self.rank_and_world()[1] == 1:
            return
        pending = [dist.all_reduce(p.grad, group=self.group, async_op=True)
                   for p in model.parameters() if p.grad is not None]
        for work in pending:
            work.wait()


def _mask_problem(attention_mask, local_len: int | None, kwargs: dict) -> int:
    if kwargs.get("local_size") is not None:
        return 3
    if kwargs.get("use_vmap"):  # transformers 5 sets it exactly when an or/and mask function is overlaid
        return 4
    if attention_mask is None:
        return 0
    if attention_mask.ndim != 2 or (local_len is not None and attention_mask.shape[-1] != local_len):
        return 2
    return 0 if bool(attention_mask.all()) else 1


def twinflash_mask(*, mask_function=None, attention_mask: torch.Tensor | None = None, q_length: int | None = None,
                   cache_position: torch.Tensor | None = None, **kwargs) -> TwinflashMask:
    """The mask function of both implementations (`AttentionMaskInterface`): a `TwinflashMask`, causal unless
    transformers asks for its bidirectional mask. Called with keywords only (4.53 passes cache_position where
    5.x passes q_length and q_offset); a packing overlay found from position_ids is judged by the attention, which
    sees the position_ids (module docstring)."""
    from transformers import masking_utils

    if q_length is None and cache_position is not None:
        q_length = len(cache_position)
    bidirectional = getattr(masking_utils, "bidirectional_mask_function", None)  # absent from 4.53
    return TwinflashMask(causal=mask_function is not bidirectional,
                         problem=_mask_problem(attention_mask, q_length, kwargs))


def _first_layer_checks(mask: TwinflashMask, query: torch.Tensor, position_ids: torch.Tensor | None,
                        ring: HFRing | None) -> None:
    """The verdict of the mask and the positions, once per forward; on the ring agreed by every rank."""
    local_len = query.shape[2]
    rank, world = ring.rank_and_world() if ring is not None else (0, 1)
    problem = mask.problem
    if not problem and position_ids is not None:
        layout = ring.layout if ring is not None else "contiguous"
        expected = torch.from_numpy(rank_positions(local_len * world, world, rank, layout)).to(position_ids.device)
        problem = 0 if torch.equal(position_ids, expected.expand_as(position_ids)) else 5
    mask.checked = True
    codes = [problem] if world == 1 else [row[0] for row in Ring(ring.group, query.device).all_gather_ints([problem])]
    found = sorted({code for code in codes if code})
    if found:
        ranks = [r for r, code in enumerate(codes) if code == found[0]]
        where = f" (rank {', '.join(map(str, ranks))} of {world})" if world > 1 else ""
        raise ValueError(f"{RING if ring is not None else ONE_DEVICE}: {_PROBLEMS[found[0]]}{where}")


class _Implementation:
    """One layer's attention as transformers calls it (module docstring): "twin_ring" on `ring`, or
    "twin_attention" where `ring` is None."""

    def __init__(self, ring: HFRing | None, backend: str):
        self.ring, self.backend = ring, backend

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs
                 ) -> tuple[torch.Tensor, None]:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, self.ring, self.backend,
                          kwargs)


def _attention(module, query, key, value, attention_mask, dropout, scaling, ring: HFRing | None, backend: str,
               kwargs: dict) -> tuple[torch.Tensor, None]:
    name = RING if ring is not None else ONE_DEVICE
    if not isinstance(attention_mask, TwinflashMask):
        if attention_mask is None:
            raise ValueError(f"{name}: got no mask from twinflash's mask function: register it with "
                             "transformers' AttentionMaskInterface (torch_impl.hf_attention.register does both)")
        raise ValueError(f"{name}: a prepared attention mask ({type(attention_mask).__name__}) is not supported")
    if dropout:
        raise ValueError(f"{name}: attention dropout is not supported, got {dropout}")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"{name}: a KV cache holding earlier tokens is not supported ({query.shape[2]} queries, "
                         f"{key.shape[2]} keys): pass use_cache=False, or generate with another implementation")
    first_layer = not attention_mask.checked
    if first_layer:
        _first_layer_checks(attention_mask, query, kwargs.get("position_ids"), ring)
    is_causal = kwargs.get("is_causal")
    causal = attention_mask.causal and bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, S, heads, D] views
    if ring is None:
        out = flash_attention(q, k, v, causal=causal, softmax_scale=scaling, backend=backend)
    else:
        out = ring_attention(q, k, v, group=ring.group, causal=causal, layout=ring.layout, variant=ring.variant,
                             softmax_scale=scaling, backend=backend, check_ranks=first_layer)
    return out, None


def attention_function(ring: HFRing | None = None, backend: str = "triton"):
    """The attention function of "twin_attention" (`ring` None) or of "twin_ring" on `ring`, for
    `AttentionInterface.register`; it works only beside `twinflash_mask` registered under the same name."""
    return _Implementation(ring, backend)


def register(*, group: dist.ProcessGroup | None = None, layout: str = "zigzag", variant: str = "ring",
             backend: str = "triton") -> HFRing:
    """Registers "twin_attention" (our `flash_attention`, one device) and "twin_ring" (our `ring_attention` over
    `group`, default the world, on inputs sharded in `layout`) with transformers' AttentionInterface, and their
    mask function with AttentionMaskInterface; returns the ring's helpers. `backend` picks the kernels (a
    `torch_impl.kernels.flash_attention` backend: "triton", ours; "reference", plain math). A second call
    replaces the first's settings."""
    import transformers

    check_transformers_version(transformers.__version__)  # before importing what older versions lack
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_ring_choices(layout, variant)
    ring = HFRing(group, layout, variant, backend)
    for name, implementation in ((ONE_DEVICE, attention_function(None, backend)),
                                 (RING, attention_function(ring, backend))):
        AttentionInterface.register(name, implementation)
        AttentionMaskInterface.register(name, twinflash_mask)
    return ring
