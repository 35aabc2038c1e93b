"""The torch backend's Triton kernels compile for the GPU they are written for (sm_90), checked on a CPU machine.

CI runs the kernels in Triton's interpreter, which executes their Python and never compiles them: an error that
only the compiler sees (a layout, a descriptor, a type) would reach a GPU untested. Triton's compiler runs without
a GPU when it is given the target, so each kernel is compiled here, ahead of time, for sm_90 at the launch configs
the wrappers use, causal and not; nothing is launched. The compiled PTX must hold the matrix instructions the
kernel is built around (a kernel whose dots were lost would still compile). A kernel given a block size its
`tl.arange` cannot take must fail to compile: the negative control that the check compiles for real. The Gluon
kernels compile only where the installed Triton is the release they are written for (the GPU image's 3.6), else
skip; the Gluon backward's registers (from ptxas) and shared memory must also fit an sm_90 block. Every kernel is
also compiled with documents' spans on (SPANS), as the dispatcher runs it for packed documents (the causal rule
folded into the spans: CAUSAL off).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from compare.bench.gluon_sweep import backward_candidates, candidates
from torch_impl.kernels.tiles import GLUON_AVAILABLE, GLUON_TRITON_VERSION

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh process: this test session's kernels were defined for the interpreter (conftest), and Triton
# fixes that choice when a kernel is decorated.
_COMPILE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
import torch_impl.kernels.portable.forward as ff, torch_impl.kernels.portable.backward as fb
import torch_impl.kernels.tiles as tiles

FP32_POINTERS = {"Lse", "Delta", "DQ", "DK", "DV"}
INT32_POINTERS = {"KeyStart", "KeyEnd", "QueryStart", "QueryEnd"}  # documents' spans

def jit_function(kernel):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn  # through @autotune / @heuristics
    return kernel

def compile_for_sm90(kernel, constexprs, warps, stages):
    fn = jit_function(kernel)
    signature = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif p.name == "SEQ_BUCKET":
            signature[p.name] = "i32"
        elif p.name[0].isupper():
            signature[p.name] = ("*fp32" if p.name in FP32_POINTERS else "*i32" if p.name in INT32_POINTERS
                                 else "*bf16")
        else:
            signature[p.name] = "fp32" if "scale" in p.name else "i32"
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]

portable = dict(HEAD_DIM=128, BLOCK_D=int(sys.argv[1]), EMULATE=False, GROUP=4, DOT_PRECISION="ieee")
for causal, spans in ((True, False), (False, False), (False, True)):  # documents' spans replace the causal rule
    mask = dict(portable, CAUSAL=causal, SPANS=spans)
    cases = [
        ("forward", ff._forward_kernel, dict(mask, BLOCK_M=128, BLOCK_N=64), 8, 3, "mma"),
        ("delta", tiles._delta_kernel, dict(HEAD_DIM=128, BLOCK_D=portable["BLOCK_D"], BLOCK_M=64), 4, 1, None),
        ("dkdv", fb._dkdv_kernel, dict(mask, BLOCK_M=64, BLOCK_N=128), 8, 2, "mma"),
        ("dq", fb._dq_kernel, dict(mask, BLOCK_M=128, BLOCK_N=64), 8, 2, "mma"),
    ]
    for name, kernel, constexprs, warps, stages, matrix_op in cases:
        ptx = compile_for_sm90(kernel, constexprs, warps, stages)
        if matrix_op is not None and matrix_op not in ptx:
            sys.exit(f"{name} (causal={causal}, spans={spans}): no {matrix_op} instruction in its PTX")
        print(f"compiled {name} causal={causal} spans={spans}", flush=True)
"""


