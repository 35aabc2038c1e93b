#!/usr/bin/env bash
# Training memory and speed on a 2x H200 host (the device tool's nvidia-h200-x2), both backends, random weights,
# random tokens, bf16, fsdp=1,sp=2, batch 1; run from the repository root with the image's python3 (the checkout on
# PYTHONPATH). Issue 19's acceptance (Llama-3.1-8B, save-attention checkpointing) and the Llama-3.2-1B step that
# issues 12, 13 and 20 re-measure (checkpointing off, the default ring kernels and cuDNN's).
#   bash compare/bench/gpu_train_memory.sh all           everything below, most important first, within BUDGET_S
#                                                          (default 540 s; expected ~600 s, so the last runs may be
#                                                          skipped: then run `kernels-1b` in a second call):
#                                                          8B parity at 32k (torch ~90 s, JAX ~90 s), 8B one step at
#                                                          131072 (JAX ~120 s, torch ~120 s), kernels-1b (~45 s
#                                                          each), the JAX GPU plan at 32k (~40 s)
#   bash compare/bench/gpu_train_memory.sh parity [SEQ_LEN] [BACKENDS]   8B, 3 steps at SEQ_LEN (default 32768) per
#                                                          backend (default torch,jax): peak memory per GPU, tokens/s
#   bash compare/bench/gpu_train_memory.sh longest BACKEND LENS   8B, one step at each of LENS (ascending,
#                                                          comma-separated) until the first that fails
#   bash compare/bench/gpu_train_memory.sh kernels-1b    1B at 32k, 5 steps, checkpointing off: JAX default kernels,
#                                                          JAX cudnn, torch default kernels, torch sdpa_cudnn (~200 s)
#   bash compare/bench/gpu_train_memory.sh plan LENS     JAX only: XLA's GPU memory plan of the 8B step at each length
#                                                          (compiles, nothing loaded; ~40 s each)
# Every run is under its own `timeout` (8B multi-step 150 s, 8B one step 200 s, 1B 100 s, plan 300 s; never past
# the budget), and a run with under 60 s of budget left is skipped, recorded as such. Everything lands in $OUT
# (default ./out): runs.tar.gz (every train.jsonl and log) and summary.json; the table is printed last. BIG_MODEL,
# SMALL_MODEL, PARITY_LEN, LONG_LEN and SMALL_LEN replace the models and lengths of `all` (a CPU dry run:
# BIG_MODEL=tiny SMALL_MODEL=tiny PARITY_LEN=64 LONG_LEN=128 SMALL_LEN=64).
set -u
# JAX as `twinflash train` runs it by default: XLA's allocator takes its share of each GPU up front
# (compare.launch.JAX_GPU_MEMORY_FRACTION). Growing it on demand instead (XLA_PYTHON_CLIENT_PREALLOCATE=false, this
# script's setting until 2026-11-23) fragments it: the 8B step at 96k tokens could not place its 46.75 GiB of
# temporaries with under half of the allocator's memory in use.
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
runs="$OUT/runs"
mkdir -p "$runs"
stage=${1:?stage: all | parity | longest | kernels-1b | plan}
budget=${BUDGET_S:-540}
reserve=20  # seconds kept for the summary and the archive
big=${BIG_MODEL:-llama3.1-8b}
small=${SMALL_MODEL:-llama3.2-1b}
small_len=${SMALL_LEN:-32768}

limit_for() {  # limit_for LOG TIMEOUT_S: the seconds a run may take, or records LOG as skipped and fails
    limit=$(( budget - reserve - SECONDS ))
    (( limit > $2 )) && limit=$2
    if (( limit < 60 )); then
        printf 'skipped: %s s of the budget left\nexit skipped\n' "$limit" > "$1"
        return 3
    fi
}

train() {  # train BACKEND MODEL SEQ_LEN STEPS CHECKPOINTING ATTENTION TIMEOUT_S: one run; its exit status
    local backend=$1 model=$2 len=$3 steps=$4 remat=$5 attention=$6
    local run="train_${backend}_${model}_${remat}_${attention}_${len}"
    echo "$run" >> "$runs/order"
    limit_for "$runs/$run.log" "$7" || return 3
    local kernels=()
    [[ $attention != default ]] && kernels=(--attention-backend "$attention")
    echo "[${SECONDS} s] $run (timeout ${limit} s)"
    timeout "$limit" python3 -m compare.cli train --backend "$backend" --model "$model" --seq-len "$len" \
        --steps "$steps" --mesh fsdp=1,sp=2 --batch 1 --dtype bf16 --data random --activation-checkpointing "$remat" \
        "${kernels[@]}" --out "$runs/$run" > "$runs/$run.log" 2>&1
    local status=$?
    echo "exit $status" >> "$runs/$run.log"
    return $status
}

