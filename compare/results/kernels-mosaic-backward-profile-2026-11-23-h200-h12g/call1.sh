#!/usr/bin/env bash
# Device call 1 of task h12g (nvidia-h200, from the repository root): attribute.py (variants + in-kernel profile).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
python3 -c "import jax, torch; print('jax', jax.__version__, 'torch', torch.__version__)" >> "$OUT/gpu.txt" 2>&1
timeout 430 python3 compare/results/kernels-mosaic-backward-profile-2026-11-23-h200-h12g/attribute.py "$OUT" \
    > "$OUT/attribute.log" 2>&1
echo "exit $?"
grep -v '^{' "$OUT/attribute.log" | grep -v Warning | tail -40