# The Gluon forward at both head dims in every config the sweep times (compare.bench.gluon_sweep; the GPU tests
# launch them all), causal and not, and the non-causal ones with documents' spans: its PTX must hold the warpgroup
# matmuls, the TMA tile loads and the register hand-over between the warp-specialised partitions; ptxas must keep
# the matmuls asynchronous, and its registers (ptxas's count, whose spills it reports) and shared memory must fit
# one sm_90 block.
_GLUON_COMPILE_CHECK = r"""
import contextlib, io, os, re, sys
os.environ["TRITON_INTERPRET"] = "0"
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached kernel would skip ptxas and its log
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

SM90_REGISTERS, SM90_SHARED_BYTES = 65536, 227 * 1024  # per block
FP32_POINTERS = {"Lse2", "Lse", "Delta", "DQ", "DK", "DV"}
INT32_POINTERS = {"KeyStart", "KeyEnd", "QueryStart", "QueryEnd"}  # documents' spans


def signature_of(fn):
    return {p.name: "constexpr" if p.is_constexpr else "*fp32" if p.name in FP32_POINTERS else "*i32"
            if p.name in INT32_POINTERS else "*bf16" if p.name[0].isupper() else "fp32" if "scale" in p.name
            else "i32" for p in fn.params}


def compile_checked(fn, signature, constexprs, options, ops, name):
    # compiles a Gluon kernel for sm_90; exits naming `name` when its PTX lacks one of `ops`, ptxas serialized its
    # wgmma or it does not fit one block; prints its registers, spills and shared memory
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    for op in ops:
        if op not in kernel.asm["ptx"]:
            sys.exit(f"{name}: no {op} in its PTX")
    if "wgmma.mma_async instructions are serialized" in log.getvalue():
        sys.exit(f"{name}: ptxas serialized its wgmma: {log.getvalue()}")
    registers = int(re.search(r"Used (\d+) registers", log.getvalue()).group(1))
    spills = re.search(r"(\d+) bytes spill stores", log.getvalue())
    threads = int(re.search(r"\.reqntid (\d+)", kernel.asm["ptx"]).group(1))
    if registers * threads > SM90_REGISTERS or kernel.metadata.shared > SM90_SHARED_BYTES:
        sys.exit(f"{name}: {registers} registers x {threads} threads, {kernel.metadata.shared} B shared "
                 f"exceed an sm_90 block")
    print(f"compiled {name}: {registers} registers x {threads} threads, "
          f"{spills.group(1) if spills else 0} B spilled, {kernel.metadata.shared} B shared", flush=True)
"""

_COMPILE_GLUON = _GLUON_COMPILE_CHECK + r"""
import torch_impl.kernels.hopper.forward as gf
from compare.bench.gluon_sweep import candidates

fn = gf._gluon_forward_kernel
for head_dim in (128, 64):
    for causal, spans in ((True, False), (False, False), (False, True)):  # documents: the non-causal configs
        for config in candidates(head_dim, causal):
            q_layout, kv_layout = gf.shared_layouts(torch.bfloat16, head_dim, config.block_n)
            constexprs = dict(HEAD_DIM=head_dim, CAUSAL=causal, SPANS=spans, CONSUMERS=config.consumers,
                              BLOCK_N=config.block_n, NUM_STAGES=config.num_stages, PINGPONG=config.pingpong,
                              Q_LAYOUT=q_layout, KV_LAYOUT=kv_layout, CONSUMER_REGS=config.consumer_regs,
                              PRODUCER_REGS=config.producer_regs)
            compile_checked(fn, signature_of(fn), constexprs, {"num_warps": 4, "maxnreg": config.max_regs},
                            ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg"),
                            f"gluon forward D={head_dim} causal={causal} spans={spans} {config}")
"""


