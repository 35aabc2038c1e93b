#!/usr/bin/env bash
# Device call 2 of task h12g (nvidia-h200, from the repository root): ptxas reports of every Mosaic compile
# (MOSAIC_GPU_DUMP_PTXAS), attribute.py --call2, then the GPU tests of the one-kernel forms.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
cp COMMIT "$OUT/commit.txt"
MOSAIC_GPU_DUMP_PTXAS=1 timeout 330 python3 \
    compare/results/kernels-mosaic-backward-profile-2026-11-23-h200-h12g/attribute.py "$OUT" --call2 \
    > "$OUT/attribute2.log" 2>&1
echo "attribute exit $? at +$(( $(date +%s) - T0 ))s"
timeout $(( 440 - ($(date +%s) - T0) )) python3 -m pytest -q -m gpu tests/test_flash_hopper_jax.py \
    -k backward_forms > "$OUT/gpu-tests.log" 2>&1
echo "gpu tests exit $?: $(tail -1 "$OUT/gpu-tests.log")"
grep -iE "spill|serializ|Potential|Used [0-9]+ registers|Compiling entry|Function properties" "$OUT/attribute2.log" \
    | sort | uniq -c | sort -rn | head -20
grep -v '^{' "$OUT/attribute2.log" | grep -viE "warn|ptxas|spill|registers|Function|Compiling|bytes" | tail -24
