#!/usr/bin/env bash
# The one nvidia-h200 call of issue 12's second session (run from the repository root; the tokamax wheels carried in
# .carry/whl-tokamax): Mosaic GPU tests (one-kernel backward the default), a 3-step JAX training sanity run with
# the Mosaic kernels, then `bench kernels --parts jax` with both backward forms, JAX cuDNN and tokamax.
# Every step under a timeout; ~400 s in all. Output: $OUT/*.log, $OUT/kernels-*.json, summary printed last.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[gpu_call] $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PWD/.peers-site" \
    ../whl-tokamax/*.whl > "$OUT/pip.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$PWD/.peers-site"
stamp "tokamax wheels: $(tail -1 "$OUT/pip.log")"
cp COMMIT "$OUT/commit.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
timeout 110 python3 -m pytest -q -m gpu -x tests/test_flash_hopper_jax.py > "$OUT/gpu-tests-mosaic.log" 2>&1
stamp "gpu tests exit $?: $(tail -1 "$OUT/gpu-tests-mosaic.log")"
timeout 80 python3 -m compare.cli train --backend jax --model llama3.2-1b --seq-len 8192 --steps 3 --data random \
    --dtype bf16 --attention-backend pallas_mosaic --out "$OUT/train-1b-mosaic" > "$OUT/train-1b-mosaic.log" 2>&1
stamp "train exit $?: $(tail -2 "$OUT/train-1b-mosaic.log" | tr '\n' ' ')"
bench() {  # bench NAME TIMEOUT ARGS...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m compare.cli bench kernels --parts jax --kv-heads 32,8 --head-dim 128,64 \
        --impls pallas_mosaic,pallas_mosaic_two_kernel,jax_cudnn,tokamax --jax-repeats 5 \
        --part-timeout-s $((limit - 10)) "$@" --out "$OUT/kernels-$name.json" > "$OUT/bench-$name.log" 2>&1
    stamp "bench $name exit $?"
}
bench 16k 170 --seq-lens 16k
bench 64k $(( 405 - ($(date +%s) - T0) )) --seq-lens 64k --causal causal
grep -h "^\[kernel bench\] pallas\|^\[kernel bench\] jax_cudnn\|^\[kernel bench\] tokamax" "$OUT"/bench-*.log | cut -c1-150
tail -4 "$OUT/gpu-tests-mosaic.log"
