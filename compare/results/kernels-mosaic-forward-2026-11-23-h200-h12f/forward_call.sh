#!/usr/bin/env bash
# A device call of helper h12f (nvidia-h200, from the repository root; tokamax wheels carried in ../whl-tokamax):
# the compiled forward forms' GPU tests (and two bf16 contract cases of the default path), then forward_sweep.py
# over issue 12's points. Usage: forward_call.sh SWEEP_BUDGET_S [forward_sweep.py args...]
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
HERE=compare/results/kernels-mosaic-forward-2026-11-23-h200-h12f
T0=$(date +%s)
stamp() { echo "[forward_call] $1 at +$(( $(date +%s) - T0 ))s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$PWD/.peers-site" \
    ../whl-tokamax/*.whl > "$OUT/pip.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:$PWD/.peers-site"
stamp "tokamax wheels: $(tail -1 "$OUT/pip.log")"
cp COMMIT "$OUT/commit.txt"; nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
timeout 110 python3 -m pytest -q -m gpu tests/test_flash_hopper_jax.py::test_gpu_mosaic_forward_forms_meet_the_rule \
    tests/test_flash_hopper_jax.py::test_gpu_mosaic_triton_and_cudnn_meet_the_rule -k "forms or (bf16 and 1024-1024) or (bf16 and 1536)" \
    > "$OUT/gpu-tests.log" 2>&1
stamp "gpu tests exit $?: $(tail -1 "$OUT/gpu-tests.log")"
budget=$1; shift
timeout $((budget + 30)) python3 "$HERE/forward_sweep.py" --budget-s "$budget" --out "$OUT/forward-sweep.json" "$@" \
    > "$OUT/forward-sweep.log" 2>&1
stamp "sweep exit $?"
grep -v "^{" "$OUT/forward-sweep.log" | tail -60
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -5
