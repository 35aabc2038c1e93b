#!/usr/bin/env bash
# Issue 13's Gluon kernels on one H200 (the device tool's nvidia-h200), run from the repository root with the image's
# python3 (the checkout on PYTHONPATH): `bash compare/bench/gpu_gluon.sh [STAGES]`, STAGES a comma list (default
# smoke,sweep,tests,bench, run in that order), each stage under its own `timeout`, so a hung kernel costs its stage
# only; last, a short table of the bench (fwd+bwd TF/s per implementation, and the backward's alone for ours).
#   smoke   (60 s)  the default configs against the portable kernels on odd-length GQA inputs, causal and not: the
#                   forward, and the backward from the Gluon forward's out/lse; when it fails the later stages are
#                   skipped and the contract tests run with -x for the diagnosis
#   sweep   ($SWEEP_S, 90 s)  compare.bench.gluon_sweep --direction $SWEEP_DIRECTION (forward) at S=16k,
#                   H=Hkv=32, D $SWEEP_HEAD_DIMS (128,64), $SWEEP_CAUSAL (both): configs beside the portable
#                   kernel and cuDNN
#   bench   ($BENCH_S, 160 s)  twinflash bench kernels --parts torch at $SEQ_LENS (16k,64k), Hkv 32/8, $CAUSAL (both),
#                   D=$HEAD_DIM (128; a list like 128,64 runs one D after the other), backend "triton" (the Gluon
#                   kernels both ways where they run the call), cuDNN and FA2, plus the forced paths in
#                   $TRITON_PATHS (none; triton_hopper: the Gluon kernels both ways)
#   tests   ($TESTS_S, 80 s)  the gpu tests of $TEST_FILES (tests/test_kernels_hopper_torch.py; contract against fp64,
#                   portable, cuDNN), those matching $TESTS_K when set
# Everything lands in $OUT (default ./out): one log and JSON per stage; the stage summary is printed last.
# The Gluon backward's config sweep (issue 13, first of the tuning runs; about 320 s at most):
#   SWEEP_DIRECTION=backward SWEEP_S=250 timeout 325 bash compare/bench/gpu_gluon.sh smoke,sweep
# and its second run (the non-causal walks' stagger, the contract tests, the bench at D=128; about 325 s):
#   SWEEP_DIRECTION=backward SWEEP_HEAD_DIMS=128 SWEEP_CAUSAL=full SWEEP_S=45 TESTS_S=105 BENCH_S=150 HEAD_DIM=128 \
#   TRITON_PATHS=triton_hopper \
#   TEST_FILES="tests/test_kernels_hopper_backward_torch.py tests/test_kernels_hopper_torch.py" \
#   TESTS_K="backward or ring or cudnn" timeout 325 bash compare/bench/gpu_gluon.sh smoke,sweep,tests,bench
# The warp-specialised backward's sweep with every config's contract against the portable backward (about 210 s):
#   SWEEP_DIRECTION=backward SWEEP_S=190 TESTS_S=95 TEST_FILES=tests/test_kernels_hopper_backward_torch.py \
#   TESTS_K=external timeout 325 bash compare/bench/gpu_gluon.sh smoke,sweep,tests
# and its tests and bench at both head dims (the bench about 130 s; give the tests more than 55 s):
#   SEQ_LENS=16k,64k HEAD_DIM=128,64 BENCH_S=240 TESTS_S=55 TEST_FILES="tests/test_kernels_hopper_backward_torch.py \
#   tests/test_kernels_hopper_torch.py" TESTS_K="(backward or ring) and not external" timeout 326 \
#   bash compare/bench/gpu_gluon.sh smoke,tests,bench
# The Gluon backward's run (issue 13; about 410 s at most):
#   SWEEP_DIRECTION=backward SWEEP_S=50 TESTS_S=120 BENCH_S=180 HEAD_DIM=128,64 TRITON_PATHS=triton_hopper \
#   TEST_FILES="tests/test_kernels_hopper_backward_torch.py tests/test_kernels_hopper_torch.py" \
#   TESTS_K="backward or ring or cudnn" timeout 418 bash compare/bench/gpu_gluon.sh smoke,sweep,tests,bench
# The forward's three-consumer (D=64) run: its sweep, then the contract tests and the issue-13 matrix (about 220 s
# each; compare/results/kernels-gluon-forward-2026-11-23-h200-h13e):
#   SWEEP_HEAD_DIMS=64 SWEEP_S=130 TESTS_S=50 TESTS_K="configs and 64" timeout 245 \
#   bash compare/bench/gpu_gluon.sh smoke,sweep,tests
#   SEQ_LENS=16k,64k HEAD_DIM=128,64 BENCH_S=200 TESTS_S=90 TESTS_K="not configs" timeout 326 \
#   bash compare/bench/gpu_gluon.sh smoke,tests,bench
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STAGES=",${1:-smoke,sweep,bench,tests},"
HEAD_DIM=${HEAD_DIM:-128} SEQ_LENS=${SEQ_LENS:-16k,64k} CAUSAL=${CAUSAL:-both} TRITON_PATHS=${TRITON_PATHS:-}
SWEEP_DIRECTION=${SWEEP_DIRECTION:-forward} TEST_FILES=${TEST_FILES:-tests/test_kernels_hopper_torch.py}
SWEEP_HEAD_DIMS=${SWEEP_HEAD_DIMS:-128,64} SWEEP_CAUSAL=${SWEEP_CAUSAL:-both}
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
from torch_impl.kernels.portable.backward import portable_backward
from torch_impl.kernels.portable.forward import portable_forward
from torch_impl.kernels.hopper.backward import hopper_backward
from torch_impl.kernels.hopper.forward import hopper_forward
torch.manual_seed(0)
q, dout = (torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
k, v = (torch.randn(2, 1300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
worst = worst_grad = 0.0
for causal in (True, False):
    want, want_lse = portable_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
    got, got_lse = hopper_forward(q, k, v, causal=causal, softmax_scale=0.1, out_dtype=torch.float32)
    torch.cuda.synchronize()
    diffs = ((got - want).abs().max().item(), (got_lse - want_lse).abs().max().item())
    print("causal", causal, "max |out diff|, |lse diff|", diffs, flush=True)
    worst = max(worst, diffs[0])
    grads = [f(dout, q, k, v, got, got_lse, causal=causal, softmax_scale=0.1, grad_dtype=torch.float32)
             for f in (portable_backward, hopper_backward)]
    torch.cuda.synchronize()
    # relative to the largest gradient: both round P and dS to bf16, against differently summed scores
    rel = [((g - w).abs().max() / w.abs().max()).item() for w, g in zip(*grads)]
    print("causal", causal, "max |d(dq, dk, dv)| / max |(dq, dk, dv)|", rel, flush=True)
    worst_grad = max(worst_grad, *rel)
raise SystemExit(0 if worst < 2e-2 and worst_grad < 2e-2 else 1)
'
wanted() { [[ $STAGES == *",$1,"* ]]; }
tests=(python3 -m pytest -q -m gpu -p no:cacheprovider $TEST_FILES ${TESTS_K:+-k "$TESTS_K"})
if wanted smoke && ! stage smoke 60 python3 -c "$smoke"; then
    stage tests "${TESTS_S:-80}" "${tests[@]}" -x
    STAGES=""
fi
if wanted sweep; then
    stage "sweep-$SWEEP_DIRECTION" "${SWEEP_S:-90}" python3 -m compare.bench.gluon_sweep --seq-len 16384 --heads 32 \
        --kv-heads 32 --head-dims "$SWEEP_HEAD_DIMS" --causal "$SWEEP_CAUSAL" --direction "$SWEEP_DIRECTION" \
        --out "$OUT/gluon-sweep-$SWEEP_DIRECTION.json"
fi
if wanted tests; then
    stage tests "${TESTS_S:-80}" "${tests[@]}"
fi
if wanted bench; then
    name="kernels-d${HEAD_DIM//,/-}-${SEQ_LENS//,/-}-$CAUSAL"
    stage "$name" "${BENCH_S:-160}" python3 -m compare.cli bench kernels --parts torch --seq-lens "$SEQ_LENS" \
        --kv-heads 32,8 --causal "$CAUSAL" --head-dim "$HEAD_DIM" ${TRITON_PATHS:+--triton-paths "$TRITON_PATHS"} \
        --part-timeout-s $(( ${BENCH_S:-160} - 20 )) --out "$OUT/$name.json"
    [ -f "$OUT/$name.json" ] && python3 - "$OUT/$name.json" <<'TABLE'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if "fwdbwd_ms" in r]
impls = list(dict.fromkeys(r["impl"] for r in rows))
print("fwd+bwd TF/s (bwd alone, credited 2.5 fwd, for ours):", " | ".join(impls))
for point in dict.fromkeys((r["head_dim"], r["S"], r["causal"], r["kv_heads"]) for r in rows):
    cells = []
    for impl in impls:
        at = [r for r in rows if (r["head_dim"], r["S"], r["causal"], r["kv_heads"]) == point and r["impl"] == impl]
        if not at:
            cells.append("-")
            continue
        r = at[0]
        bwd = 2.5 * r["fwd_tflops"] * r["fwd_ms"] / (r["fwdbwd_ms"] - r["fwd_ms"])
        cells.append(f"{r['fwdbwd_tflops']:.0f}" + (f" ({bwd:.0f})" if impl.startswith("triton") else ""))
    print("D={} S={} causal={} Hkv={}:".format(*point), " | ".join(cells))
TABLE
fi
printf '%s\n' "${summary[@]}"