# The Gluon backward at both head dims in every config the sweep times (compare.bench.gluon_sweep; the GPU tests launch
# them all), dQ by vector atomics and the lockstep form with a GQA group's heads split, causal and not, the non-causal
# ones with documents' spans too, in both forms (lockstep; warp-specialised, whose PTX must also hand registers over
# between its partitions): the warpgroup matmuls, TMA loads and dq's float32 reductions (TMA reduce-add or atomics) must
# be in its PTX; ptxas must keep the matmuls asynchronous (it serializes them all when it cannot prove a pipeline safe,
# and says so); its registers (ptxas's count, whose spills it reports) and shared memory must fit one sm_90 block.
_COMPILE_GLUON_BACKWARD = _GLUON_COMPILE_CHECK + r"""
import dataclasses, math
import torch_impl.kernels.hopper.backward as gb
import torch_impl.kernels.hopper.backward_ws as gws
from torch_impl.kernels.hopper.config import GQA_HEAD_SPLITS, HopperBackwardConfig, lockstep_config
from compare.bench.gluon_sweep import backward_candidates

GROUP = 4  # query heads per KV head (H 32, Hkv 8): a config's head_splits compile as the wrapper's gcd with it

REDUCTION_OPS = {"tma": "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add",
                 "vector_atomics": "red.relaxed.gpu.global.add.v2.f32"}
atomics = HopperBackwardConfig(**{**vars(lockstep_config(128)), "dq_reduction": "vector_atomics"})
lockstep_split = dataclasses.replace(lockstep_config(128), head_splits=GQA_HEAD_SPLITS)
for head_dim in (128, 64):
    for causal, spans in ((True, False), (False, False), (False, True)):  # documents: the non-causal configs
        for config in backward_candidates(head_dim, causal) + ([atomics, lockstep_split] if head_dim == 128 else []):
            layouts = gb.shared_layouts(torch.bfloat16, head_dim, config)
            constexprs = dict(HEAD_DIM=head_dim, CAUSAL=causal, SPANS=spans, BLOCK_M=config.block_m,
                              NUM_STAGES=config.num_stages, STAGGER=config.stagger,
                              HEAD_SPLITS=math.gcd(config.head_splits, GROUP),
                              **dict(zip(("Q_LAYOUT", "KV_LAYOUT", "DS_LAYOUT", "STATS_LAYOUT", "DQ_LAYOUT"), layouts)))
            ops = ["wgmma.mma_async", "cp.async.bulk.tensor", REDUCTION_OPS[config.dq_reduction]]
            options = {"num_warps": config.num_warps}
            if config.warp_specialize:
                fn = gws.gluon_backward_ws_kernel
                constexprs.update(DQ_BUFFERS=config.dq_buffers, KV_IN_REGS=config.kv_in_regs,
                                  LSE_FIRST=config.lse_first, DQ_REGISTER_ORDER=config.dq_register_order,
                                  DQ_STORE_LAYOUT=gb.dq_store_layout(head_dim, config, layouts[4]),
                                  CONSUMER_REGS=config.consumer_regs, PRODUCER_REGS=config.producer_regs)
                options["maxnreg"] = config.max_regs
                ops.append("setmaxnreg")
            else:
                fn = gb._gluon_backward_kernel
                constexprs.update(BLOCK_N=config.block_n, DQ_REDUCTION=config.dq_reduction,
                                  DP_FIRST=config.dp_first)
            compile_checked(fn, signature_of(fn), constexprs, options, ops,
                            f"gluon backward D={head_dim} causal={causal} spans={spans} {config}")
"""


def _compile(block_d: int, script: str = _COMPILE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, "-c", script, str(block_d)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_every_triton_kernel_compiles_for_sm90():
    done = _compile(block_d=128)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("compiled ") == 12  # 4 kernels x (causal, full, documents' spans)


def test_a_kernel_the_compiler_rejects_fails_the_check():
    done = _compile(block_d=96)  # tl.arange needs a power of two: the compiler, not the interpreter, says so
    assert done.returncode != 0
    assert "compiled forward" not in done.stdout


# The Gluon checks need the Triton release the kernels are written for, which CI's CPU install lacks and the GPU image
# has: marked gpu so that the GPU runs (`pytest -m gpu`) take them, though they launch nothing.
@pytest.mark.gpu
@pytest.mark.skipif(not GLUON_AVAILABLE, reason=f"the Gluon kernel is written for Triton {GLUON_TRITON_VERSION} "
                                                f"(Gluon's API changes between releases)")
def test_gluon_forward_compiles_for_sm90_within_its_registers_and_shared_memory():
    done = _compile(block_d=128, script=_COMPILE_GLUON)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    configs = sum(len(candidates(head_dim, causal)) for head_dim in (128, 64)
                  for causal, _spans in ((True, False), (False, False), (False, True)))
    assert done.stdout.count("compiled gluon forward") == configs, done.stdout
    print(done.stdout)


@pytest.mark.gpu
@pytest.mark.skipif(not GLUON_AVAILABLE, reason=f"the Gluon kernel is written for Triton {GLUON_TRITON_VERSION} "
                                                f"(Gluon's API changes between releases)")
def test_gluon_backward_compiles_for_sm90_within_its_registers_and_shared_memory():
    done = _compile(block_d=128, script=_COMPILE_GLUON_BACKWARD)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    per_mask = {causal: sum(len(backward_candidates(head_dim, causal)) + 2 * (head_dim == 128)
                            for head_dim in (128, 64))
                for causal in (True, False)}  # + dQ by vector atomics and the lockstep form's head splits at D=128
    assert done.stdout.count("compiled gluon backward") == per_mask[True] + 2 * per_mask[False], done.stdout
    assert done.stdout.count("spans=True") == per_mask[False], done.stdout
    print(done.stdout)
