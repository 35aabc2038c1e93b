#!/usr/bin/env bash
# Device call 1 of issue 12's third session (nvidia-h200, run from the repository root): the Mosaic backward
# candidates of `jax_impl.flash_hopper_forward.autotune_space` against the default and JAX cuDNN at S=16k, H=32,
# Hkv=32, causal, D=128 then D=64 (75 s of candidates per point). Output: $OUT/sweep.json, sweep.log, summary last.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cp COMMIT "$OUT/commit.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt"
timeout 185 python3 -m compare.bench.pallas_sweep --family mosaic --head-dims 128,64 --causal causal \
    --seq-len 16384 --kv-heads 32 --repeats 5 --budget-s 75 --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1
echo "sweep exit $?"
python3 - "$OUT/sweep.log" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("#"):
        print(line.rstrip()); continue
    if not line.startswith("{") or '"meta"' in line:
        continue
    r = json.loads(line)
    c = r.get("config") or {}
    name = r["impl"] + (" " + ",".join(f"{k}={v}" for k, v in c.items()) if c else "")
    if "error" in r:
        print(f"D={r['head_dim']} {name[:150]}: {r['error'][:150]}")
    else:
        print(f"D={r['head_dim']} fwd {r.get('fwd_tflops', 0):.0f} fwd+bwd {r['fwdbwd_tflops']:.0f} diff {r.get('max_abs_diff', 0):.3g} {name[:200]}")
PY
