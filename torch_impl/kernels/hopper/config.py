"""Launch configs of the Hopper family (the Gluon sm_90 kernels: `forward.py`, `backward.py`, `backward_ws.py`)
and which calls the family serves: `HopperConfig` (the forward's launch shape, and through its `backward` field the
backward's, a `HopperBackwardConfig`), the shapes measured fastest per call class (`forward_config`,
`backward_config`, `lockstep_config`), and `hopper_unsupported`. Twin of `jax_impl/kernels/hopper/config.py`.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from torch_impl.kernels.tiles import GLUON_AVAILABLE, GLUON_TRITON_VERSION, INTERPRETED

HOPPER_HEAD_DIMS = (64, 128)
HOPPER_DTYPES = (torch.bfloat16, torch.float16)

# How a step's dQ block joins the float32 accumulator all programs share: "tma" stores it to shared memory and
# adds it with one asynchronous TMA reduce-add (it leaves the critical path); "vector_atomics" adds it from
# registers by 8-byte reductions (inline PTX `red.v2.f32`; Triton 3.6 emits only scalar float32 atomics, which ran
# 17-35 % slower still on H200: compare/results/kernels-gluon-backward-2026-11-23-h200-tuning).
DQ_REDUCTIONS = ("tma", "vector_atomics")
# The float32 dQ tile's shared-memory swizzle (bytes), the one a "tma" reduction stages through. A consumer stores
# its wgmma accumulator there, each thread two adjacent columns (8-byte stores, eight rows of a warp at a time); at
# 128 bytes (the widest, NVMMASharedLayout's default) rows r and r^1 of a half-warp land on the same banks, a 2-way
# conflict on every store (Nsight Compute, H200, D=128 16k causal: 8.5M shared wavefronts against 4.2M ideal per
# store, 256M conflicts in the kernel, FlashAttention-3's 3.4M); at 32 bytes the rows of a half-warp fill distinct
# banks and the tile leaves in 32-byte-wide TMA boxes (compare/results/kernels-gluon-backward-ncu-2026-11-29-h200).
DQ_SWIZZLES = (32, 128)
GQA_HEAD_SPLITS = 8  # the sweep's head_splits: one program per query head for groups of 2, 4 and 8 (as the JAX twin)


@dataclasses.dataclass(frozen=True)
class HopperBackwardConfig:
    """Launch shape of the Gluon backward: `block_n` resident keys per program (one warpgroup per 64 of them),
    `block_m` query rows per step (a wgmma tile height), `num_stages` Q/dO tiles in flight, `dq_reduction` one
    of DQ_REDUCTIONS, `dp_first` whether dP^T is issued before the previous step's dQ goes out, `stagger`
    whether a non-causal program starts its walk over the query blocks where its key block's causal walk would
    (off: every program walks from the first query block, as FlashAttention-3's do; unstaggered walks ran 1.5-3.3 %
    faster without a mask at D 128 and 64, 16k and 64k, in four sweeps: compare/results/
    kernels-gluon-stagger-2026-12-03-h200), `dq_swizzle` the float32 dQ tile's shared-memory swizzle (one of
    DQ_SWIZZLES), `dq_register_order` whether the warp-specialised form stages and accumulates dQ in the wgmma
    accumulator's register order instead, FlashAttention-3's way (`backward_ws.dq_register_order_bases`; the swizzle
    then does not apply). `warp_specialize` runs the FlashAttention-3 form instead (`backward_ws.py`: two consumer
    warpgroups, a loader warp, a dQ writer warp; block_n 128, dQ by TMA reduce-add, `dq_buffers` float32 dQ
    tiles per consumer, `kv_in_regs` whether each consumer holds its K and V rows in registers (S^T and dP^T as
    register-A matmuls), `lse_first` whether each consumer reads its step's log-sum-exp rows from shared memory
    before issuing S^T and dP^T (after, that read queued behind the matmuls' operand reads and P^T waited for it:
    compare/results/kernels-gluon-backward-ncu-2026-11-29-h200), registers split by setmaxnreg: `consumer_regs` for
    the worker consumer, `producer_regs` for the two single warps, the default consumer what `max_regs` leaves;
    dp_first does not apply). `head_splits`: a GQA group's query heads are shared out among gcd(head_splits, group)
    programs per key block (grid rows after the KV heads), each walking its share and writing float32 partial dK/dV
    that the wrapper sums (1: one program walks the whole group). The JAX twin's `bwd_head_splits`, which ran 553 /
    573 TFLOP/s fwd+bwd against 538 / 543 at Hkv 8, 64k, D=128 on an H200 (compare/results/
    kernels-head-splits-2026-12-02-h200); here a sweep candidate (GQA_HEAD_SPLITS), default 1: at Hkv 8, D=128 the
    splits ran 2-3 % faster at 64k and 1-2 % slower at 16k, inside the 2 % that one config moves between processes
    (compare/results/kernels-gluon-head-splits-2026-12-02-h200)."""
    block_n: int = 128
    block_m: int = 64
    num_stages: int = 2
    dq_reduction: str = "tma"
    dp_first: bool = False
    stagger: bool = False
    dq_swizzle: int = 32
    dq_register_order: bool = False
    warp_specialize: bool = False
    dq_buffers: int = 2
    kv_in_regs: bool = False
    lse_first: bool = True
    max_regs: int = 168
    consumer_regs: int = 240
    producer_regs: int = 24
    head_splits: int = 1

    def __post_init__(self):
        if self.dq_reduction not in DQ_REDUCTIONS:
            raise ValueError(f"dq_reduction {self.dq_reduction!r} is none of {DQ_REDUCTIONS}")
        if self.dq_swizzle not in DQ_SWIZZLES:
            raise ValueError(f"dq_swizzle {self.dq_swizzle!r} is none of {DQ_SWIZZLES}")
        if self.head_splits < 1:
            raise ValueError(f"head_splits must be >= 1, got {self.head_splits}")
        if self.warp_specialize and (self.block_n != 128 or self.dq_reduction != "tma"):
            raise ValueError("the warp-specialised backward takes block_n 128 and dq_reduction 'tma'")
        if self.dq_register_order and not (self.warp_specialize and self.block_m == 64):
            raise ValueError("dq_register_order takes the warp-specialised backward with block_m 64")

    @property
    def num_warps(self) -> int:
        return 4 if self.warp_specialize else self.block_n // 16


def lockstep_config(head_dim: int) -> HopperBackwardConfig:
    """The best lockstep shape measured on H200 at 16k (compare/results/
    kernels-gluon-backward-2026-11-23-h200-tuning): dQ by TMA reduce-add (411 / 390 TF/s causal / not at D=128,
    against 387 / 368 by vector atomics), dP^T issued once dQ is out (issued before, ptxas serializes the wgmma at
    D=128 for want of registers; at D=64 it ran 3-7 % slower). D=128: 64-row query blocks, 2 stages (K, V, two
    Q/dO stages, two dS and two float32 dQ tiles take 225 KiB of the 227 an sm_90 block may have). D=64: 128-row
    query blocks, 2 stages (357 / 368 TF/s, against 350 / 353 for 64 rows and 3 stages)."""
    return HopperBackwardConfig(block_m=64 if head_dim == 128 else 128, num_stages=2)


def backward_config(head_dim: int, causal: bool, seq_bucket: int) -> HopperBackwardConfig:
    """The launch shape for a call class, as measured on H200 at 16k (compare/results/
    kernels-gluon-backward-2026-11-23-h200-h13d): the warp-specialised form, 520 / 540 TF/s causal / not at D=128
    (2 stages and two dQ tiles per consumer; 3 stages and one ran 518 / 537; the lockstep form 415 / 398), 429 / 426
    at D=64 (64-row query blocks, 3 stages, K and V in registers; in shared memory 407-416; lockstep 358 / 367).
    The float32 dQ tile at the 32-byte swizzle (`DQ_SWIZZLES`; compare/results/kernels-gluon-backward-ncu-2026-11-29-
    h200, backward alone at 16k): 533 / 544 at D=128 against 517 / 539 at 128 bytes; 428 / 433 at D=64 against
    434 / 424, within the spread of repeats, so one swizzle serves both. Then dQ in register order (FlashAttention-3's
    accumulator; compare/results/kernels-gluon-dq-register-order-2026-12-03-h200, backward alone): 557.6 / 574.8
    against 534.3 / 545.4 at D=128 16k, 587.4 causal at 64k against 563.6; 446.0 / 454.9 against 433.2 / 438.8 at
    D=64 16k, 469.1 / 458.8 against 451.5 / 451.5 at 64k."""
    del causal, seq_bucket
    if head_dim == 128:
        return HopperBackwardConfig(warp_specialize=True, num_stages=2, dq_buffers=2, dq_register_order=True)
    return HopperBackwardConfig(warp_specialize=True, block_m=64, num_stages=3, kv_in_regs=True,
                                dq_register_order=True)


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Launch shapes of the Hopper kernels. The forward's: `consumers` warpgroups of 64 query rows (2 or 3),
    `block_n` keys per step, `num_stages` K/V tiles in flight, `pingpong` whether the consumers take turns issuing
    their matmuls, and the register split (`consumer_regs` for each worker consumer, `producer_regs` for the TMA
    warp's warpgroup; the default consumer gets what `max_regs` a thread over the whole block leaves). `backward`:
    the backward's (None: `backward_config`'s for the call)."""
    consumers: int = 2
    block_n: int = 128
    num_stages: int = 2
    pingpong: bool = True
    max_regs: int = 168
    consumer_regs: int = 232
    producer_regs: int = 40
    backward: HopperBackwardConfig | None = None


