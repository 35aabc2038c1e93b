"""What more than one kernel module of the PyTorch backend uses: Triton's interpreter switch (`INTERPRETED`,
`interpreter_problem`), the exp2-domain constants, the `tl` tile helpers the portable forward and backward kernels
share (masked tile loads and stores, rounding as the GPU rounds, the key mask, program and key-range arithmetic, the
documents' span block ranges, `span_block_range`, which the Gluon kernels call too, and the runs of key blocks the
forward and dQ kernels walk: `key_block_runs`), the sequence bucket both families key their configs by, the delta =
rowsum(dout * out) kernel both backwards run, and what the Gluon (Hopper) kernels share: the Triton release they are
written for, their `gluon_jit` decorator and the allocator of their on-device tensor descriptors. Twin of
`jax_impl/kernels/tiles.py`.

Under Triton's interpreter 16-bit tiles are wrong in two silent ways (bf16 is held as uint16, so bf16 dots and
arithmetic are garbage; fp32 -> bf16 casts truncate instead of rounding). With EMULATE set the kernels load every
tile as float32 and round values to the operand dtype themselves (round-to-nearest-even), so the interpreter
computes what the GPU computes: 16-bit operands, exact products, float32 accumulation.

Without CUDA the kernels run in Triton's interpreter, which TRITON_INTERPRET=1 selects: set it before anything
imports triton (the `twinflash` CLI and tests/conftest.py do so when there is no CUDA GPU). Triton decides per
function, when `@triton.jit` decorates it: its own library (tl.sum, tl.max, tl.zeros, ...) when triton is imported,
these kernels when this module is. `interpreter_problem` says why CPU tensors cannot run here when the two disagree
or the interpreter is off; `torch_impl.kernels.flash_attention` raises it as one line.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Read now, exactly as `triton.jit` reads it when it decorates the kernels below.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def interpreter_problem() -> str | None:
    """Why CPU tensors cannot run through the kernels in this process (one line naming the fix), or None when
    Triton's interpreter runs them."""
    fix = ("move them to CUDA, or set TRITON_INTERPRET=1 before anything imports triton (the twinflash CLI and the "
           "tests do so when there is no CUDA GPU)")
    if not INTERPRETED:
        return f"Triton's interpreter is off; {fix}"
    if not isinstance(tl.sum, InterpretedFunction):
        return f"TRITON_INTERPRET=1 was set after triton was imported, so triton's own functions are compiled; {fix}"
    return None


LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # log(x) = log2(x) * LN2


@triton.jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """float32 `x` rounded to DTYPE (round-to-nearest-even). Compiled: a cast to DTYPE. Emulated: float32
    holding DTYPE-representable values, since the interpreter truncates fp32 -> bf16."""
    if EMULATE:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            rounded = bits.to(tl.float32, bitcast=True)
        else:
            rounded = x.to(DTYPE).to(tl.float32)
    else:
        rounded = x.to(DTYPE)
    return rounded


@triton.jit
def load_tile(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr, EMULATE: tl.constexpr):
    """A [rows, BLOCK_D] tile; rows past `n_rows` and columns past HEAD_DIM read as 0. Masks are only
    emitted where they can matter, so interior tiles load unmasked."""
    if CHECK_ROWS:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if BLOCK_D == HEAD_DIM:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    if EMULATE:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def store_tile(ptrs, tile, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               EMULATE: tl.constexpr):
    """Store a float32 tile in the pointee dtype, rows past `n_rows` and columns past HEAD_DIM dropped."""
    value = round_to(tile, ptrs.dtype.element_ty, EMULATE).to(ptrs.dtype.element_ty)
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, value, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, value, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def visible_keys(cols, rows, seq_k, diagonal, span_start, span_end, CAUSAL: tl.constexpr, SPANS: tl.constexpr):
    """[rows, cols] mask of the keys each query row sees: with SPANS those in the row's key span
    [span_start, span_end) (documents, `weights/documents.py`; spans end at seq_k at the latest), else keys before
    seq_k and, if CAUSAL, at most `diagonal` past the row (bottom-right alignment)."""
    if SPANS:
        visible = (cols[None, :] >= span_start[:, None]) & (cols[None, :] < span_end[:, None])
    else:
        visible = cols[None, :] < seq_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + diagonal)
    return visible


