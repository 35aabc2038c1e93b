"""Launch configs of the portable kernels (`forward.py`, `backward.py`): what a caller may pass as `config=`
(`KernelConfig` per kernel, `PortableConfig` for the three) and what the autotuner picks from when it passes none
(each kernel's space of shapes, pruned by the shared memory it needs). Twin of
`jax_impl/kernels/portable/config.py`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton

from torch_impl.kernels.tiles import INTERPRETED

def autotune_configs(gpu_shapes, interpreter_blocks):
    """triton.Configs from (BLOCK_M, BLOCK_N, warps, stages) shapes; the interpreter gets one config, with
    unequal blocks so that it exercises the same block arithmetic as the GPU's."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": interpreter_blocks[0], "BLOCK_N": interpreter_blocks[1]})]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in gpu_shapes]


class KernelConfig(NamedTuple):
    """Launch parameters of one portable kernel. For the forward and dQ kernels a program owns `block_m` query
    rows and steps over K/V `block_n` rows at a time; for the dK/dV kernel a program owns `block_n` key rows and
    steps over queries `block_m` rows at a time. num_warps/num_stages only matter on the GPU."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class PortableConfig:
    """Block sizes of the three portable kernels (the Hopper family's twin is `hopper.config.HopperConfig`). Passed
    as `config=`, it replaces the autotuner: each kernel launches with its entry as given, on the GPU and under
    the interpreter alike."""
    forward: KernelConfig
    backward_dkdv: KernelConfig
    backward_dq: KernelConfig


def launch(kernel, grid, config: KernelConfig | None, *args, **kwargs) -> None:
    """Launch an `autotuned` kernel: tuned over its space when `config` is None, else its jit function with
    `config`'s blocks, warps and stages."""
    if config is None:
        kernel[grid](*args, **kwargs)
    else:
        kernel.fn[grid](*args, **kwargs, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                        num_warps=config.num_warps, num_stages=config.num_stages)


def _max_shared_memory(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


# Calls whose longer sequence is below this take the first fitting config untuned: for them, tuning (a compile
# and a benchmark per config) costs more than it can save, and a test suite would spend minutes compiling.
AUTOTUNE_MIN_SEQ = 4096


def fitting(shared_bytes):
    """An autotune `early_config_prune` that keeps the configs whose shared memory fits the device, only the
    first of them for short calls (AUTOTUNE_MIN_SEQ). `shared_bytes(BLOCK_M, BLOCK_N, stages, row_bytes)` is the
    kernel's need (its resident tiles plus `stages` copies of its streamed ones), which is what Triton allocates
    on sm_90 up to ~1 KB of scratch. float32 operands (FMA dots, no tensor cores) also keep tiles small."""
    def prune(configs, named_args, **kwargs):
        if len(configs) == 1:
            return configs
        q = named_args["Q"]
        row_bytes = triton.next_power_of_2(kwargs["HEAD_DIM"]) * q.element_size()
        limit = _max_shared_memory(q.device.index) - 2048

        def need(config):
            return shared_bytes(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages, row_bytes)

        kept = [c for c in configs if need(c) <= limit
                and (q.dtype != torch.float32 or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)]
        kept = kept or [min(configs, key=need)]
        return kept if named_args["SEQ_BUCKET"] >= AUTOTUNE_MIN_SEQ else kept[:1]
    return prune


def autotuned(gpu_shapes, interpreter_blocks, shared_bytes):
    """The autotune decorator of a kernel tiled by BLOCK_M x BLOCK_N: configs from `autotune_configs`, pruned by
    `fitting(shared_bytes)`, tuned per head dim, mask (causal, documents' spans) and sequence bucket."""
    return triton.autotune(configs=autotune_configs(gpu_shapes, interpreter_blocks),
                           key=["HEAD_DIM", "CAUSAL", "SPANS", "SEQ_BUCKET"],
                           prune_configs_by={"early_config_prune": fitting(shared_bytes)})


# (BLOCK_M, BLOCK_N, warps, stages): no register spills on sm_90 at D=128 (128 x 128 x 2: a few bytes); the last
# one is for D=256.
FORWARD_SHAPES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3),
                  (64, 32, 4, 3)]


def forward_shared_bytes(block_m, block_n, stages, row_bytes):
    return (block_m + stages * 2 * block_n) * row_bytes  # Q resident; K and V streamed


# (BLOCK_M queries, BLOCK_N resident keys, warps, stages). dk and dv alone take 128 registers a thread at D=128,
# so the query block stays small; 64 x 128 spills a little at D=128 but may still win on bandwidth; the last one
# is for D=256 (which spills whatever the tiles).
DKDV_SHAPES = [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3),
               (16, 64, 8, 2)]


def dkdv_shared_bytes(block_m, block_n, stages, row_bytes):
    return (2 * block_n + stages * 2 * block_m) * row_bytes  # K and V resident; Q and dO streamed

DQ_SHAPES = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4),
             (128, 128, 8, 2)]


def dq_shared_bytes(block_m, block_n, stages, row_bytes):
    return (2 * block_m + stages * 2 * block_n) * row_bytes  # Q and dO resident; K and V streamed
