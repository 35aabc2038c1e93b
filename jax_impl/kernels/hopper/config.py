"""Launch configs of the Hopper family (the sm90 Mosaic GPU kernels: `forward.py`, `backward.py`) and what follows
from a config before anything compiles: `HopperConfig` and its checks, the heuristic (`default_config`) and the
sweep's candidates (`autotune_space`), the register split between warpgroups, which calls the kernels serve
(`hopper_unsupported`), and each kernel's shared memory. Twin of `torch_impl/kernels/hopper/config.py`.

Shared memory is computed, not found out at launch. The kernels take their scratch buffers and barriers from
`forward_scratch`, `dkdv_scratch` and `dq_scratch` here, so the accounting (`KernelScratch.smem_bytes`) reads the
very allocations a kernel makes, laid out as Mosaic GPU lays them out (the same code in jax 0.10.2 and 0.11.1):
  - Pallas's resource estimate (`jax/_src/pallas/mosaic_gpu/lowering.py`, `_run_scoped_resource_estimator`)
    gives every scratch buffer of the kernel's one collective `pl.run_scoped` its bytes (elements x itemsize;
    tiling and swizzle transforms change the order, not the size) rounded up to `SMEM_ALIGNMENT` (1024: every
    buffer starts on a 1 KiB boundary, `gpu_core.SMEM_ALIGNMENT`), and adds, once, `reduction_scratch_bytes`
    (`CompilerParams`; default 2048) if the kernel body holds any reduce_sum/max/min (`_reduce_resource_estimator`;
    the forward's row max and sum do, the backward kernels reduce nothing: their row statistics come in
    precomputed);
  - Mosaic GPU's launch (`jax/experimental/mosaic/gpu/core.py`, `_smem_tree_size`) puts the barriers after that
    block, 8 bytes each (`utils.MBARRIER_BYTES`), and raises "Mosaic GPU kernel exceeds available shared memory:
    smem_bytes=... > max_smem_bytes=..." beyond the device's `shared_memory_per_block_optin`.
Checked against: the failing ring call of issue 32 (default config, D=128, bf16 in, float32 out, full attention:
280688 bytes, the GPU's own number); the error rows of the 2026-11-23 sweep (compare/results/
kernels-mosaic-2026-11-23-h200-matrix/sweep-16k.json: the dQ kernel at dq_block_q 128 / dq_block_kv 64, 264320, and
at bwd_num_stages 3, 297120); the default dQ kernel at D=128, which compiles: its tiles are the 224 KB the heuristic
was sized by, 231552 bytes with its row statistics and barriers, 896 under the limit; and, for every kernel and form
at several configs, Pallas's own estimate traced on CPU (tests/test_mosaic_smem.py).

`smem_limit` is the device's limit as Mosaic GPU reads it; `check_smem` turns a call over it into one ValueError
naming the config and the bytes, before compiling and under the interpreter alike; `smem_needs` gives every
kernel's bytes for a call, which `default_config` and `autotune_space` choose by.
The torch twin has no such accounting: Triton sizes its own shared memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_impl.kernels.tiles import round_up

HEAD_DIMS = (64, 128)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
COMPUTE_WARPGROUPS = 2  # + one TMA producer warpgroup (the backward's count, and the forward's default)
FORWARD_WARPGROUPS = (2, 3)
BACKWARD_FORMS = ("one_kernel", "one_kernel_private", "two_kernel")
PRODUCER_REGISTERS = 40  # the forward's TMA warpgroup's cap with two compute warpgroups (232 each)
# The backward's (HopperConfig.bwd_producer_registers), both in the sweep: FA3's 24 (240 a compute thread) and 40 (232).
BACKWARD_PRODUCER_REGISTERS = (24, 40)
DQ_CHUNK = 64  # dQ columns per reduce-add tile: one 128-byte-swizzle tile of K, half of D=128
SMEM_ALIGNMENT = 1024  # each scratch buffer's start (jax/_src/pallas/mosaic_gpu/core.py SMEM_ALIGNMENT)
BARRIER_BYTES = 8  # one mbarrier (jax/experimental/mosaic/gpu/utils.py MBARRIER_BYTES)
GQA_HEAD_SPLITS = 8  # the one-kernel heuristic's bwd_head_splits: one CTA per query head for groups of 2, 4 and 8
# sm90's opt-in shared memory per block, 227 KiB (CUDA C programming guide, technical specifications of compute
# capability 9.0; every sm90 part: H100, H200, H800, H20): the limit where no GPU is asked, as Mosaic GPU itself
# assumes for ahead-of-time compilation.
SM90_SMEM_BYTES = 227 * 1024


def register_caps(compute_warpgroups: int, producer: int | None = None) -> tuple[int, int]:
    """Per-thread register caps (setmaxnreg) of (the producer, each compute warpgroup). A thread starts with the
    SM's 64K registers over the CTA's threads (128 a warpgroup), in steps of 8: 168 with three warpgroups, 128 with
    four. An increase beyond what the others released waits forever, so the compute cap is what the producer
    leaves of that budget, split evenly, in steps of 8: (3 x 168 - 40) / 2 -> 232; (3 x 168 - 24) / 2 -> 240,
    FA3's backward split (`HopperConfig.bwd_producer_registers`); three compute warpgroups take FA3's forward split,
    producer 32, (4 x 128 - 32) / 3 -> 160 each. `producer` None: 40 for two compute warpgroups, 32 for three."""
    if producer is None:
        producer = PRODUCER_REGISTERS if compute_warpgroups == COMPUTE_WARPGROUPS else 32
    warpgroups = compute_warpgroups + 1
    budget = 65536 // (128 * warpgroups) // 8 * 8 * warpgroups
    return producer, (budget - producer) // compute_warpgroups // 8 * 8


@dataclasses.dataclass(frozen=True)
class HopperConfig:
    """Block sizes and schedule of the Mosaic kernels. Forward: each of `compute_warpgroups` warpgroups owns `block_q`
    query rows (a CTA compute_warpgroups * block_q) and steps over K/V by `block_kv` through `num_stages` shared-memory
    slots. Full (not causal) attention: `full_block_kv` and `full_compute_warpgroups` replace the two where set, and
    `persistent` runs one CTA per SM, each walking (batch, head, query tile) items in turn (causal calls keep one CTA
    per tile, longest first); see `forward_schedule`. Backward dK/dV: a warpgroup owns `bwd_block_kv` key rows and steps
    over queries by `bwd_block_q`; backward dQ: a warpgroup owns `dq_block_q` query rows and steps over keys by
    `dq_block_kv`; both through `bwd_num_stages` slots. `bwd_overlap`: the backward issues its independent wgmmas
    together and awaits each only where its result is read (False: each is awaited when issued; see
    `backward_step.gradient_step`). `bwd_form`: "two_kernel" (a separate dQ kernel) or "one_kernel" (FA3: dQ too comes
    from the dK/dV kernel, added up in fp32 by TMA reduce-add) or "one_kernel_private" (the same, each warpgroup adding
    its own keys' dQ share); see backward.py. `bwd_query_rows`: the dK/dV step computes S = Q K^T with query rows
    (FA3's orientation: the row statistics take 2 registers a thread, P and dS reach the dK/dV wgmmas through shared
    memory) instead of S^T (lse and delta per column: 16 registers each at 64 queries; P^T and dS^T stay in registers
    as the wgmmas' left operands); see backward.py. `bwd_rebuild_descriptors`: the dK/dV kernel recomputes the wgmma
    descriptors of its fixed shared-memory tiles at every step (an int32 zero read from shared memory, `zero_smem`,
    hides that they do not change) rather than keeping them live through the loop, spilled (backward.py).
    `bwd_stagger` (the one-kernel forms): in full attention each CTA starts its walk over the (query block, head)
    steps as many steps in as its own first key is query blocks in, and wraps around (a causal walk starts at its
    diagonal anyway), so the CTAs running at once do not all reduce-add into the same dQ rows (torch's `stagger`).
    Measured on an H200 (D=128, full attention, one kernel with query rows;
    compare/results/kernels-mosaic-stagger-2026-11-29-h200): at Hkv 32,
    523 -> 561-574 TFLOP/s at 64k, level at 16k (554 -> 559). At Hkv 8 (GQA 4:1) a stagger by query blocks lost,
    551-570 -> 514-527 at 16k: with the group's heads fastest in the walk, the next key tile's CTA ran 8 steps ahead,
    farther than L2 keeps the Q and dO blocks it read. The walk is rotated by steps instead (2 per key tile, as
    without GQA): at Hkv 8 level at 16k (560 against 562 unstaggered), 540 against 527 at 64k, and Hkv 32 unchanged
    (570 against 534 at 64k; compare/results/kernels-stagger-gqa-2026-11-29-h200). The two-kernel form's dK/dV kernel
    adds into nothing shared and never staggers (staggered, it ran 1-2 % slower).
    `bwd_head_splits`: the dK/dV kernel's query heads of a GQA group are shared out among gcd(bwd_head_splits, group)
    CTAs (grid axis "head_split", after the KV heads), each walking its share's (query block, head) steps and writing
    float32 partial dK/dV that the wrapper sums (1: one CTA walks the whole group). A grid like FA3's (one CTA per
    query head at most) and like ours without GQA: at 64k on an H200 the one-kernel backward ran 516 / 535 TFLOP/s
    (causal / full) at Hkv 8 against 547 / 573 at Hkv 32, where the forward ran level
    (compare/results/kernels-dq-order-2026-12-01-h200). Split 8 ways (one CTA per query head at Hkv 8, H 32) it ran
    553 / 573 against 538 / 543 at 64k and 533 / 552 against 525 / 556 at 16k, with JAX cuDNN at 551 / 563 and
    518 / 544 (compare/results/kernels-head-splits-2026-12-02-h200): the heuristic's in the one-kernel form.
    `bwd_producer_registers`: the backward kernels' TMA warpgroup's register cap, the compute warpgroups getting what
    it leaves (`register_caps`: FA3's 24 -> 240, 40 -> 232).
    `bwd_auto_barriers`: the dK/dV kernel compiles with Pallas's automatic warpgroup barriers around every
    shared-memory store (False: `CompilerParams.unsafe_no_auto_barriers`). Its stores need none: each tile a thread
    stores (P, dS, the dQ and dK/dV chunks) is read only through the async proxy (wgmma, TMA) after `commit_smem`'s
    fence and barrier, and is stored again only after those reads are awaited (the step's `wgmma_wait`, the other
    warpgroup's `ds_ready` arrival, `wait_smem_to_gmem`, whose lowering ends in a warpgroup barrier). With them, every
    store of a step paid two more barriers (18 `BAR.SYNC` in the step's SASS, 6 without) and the `MEMBAR.ALL.CTA`
    ptxas puts before each proxy fence waited on them (3.8 % of the stall samples, 0.6 % without; Nsight Compute,
    H200, one kernel with query rows at 64k without a mask). Without them fwd+bwd ran 1.7-2.5 % faster at D 128 and
    64, 16k and 64k, causal and not (compare/results/kernels-mosaic-barriers-2026-12-03-h200). Defaults as
    measured on an H200 (S=16k, H=Hkv=32, causal; compare/results/README.md, 2026-11-23): fwd+bwd 461 -> 481 TFLOP/s at
    D=128 with `bwd_overlap`, 485 with dq_block_kv 128 (D=64: 368 -> 379 -> 397); 2026-11-29 (compare/results/
    kernels-mosaic-query-rows-2026-11-29-h200): rebuilt descriptors 468 -> 486, the one-kernel form with query rows
    518 (16k-64k: the faster form at 7 of 8 points; the heuristic's in bfloat16 since it passed in the ring on 2
    GPUs)."""
    block_q: int = 64
    block_kv: int = 128
    num_stages: int = 2
    compute_warpgroups: int = COMPUTE_WARPGROUPS
    persistent: bool = False
    full_block_kv: int | None = None
    full_compute_warpgroups: int | None = None
    bwd_block_q: int = 64
    bwd_block_kv: int = 64
    bwd_num_stages: int = 2
    dq_block_q: int = 64
    dq_block_kv: int = 128
    bwd_overlap: bool = True
    bwd_form: str = "two_kernel"
    bwd_query_rows: bool = False
    bwd_rebuild_descriptors: bool = True
    bwd_stagger: bool = True
    bwd_head_splits: int = 1
    bwd_producer_registers: int = BACKWARD_PRODUCER_REGISTERS[0]
    bwd_auto_barriers: bool = False

    @property
    def backward_registers(self) -> tuple[int, int]:
        """setmaxnreg caps of the backward kernels' (TMA warpgroup, each compute warpgroup): `register_caps`."""
        return register_caps(COMPUTE_WARPGROUPS, self.bwd_producer_registers)

    def __post_init__(self):
        if self.bwd_form not in BACKWARD_FORMS:
            raise ValueError(f"HopperConfig.bwd_form must be one of {BACKWARD_FORMS}, got {self.bwd_form!r}")
        if self.bwd_form != "two_kernel" and self.bwd_block_q != self.bwd_block_kv:
            # its dQ and dK/dV tiles leave through the same fp32 shared-memory buffer
            raise ValueError("HopperConfig: the one-kernel backward needs bwd_block_q == bwd_block_kv, got "
                             f"{self.bwd_block_q} and {self.bwd_block_kv}")
        for name in ("block_q", "block_kv", "bwd_block_q", "bwd_block_kv", "dq_block_q", "dq_block_kv",
                     "full_block_kv"):
            if getattr(self, name) is not None and (getattr(self, name) % 64 or getattr(self, name) < 64):
                raise ValueError(f"HopperConfig.{name} must be a positive multiple of 64 (wgmma tiles), got "
                                 f"{getattr(self, name)}")
        if self.bwd_producer_registers % 8 or not 24 <= self.bwd_producer_registers <= 168:
            # setmaxnreg takes multiples of 8 from 24; the producer only gives registers back (168: its start)
            raise ValueError("HopperConfig.bwd_producer_registers must be a multiple of 8 in 24..168, got "
                             f"{self.bwd_producer_registers}")
        if self.num_stages < 1 or self.bwd_num_stages < 1:
            raise ValueError("HopperConfig stages must be >= 1")
        if self.bwd_head_splits < 1:
            raise ValueError(f"HopperConfig.bwd_head_splits must be >= 1, got {self.bwd_head_splits}")
        for name in ("compute_warpgroups", "full_compute_warpgroups"):
            value = getattr(self, name)
            if value not in FORWARD_WARPGROUPS and not (value is None and name == "full_compute_warpgroups"):
                raise ValueError(f"HopperConfig.{name} must be one of {FORWARD_WARPGROUPS}, got {value}")

    def forward_schedule(self, causal: bool) -> tuple[int, int, bool]:
        """(block_kv, compute warpgroups, persistent grid) of a forward call."""
        if causal:
            return self.block_kv, self.compute_warpgroups, False
        return (self.full_block_kv or self.block_kv, self.full_compute_warpgroups or self.compute_warpgroups,
                self.persistent)


def hopper_unsupported(q, head_dim: int) -> str | None:
    """None when the Mosaic kernels serve this call, else the reason they do not."""
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"dtype {q.dtype} (Mosaic kernels take bfloat16/float16)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (Mosaic kernels take {HEAD_DIMS})"
    return None


# --- shared memory ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelScratch:
    """One kernel's shared memory: its named scratch buffers and barriers (`plgpu.SMEM` / `plgpu.Barrier`; None:
    not allocated) and the reduction scratch Mosaic GPU reserves for it (0 for a kernel without reductions)."""
    kernel: str
    buffers: dict
    reduction_bytes: int = 0

    def smem_bytes(self) -> int:
        """The bytes Mosaic GPU launches the kernel with (module docstring)."""
        allocations = [x for x in self.buffers.values() if x is not None]
        barriers = sum(math.prod(x.num_barriers) for x in allocations if isinstance(x, plgpu.Barrier))
        data = sum(round_up(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize, SMEM_ALIGNMENT)
                   for x in allocations if not isinstance(x, plgpu.Barrier))
        return data + round_up(self.reduction_bytes, SMEM_ALIGNMENT) + BARRIER_BYTES * barriers


def smem_transforms(dtype):
    """Tiled + 128-byte-swizzled shared memory (rows of 128 bytes: 64 16-bit or 32 fp32 elements): the layout
    wgmma operands need, and conflict-free stores of register tiles."""
    return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))


def _tiles(count: int, rows: int, cols: int, dtype):
    return plgpu.SMEM((count, rows, cols), dtype, transforms=smem_transforms(dtype))


def forward_stages(config: HopperConfig, *, causal: bool, seq_k: int | None) -> int:
    """K/V slots of a forward call: num_stages, fewer when the keys fill fewer blocks (None: enough keys)."""
    block_kv = config.forward_schedule(causal)[0]
    return config.num_stages if seq_k is None else min(config.num_stages, -(-seq_k // block_kv))


def forward_scratch(config: HopperConfig, *, head_dim: int, dtype, out_dtype, causal: bool,
                    stages: int) -> KernelScratch:
    """The forward kernel's scratch. A half-precision out tile reuses Q's buffer (Q is dead by then; o_smem2
    None), an fp32 one (ring partials) gets its own. The row reductions stay inside warps and need little of the
    reduction scratch: 1024 bytes where the fp32 out tile takes the room, else Mosaic's default 2048."""
    block_kv, warpgroups, _ = config.forward_schedule(causal)
    block_q, dtype, out_dtype = config.block_q, jnp.dtype(dtype), jnp.dtype(out_dtype)
    buffers = dict(
        q_smem2=_tiles(warpgroups, block_q, head_dim, dtype),
        o_smem2=None if out_dtype == dtype else _tiles(warpgroups, block_q, head_dim, out_dtype),
        lse_smem2=plgpu.SMEM((warpgroups, block_q), jnp.float32),
        k_smem=_tiles(stages, block_kv, head_dim, dtype),
        v_smem=_tiles(stages, block_kv, head_dim, dtype),
        q_barriers=plgpu.Barrier(num_barriers=warpgroups),
        k_barriers=plgpu.Barrier(num_barriers=stages),
        v_barriers=plgpu.Barrier(num_barriers=stages),
        k_consumed=plgpu.Barrier(num_arrivals=warpgroups, num_barriers=stages),
        v_consumed=plgpu.Barrier(num_arrivals=warpgroups, num_barriers=stages),
        turn_barriers=plgpu.Barrier(num_barriers=warpgroups),
    )
    return KernelScratch("forward", buffers, reduction_bytes=2048 if out_dtype == dtype else 1024)


def backward_lengths(config: HopperConfig, *, seq_q: int, seq_k: int) -> tuple[int, int]:
    """(Sq, Sk) padded for both backward kernels: query tiles of the dQ kernel, key tiles of the dK/dV kernel
    and the dQ kernel's steps."""
    return (round_up(seq_q, COMPUTE_WARPGROUPS * math.lcm(config.bwd_block_q, config.dq_block_q)),
            round_up(seq_k, math.lcm(COMPUTE_WARPGROUPS * config.bwd_block_kv, config.dq_block_kv)))


def backward_stages(config: HopperConfig, *, seq_q: int | None, seq_k: int | None, group: int) -> tuple[int, int]:
    """Slots of (the dK/dV kernel's query steps, the dQ kernel's K/V steps): bwd_num_stages, fewer when a call
    has fewer steps (None: enough)."""
    if seq_q is None or seq_k is None:
        return config.bwd_num_stages, config.bwd_num_stages
    q_len, k_len = backward_lengths(config, seq_q=seq_q, seq_k=seq_k)
    return (min(config.bwd_num_stages, q_len // config.bwd_block_q * group),
            min(config.bwd_num_stages, k_len // config.dq_block_kv))


def dkdv_scratch(config: HopperConfig, *, head_dim: int, dtype, stages: int) -> KernelScratch:
    """The dK/dV kernel's scratch: the one-kernel forms' dS tiles and the barrier between the warpgroups' halves;
    with `bwd_query_rows` the P and dS tiles the dK/dV wgmmas read ([queries, keys] each, else dS^T [keys, queries]).
    The shared one-kernel form alternates two dS tiles a warpgroup (backward.py says why), the others keep one. fp32
    results leave through shared memory in column chunks of DQ_CHUNK."""
    wgs, block_q, block_kv = COMPUTE_WARPGROUPS, config.bwd_block_q, config.bwd_block_kv
    one_kernel, private_dq = config.bwd_form != "two_kernel", config.bwd_form == "one_kernel_private"
    lhs_tile = (block_q, block_kv) if config.bwd_query_rows else (block_kv, block_q)
    ds_tiles = 2 if one_kernel and not private_dq else 1
    buffers = dict(
        k_smem2=_tiles(wgs, block_kv, head_dim, dtype), v_smem2=_tiles(wgs, block_kv, head_dim, dtype),
        out_smem2=_tiles(wgs, block_kv, min(DQ_CHUNK, head_dim), jnp.float32),
        q_smem=_tiles(stages, block_q, head_dim, dtype), dout_smem=_tiles(stages, block_q, head_dim, dtype),
        lse_smem=plgpu.SMEM((stages, block_q), jnp.float32), delta_smem=plgpu.SMEM((stages, block_q), jnp.float32),
        ds_smem=(plgpu.SMEM((ds_tiles, wgs) + lhs_tile, dtype, transforms=smem_transforms(dtype))
                 if one_kernel or config.bwd_query_rows else None),
        p_smem=_tiles(wgs, *lhs_tile, dtype) if config.bwd_query_rows else None,
        zero_smem=plgpu.SMEM((1,), jnp.int32) if config.bwd_rebuild_descriptors else None,
        kv_barriers=plgpu.Barrier(num_barriers=2 * wgs),
        q_barriers=plgpu.Barrier(num_barriers=stages), dout_barriers=plgpu.Barrier(num_barriers=stages),
        lse_barriers=plgpu.Barrier(num_barriers=stages), delta_barriers=plgpu.Barrier(num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        ds_ready=plgpu.Barrier(num_arrivals=wgs) if one_kernel and not private_dq else None)
    return KernelScratch("backward dK/dV" + (" + dQ" if one_kernel else ""), buffers)


def dq_scratch(config: HopperConfig, *, head_dim: int, dtype, stages: int) -> KernelScratch:
    """The two-kernel form's dQ kernel's scratch."""
    wgs, block_q, block_kv = COMPUTE_WARPGROUPS, config.dq_block_q, config.dq_block_kv
    buffers = dict(
        q_smem2=_tiles(wgs, block_q, head_dim, dtype), dout_smem2=_tiles(wgs, block_q, head_dim, dtype),
        lse_smem2=plgpu.SMEM((wgs, block_q), jnp.float32), delta_smem2=plgpu.SMEM((wgs, block_q), jnp.float32),
        out_smem2=_tiles(wgs, block_q, min(DQ_CHUNK, head_dim), jnp.float32),
        k_smem=_tiles(stages, block_kv, head_dim, dtype), v_smem=_tiles(stages, block_kv, head_dim, dtype),
        row_barriers=plgpu.Barrier(num_barriers=4 * wgs),
        k_barriers=plgpu.Barrier(num_barriers=stages), v_barriers=plgpu.Barrier(num_barriers=stages),
        k_consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        v_consumed=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages))
    return KernelScratch("backward dQ", buffers)


def call_scratch(config: HopperConfig, *, head_dim: int, dtype, out_dtype=None, causal: bool,
                 seq_q: int | None = None, seq_k: int | None = None, group: int = 1) -> tuple[KernelScratch, ...]:
    """Every kernel a call with this config runs: the forward (out in `out_dtype`, None: the input's), then the
    backward form's kernels. Lengths None: a call long enough to fill every stage (the most it can need)."""
    out_dtype = dtype if out_dtype is None else out_dtype
    dkdv_stages, dq_stages = backward_stages(config, seq_q=seq_q, seq_k=seq_k, group=group)
    kernels = [forward_scratch(config, head_dim=head_dim, dtype=dtype, out_dtype=out_dtype, causal=causal,
                               stages=forward_stages(config, causal=causal, seq_k=seq_k)),
               dkdv_scratch(config, head_dim=head_dim, dtype=dtype, stages=dkdv_stages)]
    if config.bwd_form == "two_kernel":
        kernels.append(dq_scratch(config, head_dim=head_dim, dtype=dtype, stages=dq_stages))
    return tuple(kernels)


def smem_needs(config: HopperConfig, **call) -> dict[str, int]:
    """Shared-memory bytes per kernel of a call (`call_scratch`'s arguments)."""
    return {scratch.kernel: scratch.smem_bytes() for scratch in call_scratch(config, **call)}


def smem_limit(interpret: bool) -> int:
    """Shared memory a kernel may take: the GPU's opt-in limit per block, read from the device where Mosaic GPU
    reads it (`jax.local_devices()[0].shared_memory_per_block_optin`, 232448 on an H100/H200); under the
    interpreter (CPU) or where the device does not say, sm90's 227 KiB (SM90_SMEM_BYTES)."""
    if interpret:
        return SM90_SMEM_BYTES
    return getattr(jax.local_devices()[0], "shared_memory_per_block_optin", SM90_SMEM_BYTES)


def fits(config: HopperConfig, *, limit: int, **call) -> bool:
    """Whether every kernel of a call (`call_scratch`'s arguments) fits in `limit` bytes of shared memory."""
    return max(smem_needs(config, **call).values()) <= limit


def check_smem(config: HopperConfig, scratch: KernelScratch, call: str, *, interpret: bool) -> None:
    """ValueError, before anything compiles, when a kernel of `call` (its description) needs more shared memory
    than the device has; the heuristics never get here (`default_config`), a forced `config=` may."""
    needed, limit = scratch.smem_bytes(), smem_limit(interpret)
    if needed > limit:
        raise ValueError(f"{config} needs {needed} bytes of shared memory in the Mosaic {scratch.kernel} kernel "
                         f"({call}), over the device's {limit}: use smaller blocks, fewer stages or fewer "
                         f"compute warpgroups (jax_impl.kernels.hopper.config.smem_needs computes them), or "
                         f"config=None for the heuristic")


# --- heuristics ---------------------------------------------------------------------------------------------------

def default_config(head_dim: int, *, dtype=jnp.bfloat16, out_dtype=None, limit: int = SM90_SMEM_BYTES,
                   documents: bool = False) -> HopperConfig:
    """Heuristic for calls with this head dim, input dtype and forward out dtype (None: the input's; the ring's
    partials ask for float32), with or without `documents` (key spans): the first of these whose every kernel,
    causal and full, fits in `limit` bytes of shared memory (`smem_needs`). The backward's form: one kernel with
    query rows (FA3's form and orientation), where documents are absent, which they refuse (`hopper_backward`); on
    an H200 it ran 518-549 TFLOP/s fwd+bwd at D=128 against the two-kernel form's 489-538 and 409-435 against
    377-406 at D=64 (7 of 8 points; compare/results/kernels-mosaic-query-rows-2026-11-29-h200), 554-573 in full
    attention with its walks staggered; it passed the flash rule in the ring on 1 and 2 GPUs
    (compare/results/gpu-tests-2026-11-29-h200x2), in float16 too (compare/results/gpu-tests-2026-11-29-h200).
    With documents, the two-kernel form. The one-kernel form shares a GQA group's query heads out among CTAs
    (`bwd_head_splits` GQA_HEAD_SPLITS: at most one CTA a query head): at Hkv 8, D=128 fwd+bwd 538 / 543 -> 553 / 573
    TFLOP/s at 64k (causal / full), 525 -> 533 causal at 16k, level in full (556 / 552; compare/results/
    kernels-head-splits-2026-12-02-h200); without GQA it is the same kernel. The configs, in order:
      1. block_kv 128 (FA3's and tokamax's sm90 choice), 2 stages; full attention on three compute warpgroups
         (192-row tiles), at D=128 on a persistent grid: on an H200 (S 16k and 64k, Hkv 32 and 8; compare/results/
         kernels-mosaic-forward-2026-11-23-h200-h12f) fwd 582-594 -> 638-654 TFLOP/s at D=128, 377-444 -> 460-488
         at D=64. Causal keeps two (three lost at some points at D=64 and at D=128). Backward: `bwd_overlap` and
         dq_block_kv 128 (fastest of the 2026-11-23 sweep at D=128 and 64). At D=128 the dQ kernel (Q, dO,
         2 stages x K/V at dq_block_kv 128, an fp32 out tile) takes 231552 bytes: dq_block_q 128 or a third
         stage do not fit. The backward's register split: at D=128 FA3's (producer 24, 240 a compute thread;
         fwd+bwd 481 -> 497 TFLOP/s at 16k causal, ptxas's spill stores 232 -> 144 bytes in the dK/dV kernel and
         112 -> 44 in the dQ kernel), at D=64 producer 40 (393 against 383; no spills at either), as measured on an
         H200 on 2026-11-28 (compare/results/kernels-mosaic-registers-2026-11-28-h200x4).
      2. the same with full attention on two compute warpgroups: an fp32 out tile needs its own buffer beside Q's,
         and at D=128 three warpgroups take 280688 bytes, two 231520; persistent at D=128 as in 1 (two persistent
         warpgroups ran 586-620 TFLOP/s against 552-594 without, bf16 out, same runs).
    `limit`: the device's (`smem_limit`); ValueError if none fits."""
    out_dtype = dtype if out_dtype is None else out_dtype
    fa3_split, wide_producer = BACKWARD_PRODUCER_REGISTERS
    one_kernel = not documents
    preferred = HopperConfig(full_compute_warpgroups=3, persistent=head_dim > 64,
                             bwd_producer_registers=fa3_split if head_dim > 64 else wide_producer,
                             bwd_form="one_kernel" if one_kernel else "two_kernel", bwd_query_rows=one_kernel,
                             bwd_head_splits=GQA_HEAD_SPLITS if one_kernel else 1)
    for config in (preferred, dataclasses.replace(preferred, full_compute_warpgroups=None)):
        if all(fits(config, limit=limit, head_dim=head_dim, dtype=dtype, out_dtype=out_dtype, causal=causal)
               for causal in (True, False)):
            return config
    raise ValueError(f"no Mosaic default fits {limit} bytes of shared memory at head_dim {head_dim}, "
                     f"{jnp.dtype(dtype)} in, {jnp.dtype(out_dtype)} out")


def autotune_space(head_dim: int, *, dtype=jnp.bfloat16, out_dtype=None,
                   limit: int = SM90_SMEM_BYTES) -> tuple[HopperConfig, ...]:
    """Candidates for the Mosaic sweep (`python -m compare.bench.pallas_sweep --family hopper`), each a full config
    timed as one, `default_config` first: the backward's schedule, register split, stages and dQ blocks (on the
    two-kernel form, which has the dQ kernel) one at a time, then the forward's K/V block, stages and warpgroups
    (D=64: a 256-key forward block early), then the other backward forms, at both register splits
    (BACKWARD_PRODUCER_REGISTERS), then every form in the other orientation of the
    dK/dV step (`bwd_query_rows`), then every form in both orientations with the other `bwd_rebuild_descriptors`,
    then the one-kernel forms in both orientations with the other `bwd_stagger`, then the other of `bwd_head_splits`
    1 and GQA_HEAD_SPLITS (the same kernel as the default's without GQA), then Pallas's automatic barriers
    (`bwd_auto_barriers`).
    Register files bound the rest: a dK/dV warpgroup holds dK and dV (2 x bwd_block_kv x D fp32) plus S^T and dP^T, so
    bwd_block_kv stays 64. Shared memory bounds them too: a candidate some kernel of which does not fit in `limit`
    (causal or full, this dtype and out dtype) is left out, not compiled to fail (at D=128: a third stage, forward or
    backward, and dq_block_q 128)."""
    base = default_config(head_dim, dtype=dtype, out_dtype=out_dtype, limit=limit)
    other_split = [producer for producer in BACKWARD_PRODUCER_REGISTERS if producer != base.bwd_producer_registers]
    # the dQ kernel's blocks: on the two-kernel form, the one that has that kernel
    dq_kernel = {} if base.bwd_form == "two_kernel" else dict(bwd_form="two_kernel", bwd_query_rows=False)
    variants = [dict(bwd_overlap=not base.bwd_overlap)] + [dict(bwd_producer_registers=p) for p in other_split] + (
        [dict(block_kv=256)] if head_dim <= 64 else []) + [
        dict(dq_block_kv=64, **dq_kernel), dict(bwd_num_stages=3), dict(dq_block_q=128, dq_block_kv=64, **dq_kernel),
        dict(block_kv=64),
        dict(num_stages=3), dict(full_compute_warpgroups=None, persistent=False)] + (
        [dict(compute_warpgroups=3)] if head_dim <= 64 else []) + [
        dict(bwd_form=form, bwd_producer_registers=producer) for form in BACKWARD_FORMS if form != base.bwd_form
        for producer in (base.bwd_producer_registers, *other_split)] + [
        dict(bwd_form=form, bwd_query_rows=not base.bwd_query_rows) for form in BACKWARD_FORMS] + [
        dict(bwd_form=form, bwd_query_rows=rows, bwd_rebuild_descriptors=not base.bwd_rebuild_descriptors)
        for form in BACKWARD_FORMS for rows in (False, True)] + [
        dict(bwd_form=form, bwd_query_rows=rows, bwd_stagger=not base.bwd_stagger)
        for form in BACKWARD_FORMS if form != "two_kernel" for rows in (False, True)] + [
        dict(bwd_head_splits=1 if base.bwd_head_splits > 1 else GQA_HEAD_SPLITS), dict(bwd_auto_barriers=True)]
    configs = [base] + [dataclasses.replace(base, **change) for change in variants]
    return tuple(config for config in dict.fromkeys(configs)
                 if all(fits(config, limit=limit, head_dim=head_dim, dtype=dtype, out_dtype=out_dtype, causal=causal)
                        for causal in (True, False)))
