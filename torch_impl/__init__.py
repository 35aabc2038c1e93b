"""PyTorch backend: Llama (`model`), our Triton FlashAttention kernels (`kernels`), ring attention over
torch.distributed (`ring_attention`), Ulysses and hybrid sequence parallelism (`ulysses`), and FSDP2 x
sequence-parallel training (`parallel`, `train`, `checkpointing`). Twin of `jax_impl`."""

from torch_impl.kernels.flash_attention import flash_attention, flash_attention_backward, flash_attention_forward
from torch_impl.ring_attention import gather_from_ring, ring_attention, shard_for_ring
from torch_impl.ulysses import sequence_parallel_attention, sequence_parallel_groups

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_forward", "gather_from_ring",
           "ring_attention", "sequence_parallel_attention", "sequence_parallel_groups", "shard_for_ring"]
