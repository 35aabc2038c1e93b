"""JAX backend: Llama in Flax NNX (`model`), our Pallas FlashAttention kernels (`kernels`), ring attention
inside `jax.shard_map` (`ring_attention`), Ulysses and hybrid sequence parallelism (`ulysses`), and fsdp x
sequence-parallel training (`parallel`, `train`, `checkpointing`). Twin of `torch_impl`."""

from jax_impl.kernels.flash_attention import flash_attention, flash_attention_backward, flash_attention_forward
from jax_impl.ring_attention import gather_from_ring, ring_attention, ring_attention_sharded, shard_for_ring
from jax_impl.ulysses import sequence_parallel_attention, sequence_parallel_mesh, sequence_parallel_sharded

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_forward", "gather_from_ring",
           "ring_attention", "ring_attention_sharded", "sequence_parallel_attention", "sequence_parallel_mesh",
           "sequence_parallel_sharded", "shard_for_ring"]
