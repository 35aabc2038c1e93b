#!/usr/bin/env bash
# Issue 22's GPU acceptance on a 2x H200 host (the device tool's nvidia-h200-x2), run from the repository root with
# the image's python3 (the checkout on PYTHONPATH): `twinflash compare --no-bench` of the Llama-3.2-1B shape, i.e. the
# bf16 noise floor with its defaults (8k, 50 steps of text, fsdp=1 x sp=2, the default optimizer: torch triton /
# sdpa_cudnn, JAX pallas / cudnn; jobs of the 2-GPU launches, after each backend's equivalence job) and the float32
# equivalence checks (S=1k, 16 layers, 2 GPUs). Expected a few minutes (3 launches; each training compiles its step
# once and takes ~10-20 s of steps); the whole
# command under TIMEOUT_S (default 590, one 10-minute device call), the compare stops launching at TIME_LIMIT_S
# (default 540; float32 jobs it did not reach are reported as not run).
#   bash compare/bench/gpu_noise_floor.sh [EXTRA COMPARE ARGS...]
#   CPU rehearsal: MODEL=tiny bash compare/bench/gpu_noise_floor.sh --dtype bf16   (~5 min on 2 cores)
# Everything lands in $OUT (default ./out): report/ (report.md, .html, .json, plots/, work/logs), compare.log and
# summary.json (the command, GPUs, commit, the bf16 pairs and verdict), printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
command=(python3 -m compare.cli compare --model "${MODEL:-llama3.2-1b}" --no-bench --check-seq-len 1024
         --time-limit-s "${TIME_LIMIT_S:-540}" --out "$OUT/report" "$@")
began=$(date +%s)
timeout "${TIMEOUT_S:-590}" "${command[@]}" > "$OUT/compare.log" 2>&1
status=$?
echo "exit $status after $(( $(date +%s) - began )) s" >> "$OUT/compare.log"
tail -n 25 "$OUT/compare.log"

gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | paste -sd ';')
commit=$(git describe --always --abbrev=40 --dirty=' + uncommitted changes' 2>/dev/null || echo "unknown: fill in the commit sent")
python3 - "$OUT" "${command[*]}" "$gpus" "$commit" "$status" <<'PY'
import json, pathlib, sys
out, command, gpu, commit, status = pathlib.Path(sys.argv[1]), *sys.argv[2:]
report_path = out / "report" / "report.json"
report = json.loads(report_path.read_text()) if report_path.exists() else {}
bf16 = report.get("equivalence", {}).get("bf16")
summary = {"command": command.replace(str(out), "$OUT"), "gpu": gpu, "commit": commit, "exit": int(status),
           "fp32_passed": report.get("passed"), "bf16": bf16 and {k: bf16[k] for k in (
               "seq_len", "devices", "steps", "optimizer", "ratio", "ratio_limit", "consistent", "floor_pair",
               "verdict")}}
if bf16:
    summary["bf16"]["pairs"] = {p["name"]: {k: p[k] for k in ("max", "mean", "final")} for p in bf16["pairs"]}
    summary["bf16"]["runs"] = {r["name"]: {"status": r["status"], "seconds": round(r["seconds"], 1),
                                           "first": r["losses"][0] if r["losses"] else None,
                                           "final": r["losses"][-1] if r["losses"] else None,
                                           "max_after_first": max(r["losses"][1:], default=None)}
                               for r in bf16["runs"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"exit {status}; fp32 equivalence passed: {summary['fp32_passed']}; GPUs: {gpu}; commit {commit}")
if not bf16:
    print("no bf16 section (see compare.log)")
    sys.exit(0)
print(f"{'run':<18}{'status':>8}{'seconds':>9}{'first':>9}{'max>0':>9}{'final':>9}")
for name, r in summary["bf16"]["runs"].items():
    cells = [f"{r[k]:>9.4f}" if r[k] is not None else f"{'-':>9}" for k in ("first", "max_after_first", "final")]
    print(f"{name:<18}{r['status']:>8}{r['seconds']:>9.0f}" + "".join(cells))
print(f"{'pair':<60}{'max %':>8}{'mean %':>8}{'final %':>8}")
for name, p in summary["bf16"]["pairs"].items():
    print(f"{name:<60}" + "".join(f"{100 * p[k]:>8.3f}" for k in ("max", "mean", "final")))
print(bf16["verdict"])
PY
