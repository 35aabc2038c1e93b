#!/usr/bin/env bash
# Device call 1 of task h12e (nvidia-h200, run from the repository root): the one-kernel backward's GPU tests,
# then the backward candidates (`pallas_sweep --backward-only`: the default and `backward_variants(D)`) beside
# JAX cuDNN at S=16k, H=Hkv=32, causal, D=128 then D=64. Output: $OUT/*.log, $OUT/sweep.json, summary last.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[sweep_call] $1 at +$(( $(date +%s) - T0 ))s"; }
cp COMMIT "$OUT/commit.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
timeout 100 python3 -m pytest -q -x -m gpu tests/test_flash_hopper_jax.py -k one_kernel_backward > "$OUT/gpu-tests.log" 2>&1
stamp "gpu tests exit $?: $(tail -1 "$OUT/gpu-tests.log")"
timeout $(( 405 - ($(date +%s) - T0) )) python3 -m compare.bench.pallas_sweep --family mosaic --backward-only \
    --head-dims 128,64 --causal causal --seq-len 16384 --kv-heads 32 --repeats 5 --budget-s 120 \
    --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
stamp "sweep exit $?"
python3 - "$OUT/sweep.log" <<'PY'
import json, sys
base = {"bwd_form": "two_kernel", "bwd_overlap": True, "bwd_compute_registers": 232, "dq_block_kv": 128,
        "bwd_num_stages": 2, "dq_block_q": 64}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        print(line.rstrip()); continue
    if not line.startswith("{") or '"meta"' in line:
        continue
    r = json.loads(line)
    c = r.get("config") or {}
    name = r["impl"] + " " + ",".join(f"{k}={v}" for k, v in c.items() if k in base and v != base[k])
    if "error" in r:
        print(f"D={r['head_dim']} {name}: {r['error'][:150]}")
    else:
        print(f"D={r['head_dim']} fwd {r.get('fwd_tflops', 0):.0f} fwd+bwd {r['fwdbwd_tflops']:.0f} "
              f"diff {r.get('max_abs_diff', 0):.3g} {name}")
PY
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -3
