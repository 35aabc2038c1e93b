#!/usr/bin/env bash
# Issue 13's Gluon forward on one H200 (the device tool's nvidia-h200), run from the repository root with the image's
# python3 (the checkout on PYTHONPATH): `bash compare/bench/gpu_gluon.sh [STAGES]`, STAGES a comma list (default
# smoke,sweep,bench,tests: about 390 s), each stage under its own `timeout`, so a hung kernel costs its stage only.
#   smoke   (60 s)  the default config against the portable forward on odd-length GQA inputs, causal and not;
#                   when it fails the later stages are skipped and the contract tests run with -x for the diagnosis
#   sweep   (90 s)  compare.bench.gluon_sweep at S=16k, H=Hkv=32, D 128 and 64: configs beside portable, cuDNN
#   bench   ($BENCH_S, 160 s)  twinflash bench kernels --parts torch at $SEQ_LENS (16k,64k), Hkv 32/8, $CAUSAL (both),
#                   D=$HEAD_DIM (128), backend "triton" (Gluon forward + portable backward), cuDNN and FA2, plus the
#                   forced paths in $TRITON_PATHS (none)
#   tests   ($TESTS_S, 80 s)  the gpu tests of tests/test_flash_gluon_torch.py (contract against fp64, portable,
#                   cuDNN), those matching $TESTS_K when set
# Everything lands in $OUT (default ./out): one log and JSON per stage; the stage summary is printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=",${1:-smoke,sweep,bench,tests},"
HEAD_DIM=${HEAD_DIM:-128} SEQ_LENS=${SEQ_LENS:-16k,64k} CAUSAL=${CAUSAL:-both} TRITON_PATHS=${TRITON_PATHS:-}
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
} > "$OUT/env.txt" 2>&1

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
wanted() { [[ $STAGES == *",$1,"* ]]; }
tests=(python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_flash_gluon_torch.py ${TESTS_K:+-k "$TESTS_K"})
if wanted smoke && ! stage smoke 60 python3 -c "$smoke"; then
    stage tests "${TESTS_S:-80}" "${tests[@]}" -x
    STAGES=""
fi
if wanted sweep; then
    stage sweep 90 python3 -m compare.bench.gluon_sweep --seq-len 16384 --heads 32 --kv-heads 32 \
        --head-dims 128,64 --out "$OUT/gluon-sweep.json"
fi
if wanted bench; then
    name="kernels-d$HEAD_DIM-${SEQ_LENS//,/-}-$CAUSAL"
    stage "$name" "${BENCH_S:-160}" python3 -m compare.cli bench kernels --parts torch --seq-lens "$SEQ_LENS" \
        --kv-heads 32,8 --causal "$CAUSAL" --head-dim "$HEAD_DIM" ${TRITON_PATHS:+--triton-paths "$TRITON_PATHS"} \
        --part-timeout-s $(( ${BENCH_S:-160} - 20 )) --out "$OUT/$name.json"
fi
if wanted tests; then
    stage tests "${TESTS_S:-80}" "${tests[@]}"
fi
printf '%s\n' "${summary[@]}"
