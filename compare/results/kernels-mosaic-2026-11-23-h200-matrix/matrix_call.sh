#!/usr/bin/env bash
# Device call 2 of issue 12's third session (nvidia-h200, run from the repository root; the tokamax wheels carried
# in .carry/whl-tokamax): the Mosaic GPU tests (ring first), then issue 12's acceptance matrix with
# `bench kernels --parts jax`: S 16k and 64k, Hkv 32 and 8, causal and not, D 128 and 64, ours (pallas_mosaic,
# the default HopperConfig), JAX cuDNN and tokamax (its heuristic config: tokamax's cache-miss fallback is
# "heuristics" unless told otherwise, so nothing autotunes). Every step under a timeout; ~410 s in all.
# Output: $OUT/*.log, $OUT/kernels-*.json, summary printed last.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[matrix_call] $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PWD/.peers-site" \
    ../whl-tokamax/*.whl > "$OUT/pip.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$PWD/.peers-site"
stamp "tokamax wheels: $(tail -1 "$OUT/pip.log")"
cp COMMIT "$OUT/commit.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
timeout 80 python3 -m pytest -q -m gpu tests/test_flash_hopper_jax.py::test_gpu_ring_pairs_with_external_lse_meet_the_rule \
    tests/test_flash_hopper_jax.py::test_gpu_mosaic_triton_and_cudnn_meet_the_rule -k "ring or bf16" \
    > "$OUT/gpu-tests.log" 2>&1
stamp "gpu tests exit $?: $(tail -1 "$OUT/gpu-tests.log")"
bench() {  # bench NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m compare.cli bench kernels --parts jax --kv-heads 32,8 --head-dim 128,64 \
        --impls pallas_mosaic,jax_cudnn,tokamax --part-timeout-s $((limit - 10)) "$@" \
        --out "$OUT/kernels-$name.json" > "$OUT/bench-$name.log" 2>&1
    stamp "bench $name exit $?"
}
bench 16k 160 --seq-lens 16k --jax-repeats 5
bench 64k $(( 408 - ($(date +%s) - T0) )) --seq-lens 64k --jax-repeats 3
grep -h "^\[kernel bench\] pallas\|^\[kernel bench\] jax_cudnn\|^\[kernel bench\] tokamax" "$OUT"/bench-*.log | cut -c1-110
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