def three_consumers(**shape) -> HopperConfig:
    """A 192-row forward HopperConfig: 512 threads (three consumer warpgroups, the producer warp padded to a fourth)
    at 128 registers each over the block; the consumers get 160, the producer's warpgroup 32 (FlashAttention-3's
    split)."""
    return HopperConfig(consumers=3, max_regs=128, consumer_regs=160, producer_regs=32, **shape)


def hopper_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Hopper kernels cannot run these (validated) inputs, or None when they can."""
    if INTERPRETED:
        return "has no interpreter (Gluon kernels only compile for a GPU)"
    if not GLUON_AVAILABLE:
        return (f"is written for Triton {GLUON_TRITON_VERSION} (Gluon's API changes between releases), "
                f"got {triton.__version__}")
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return "needs an sm_90 (Hopper) GPU"
    if q.dtype not in HOPPER_DTYPES:
        return f"supports bfloat16 and float16, got {q.dtype}"
    if q.shape[-1] not in HOPPER_HEAD_DIMS:
        return f"supports head dims {HOPPER_HEAD_DIMS}, got {q.shape[-1]}"
    for name, t in (("q", q), ("k", k), ("v", v)):
        # A tensor descriptor needs a 16-byte aligned base and 16-byte multiples for every stride but the last.
        aligned = t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        if t.stride(-1) == 1 and not aligned:  # (a strided last dim is copied to a contiguous one anyway)
            return f"needs {name} with a 16-byte aligned base and strides"
    return None


def forward_config(head_dim: int, causal: bool, seq_bucket: int) -> HopperConfig:
    """The launch shape for a call class, as measured on H200. D=128 (compare/results/kernels-gluon-2026-11-22-h200/
    gluon-sweep.json, 16k): two consumers, 128-key tiles, 2 stages (3 do not fit shared memory; 64-key tiles ran
    537-543 TF/s against 587-591 causal); ping-pong and not tie (587 / 591 causal, 609 / 606 full). D=64
    (compare/results/kernels-gluon-forward-2026-11-23-h200-h13e/1-sweep, 16k and 64k): three consumers (192-row
    blocks) ran 465-515 TF/s against two consumers' 425-455; 2 stages causal (485 / 512 against 3 stages' 474 /
    497), 3 full (513 / 510 against 2 stages' 502 / 515)."""
    del seq_bucket
    if head_dim == 128:
        return HopperConfig(num_stages=2, pingpong=True)
    return three_consumers(num_stages=2 if causal else 3, pingpong=False)