@triton.jit
def span_block_range(start_ptr, end_ptr, rows, n_rows, n_cols, BLOCK: tl.constexpr):
    """The spans [start, end) of a block of rows (int32 [rows]; rows past n_rows read as empty) and (first,
    full_first, full_end, end), multiples of BLOCK: blocks [first, end) hold every column any row sees (none when
    every span is empty), and [full_first, full_end) the blocks every row sees whole (no mask needed); the rest of
    [first, end) needs the mask. Returns (start, end, first, full_first, full_end, end). The Gluon (Hopper) kernels
    call it as it is: a tl helper compiles in a Gluon kernel when its tensors come with a layout (`rows` does, and
    it uses no tl.arange), so both families share this one block-range arithmetic."""
    valid = rows < n_rows
    span_start = tl.load(start_ptr + rows, mask=valid, other=0)
    span_end = tl.load(end_ptr + rows, mask=valid, other=0)
    lowest_start, highest_start = tl.min(tl.where(valid, span_start, n_cols)), tl.max(tl.where(valid, span_start, 0))
    lowest_end, highest_end = tl.min(tl.where(valid, span_end, n_cols)), tl.max(tl.where(valid, span_end, 0))
    first = lowest_start // BLOCK * BLOCK
    end = tl.where(highest_end > lowest_start, (highest_end + BLOCK - 1) // BLOCK * BLOCK, first)
    full_first = tl.minimum(tl.maximum((highest_start + BLOCK - 1) // BLOCK * BLOCK, first), end)
    full_end = tl.minimum(tl.maximum(lowest_end // BLOCK * BLOCK, full_first), end)
    return span_start, span_end, first, full_first, full_end, end


@triton.jit
def key_tile_pointers(k_base, v_base, stride_ks, stride_vs, cols, offs_d):
    """Pointers to the [cols, offs_d] tiles of K and V (int64 row offsets: long sequences overflow int32)."""
    k_ptrs = k_base + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + cols.to(tl.int64)[:, None] * stride_vs + offs_d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def key_scores(q, k_ptrs, start_n, offs_n, seq_k, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               MASKED: tl.constexpr, EMULATE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """(cols, k, q k^T) of the key tile starting at start_n: its key indices, the K tile (rows past seq_k read as 0
    when MASKED) and the raw scores."""
    cols = start_n + offs_n
    k = load_tile(k_ptrs, cols, seq_k, offs_d, HEAD_DIM, BLOCK_D, MASKED, EMULATE)
    return cols, k, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def query_block_program(n_heads, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """(batch, head, kv head, first row) of a program of the grid (query blocks, batch * heads). Causal query
    blocks near the end do the most work: they are launched first so the tail of the grid is short."""
    pid_bh = tl.program_id(1)
    batch = pid_bh // n_heads
    head = pid_bh % n_heads
    if CAUSAL:
        block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        block_m = tl.program_id(0)
    return batch, head, head // GROUP, block_m * BLOCK_M


@triton.jit
def key_range(row0, seq_k, diagonal, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(full_end, end) for the query block at row0: keys [0, full_end) are whole BLOCK_N blocks that every row
    sees (no mask needed), keys [full_end, end) the rest that any row sees (masked)."""
    if CAUSAL:  # query i sees key j iff j <= i + diagonal
        full_end = tl.maximum(tl.minimum(row0 + diagonal + 1, seq_k), 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(row0 + BLOCK_M + diagonal, seq_k)
    else:
        full_end = seq_k // BLOCK_N * BLOCK_N
        end = seq_k
    return full_end, end


@triton.jit
def key_block_runs(KeyStart, KeyEnd, batch, row0, seq_q, seq_k, diagonal, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, SPANS: tl.constexpr):
    """The keys the BLOCK_M query rows from row0 visit, as the bounds of the three runs of BLOCK_N key blocks the
    forward and dQ kernels walk in order, [first, full_first) masked, [full_first, full_end) unmasked, [full_end, end)
    masked, with the rows' key spans the masked runs test: (span_start, span_end, first, full_first, full_end, end).
    With documents (SPANS: batch row `batch`'s spans at KeyStart / KeyEnd, [B, seq_q]) `span_block_range`; otherwise
    the first run is empty, the unmasked one starts at key 0 (`key_range`) and the spans are unused zeros."""
    if SPANS:
        spans_row0 = batch.to(tl.int64) * seq_q
        span_start, span_end, first, full_first, full_end, end = span_block_range(
            KeyStart + spans_row0, KeyEnd + spans_row0, row0 + tl.arange(0, BLOCK_M), seq_q, seq_k, BLOCK_N)
    else:
        span_start, span_end, first, full_first = 0, 0, 0, 0
        full_end, end = key_range(row0, seq_k, diagonal, BLOCK_M, BLOCK_N, CAUSAL)
    return span_start, span_end, first, full_first, full_end, end


def spans_or_none(spans, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (start, end) tensors a kernel's span pointers take: the spans', or for a call without documents an empty
    int32 tensor that the kernel (SPANS off) never reads."""
    if spans is not None:
        return spans.start.contiguous(), spans.end.contiguous()
    unused = torch.empty(0, dtype=torch.int32, device=device)
    return unused, unused


def seq_bucket(seq_q: int, seq_k: int) -> int:
    """Autotuning key for the sequence lengths: the power of two above the longer one (at least 1024), so
    a training run with varying lengths tunes a handful of times, not once per length."""
    return max(1024, triton.next_power_of_2(max(seq_q, seq_k)))


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get IEEE dots (the CPU model tests compare against float32 math); 16-bit inputs use
    tensor cores whatever this says."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _delta_kernel(Out, DOut, Delta, stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                  n_heads, seq_q, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_bh = tl.program_id(1)
    batch = pid_bh // n_heads
    head = pid_bh % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    o_ptrs = (Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + offs_d[None, :])
    do_ptrs = (DOut + batch.to(tl.int64) * stride_db + head.to(tl.int64) * stride_dh
               + rows.to(tl.int64)[:, None] * stride_ds + offs_d[None, :])
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * seq_q + rows, tl.sum(o * do, 1), mask=rows < seq_q)


def row_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """delta = rowsum(dout * out), float32 [B, H, Sq], for inputs [B, Sq, H, D] with a contiguous last dim."""
    batch, seq_q, n_heads, head_dim = out.shape
    delta = torch.empty((batch, n_heads, seq_q), dtype=torch.float32, device=out.device)
    delta_block = 32 if INTERPRETED else 64
    _delta_kernel[(triton.cdiv(seq_q, delta_block), batch * n_heads)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), n_heads, seq_q, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=delta_block)
    return delta


# Gluon's API changes between Triton releases; the Hopper kernels are written and checked against this one.
GLUON_TRITON_VERSION = "3.6"
GLUON_AVAILABLE = triton.__version__.startswith(GLUON_TRITON_VERSION + ".")
if GLUON_AVAILABLE:
    from triton.experimental import gluon
    gluon_jit = gluon.jit
else:  # the Gluon kernels are then never compiled or launched; `hopper.config.hopper_unsupported` says why
    def gluon_jit(fn):
        return fn


def set_descriptor_allocator(device: torch.device) -> None:
    """On-device descriptors live in a scratch buffer Triton asks its allocator for at each launch."""
    if INTERPRETED:
        return

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)
