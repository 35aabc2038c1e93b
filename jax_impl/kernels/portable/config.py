"""Launch configs of the portable kernels (`forward.py`, `backward.py`: Pallas's Triton lowering): what a caller
may pass as `config=` (`KernelConfig` per kernel, `PortableConfig` for the three) and the heuristic a call without
one gets (`default_config`). Twin of `torch_impl/kernels/portable/config.py`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from jax_impl.kernels.tiles import padded_head_dim

class KernelConfig(NamedTuple):
    """Launch parameters of one kernel. For the forward and dQ kernels a program owns `block_q` query rows
    and steps over K/V `block_k` rows at a time; for the dK/dV kernel a program owns `block_k` key rows and
    steps over queries `block_q` rows at a time. num_warps/num_stages only matter on the GPU."""
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """Block sizes of the portable kernels (the Hopper family's twin is `hopper.config.HopperConfig`). forward and
    backward_dq: a program owns `block_q` query rows and steps over K/V by `block_k`; backward_dkdv: a program
    owns `block_k` key rows and steps over queries by `block_q` (for every query head of its GQA group)."""
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig


# GPU defaults for bf16/fp16 per kernel head dim (`padded_head_dim`: a power of two >= 16), starting points
# for the H200, screened offline for sm_90 (Triton IR compiled with ptxas: no register spills, shared memory
# within 227 KB); time them with compare/bench/pallas_sweep.py.
GPU_CONFIGS: dict[int, PortableConfig] = {
    16: PortableConfig(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 64, 4, 2)),
    32: PortableConfig(KernelConfig(128, 64, 4, 3), KernelConfig(64, 128, 8, 2), KernelConfig(128, 64, 4, 2)),
    64: PortableConfig(KernelConfig(64, 64, 4, 2), KernelConfig(32, 128, 4, 3), KernelConfig(128, 64, 4, 3)),
    128: PortableConfig(KernelConfig(128, 128, 8, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 64, 8, 3)),
    256: PortableConfig(KernelConfig(64, 32, 8, 2), KernelConfig(32, 32, 8, 2), KernelConfig(64, 32, 8, 2)),
}
# fp32 inputs on the GPU run true-fp32 FMA dots (no tensor cores), whose operands and accumulators all sit in
# registers: only small tiles fit (spill-free up to head dim 128). A correctness path (fp32 models), not a
# speed path.
GPU_FP32_CONFIG = PortableConfig(KernelConfig(32, 16, 8, 2), KernelConfig(16, 16, 8, 2), KernelConfig(32, 16, 8, 2))
# Interpret mode (CPU): small, unequal tiles, so short test sequences still cross several blocks and tails.
INTERPRET_CONFIG = PortableConfig(KernelConfig(32, 16, 1, 1), KernelConfig(16, 32, 1, 1), KernelConfig(32, 16, 1, 1))


def default_config(head_dim: int, dtype, *, interpret: bool) -> PortableConfig:
    """Heuristic: the block sizes a call with this head dim and input dtype gets when it passes no config."""
    if interpret:
        return INTERPRET_CONFIG
    return GPU_FP32_CONFIG if jnp.dtype(dtype) == jnp.float32 else GPU_CONFIGS[padded_head_dim(head_dim)]
