#!/usr/bin/env bash
# Issue 13's Gluon forward on one H200 (the device tool's nvidia-h200), run from the repository root with the image's
# python3 (the checkout on PYTHONPATH): about 390 s in all, each stage under its own `timeout`, so a hung kernel
# costs its stage only.
#   1. smoke   (60 s)  the default config against the portable forward on odd-length GQA inputs, causal and not;
#                      a failure skips the timings and runs the contract tests with -x for the diagnosis
#   2. sweep   (90 s)  compare.bench.gluon_sweep at S=16k, H=Hkv=32, D 128 and 64: configs beside portable, cuDNN
#   3. bench   (160 s) twinflash bench kernels --parts torch at 16k/64k, Hkv 32/8, causal and not, D=$HEAD_DIM
#                      (default 128), backend "triton" (Gluon forward + portable backward), cuDNN and FA2
#   4. tests   (80 s)  the gpu tests of tests/test_flash_gluon_torch.py (the contract against fp64, portable, cuDNN)
# Everything lands in $OUT (default ./out): one log and JSON per stage; the stage summary is printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
HEAD_DIM=${HEAD_DIM:-128}
summary=()

stage() {  # stage NAME SECONDS COMMAND...: run it under a timeout, log to $OUT/NAME.log, remember its exit status
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    summary+=("$name: exit $status after $((SECONDS - start)) s")
    tail -n 25 "$OUT/$name.log"
    return $status
}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } > "$OUT/env.txt" 2>&1

smoke='
import torch
from torch_impl.flash_forward import triton_forward
from torch_impl.flash_gluon_forward import gluon_forward
torch.manual_seed(0)
q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(2, 1300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
worst = 0.0
for causal in (True, False):
    want, want_lse = triton_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
    got, got_lse = gluon_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
    torch.cuda.synchronize()
    diffs = ((got - want).abs().max().item(), (got_lse - want_lse).abs().max().item())
    print("causal", causal, "max |out diff|, |lse diff|", diffs, flush=True)
    worst = max(worst, diffs[0])
raise SystemExit(0 if worst < 2e-2 else 1)
'
if stage smoke 60 python3 -c "$smoke"; then
    stage sweep 90 python3 -m compare.bench.gluon_sweep --seq-len 16384 --heads 32 --kv-heads 32 \
        --head-dims 128,64 --out "$OUT/gluon-sweep.json"
    stage bench 160 python3 -m compare.cli bench kernels --parts torch --seq-lens 16k,64k --kv-heads 32,8 \
        --head-dim "$HEAD_DIM" --part-timeout-s 140 --out "$OUT/kernels-d$HEAD_DIM.json"
    stage tests 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flash_gluon_torch.py
else
    stage tests 90 python3 -m pytest -x -q -m gpu -p no:cacheprovider tests/test_flash_gluon_torch.py
fi
printf '%s\n' "${summary[@]}"