parity() {  # parity SEQ_LEN BACKENDS
    for backend in ${2//,/ }; do train "$backend" "$big" "$1" 3 save-attention default 150; done
}

longest() {  # longest BACKEND LENS
    for len in ${2//,/ }; do train "$1" "$big" "$len" 1 save-attention default 200 || break; done
}

plan() {  # plan LENS
    for len in ${1//,/ }; do
        limit_for "$runs/plan-jax-$len.log" 300 || return 3
        timeout "$limit" python3 -m compare.cli train --backend jax --model "$big" --seq-len "$len" --steps 1 \
            --mesh fsdp=1,sp=2 --batch 1 --dtype bf16 --data random --activation-checkpointing save-attention \
            --plan-memory 2>&1 | tee "$runs/plan-jax-$len.log" | tail -n 1
    done
}

kernels_1b() {
    train jax "$small" "$small_len" 5 off default 100
    train jax "$small" "$small_len" 5 off cudnn 100
    train torch "$small" "$small_len" 5 off default 100
    train torch "$small" "$small_len" 5 off sdpa_cudnn 100
}

case "$stage" in
all)
    parity "${PARITY_LEN:-32768}" torch,jax
    longest jax "${LONG_LEN:-131072}"
    longest torch "${LONG_LEN:-131072}"
    kernels_1b
    plan "${PARITY_LEN:-32768}"
    ;;
parity) parity "${2:-32768}" "${3:-torch,jax}" ;;
longest) longest "${2:?backend: torch | jax}" "${3:?seq lens, e.g. 98304,131072}" ;;
kernels-1b) kernels_1b ;;
plan) plan "${2:?seq lens}" ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac

gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | paste -sd ';')
commit=$(git describe --always --abbrev=40 --dirty=' + uncommitted changes' 2>/dev/null || echo "unknown: fill in the commit sent")
python3 - "$runs" "$OUT/summary.json" "$*" "$gpus" "$commit" "$SECONDS" <<'PY'
import json, pathlib, sys
runs, out, args, gpu, commit, seconds = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), *sys.argv[3:]
rows = []
order = (runs / "order").read_text().split() if (runs / "order").exists() else []
for log in [runs / f"{name}.log" for name in order]:
    jsonl = runs / log.stem / "train.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    _, backend, model, remat, *attention, seq_len = log.stem.split("_")  # attention names may hold "_"
    attention = "_".join(attention)
    steady = records[1:] or records  # the first step includes compilation
    lines = log.read_text().strip().splitlines()
    rows.append({"backend": backend, "model": model, "checkpointing": remat, "attention": attention,
                 "seq_len": int(seq_len), "exit": lines[-1].split()[-1], "steps": len(records),
                 "step_s": sorted(r["seconds"] for r in steady)[len(steady) // 2] if steady else None,
                 "tokens_per_s": sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2] if steady else None,
                 "peak_memory_gib": max(max(r["peak_memory_bytes"]) for r in records) / 2**30 if records else None,
                 "last_log_line": ([""] + lines)[-2][-300:]})
plans = {log.stem: log.read_text().strip().splitlines()[-1] for log in sorted(runs.glob("plan-*.log"))}
summary = {"command": f"bash compare/bench/gpu_train_memory.sh {args}", "commit": commit, "gpus": gpu,
           "seconds": int(seconds), "config": "random weights and tokens, bf16, fsdp=1,sp=2, batch 1",
           "runs": rows, "plans": plans}
out.write_text(json.dumps(summary, indent=1))
print(f"{'backend':7} {'model':12} {'ckpt':14} {'attention':10} {'seq_len':>7} {'exit':>7} {'steps':>5} "
      f"{'step s':>7} {'tokens/s':>9} {'peak GiB':>8}")
for r in rows:
    print(f"{r['backend']:7} {r['model']:12} {r['checkpointing']:14} {r['attention']:10} {r['seq_len']:>7} "
          f"{r['exit']:>7} {r['steps']:>5} {r['step_s'] or 0:>7.2f} {r['tokens_per_s'] or 0:>9,.0f} "
          f"{r['peak_memory_gib'] or 0:>8.2f}")
peaks = {r["backend"]: r["peak_memory_gib"] for r in rows if r["checkpointing"] == "save-attention"
         and r["steps"] == 3}
if peaks.get("jax") and peaks.get("torch"):
    print(f"parity peak JAX / torch: {peaks['jax'] / peaks['torch']:.3f} (target <= 1.10)")
for name, line in plans.items():
    print(name, line[-160:])
print(f"total {seconds} s")
PY
tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$runs"
