#!/usr/bin/env bash
# Issue 14's GPU acceptance: the bare `twinflash compare --model MODEL` (default llama3.2-1b) on the GPUs of this host
# (the device tool's nvidia-h200-x2), run from the repository root with the image's python3 (the checkout on
# PYTHONPATH). The command runs under `timeout ${COMPARE_TIMEOUT_S:-570}` (SIGTERM: it stops its workers and writes
# the report of the jobs that finished, the rest marked interrupted; killed 10 s later if still running), so the
# whole call takes at most ~10 minutes.
#   bash compare/bench/gpu_compare.sh [MODEL] [extra compare arguments...]
# Lands in $OUT (default ./out): compare-MODEL.tar.gz (report.md, report.html, report.json, plots/, work/ with every
# job's result and the launches' logs; profiler traces over 3 MB dropped: a file comes back only under 16 MiB), report.md and report.json beside it,
# compare.log, env.txt (five files: the device tool brings back at most 8, none deeper than two folders); the summary
# table last.
# Expected for the 1B shape on 2 H200s: 43 jobs (3 equivalence checks, 12 fast-path jobs: the attention with ours
# and cuDNN on 1 and 2 GPUs and the bf16 step with each, per backend; 24 points of which 6 are skipped up front for
# memory, 4 noise-floor trainings). Measured 2026-11-23 (compare/results/compare-llama3.2-1b-2026-11-23-h200x2-cut/):
# cut at 578 s with the JAX 128k points and JAX's 8k reference left (~130 s); since then the checks run at once
# before the points, a step over 2 s is timed once, and the equivalence comparison streams float64 chunks. The
# report's "Setup and measurement per job" shows where the time went; work/*-equivalence.json the equivalence checks'
# phases (phases_s) and the JAX jobs' compilations (xla_compiles).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
model=${1:-llama3.2-1b}
shift || true
run="$OUT/compare-$model"
mkdir -p "$OUT"
{ nvidia-smi; python3 -c "import sys, torch, triton, jax; print(sys.version); print('torch', torch.__version__,
'triton', triton.__version__, 'jax', jax.__version__, 'gpus', torch.cuda.device_count())"
  echo "commit $(git describe --always --abbrev=40 --dirty=' + uncommitted changes' 2>/dev/null || echo 'unknown: the device copy has no git')"; } > "$OUT/env.txt" 2>&1
began=$(date +%s)
timeout -k 10 "${COMPARE_TIMEOUT_S:-570}" python3 -m compare.cli compare --model "$model" "$@" --out "$run" \
    > "$OUT/compare.log" 2>&1
status=$?
echo "exit $status after $(( $(date +%s) - began )) s: twinflash compare --model $model $*" | tee -a "$OUT/compare.log"
# the command removes the run's weights (5 GB for the 1B shape) and caches itself; again in case it was killed
work="$run/work"
rm -rf "$work"/weights "$work"/cache "$work"/check-model "$work"/*.safetensors
find "$run/traces" -type f -size +3M -delete 2>/dev/null
find "$run/traces" -type d -empty -delete 2>/dev/null
cp "$run/report.md" "$run/report.json" "$OUT/" 2>/dev/null
tar czf "$OUT/compare-$model.tar.gz" -C "$OUT" "compare-$model" && rm -rf "$run"
tail -n 60 "$OUT/compare.log"
