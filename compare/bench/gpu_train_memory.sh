#!/usr/bin/env bash
# Issue 19's GPU acceptance on a 2x H200 host (the device tool's nvidia-h200-x2), run from the repository root with
# the image's python3 (the checkout on PYTHONPATH). Llama-3.1-8B shape, random weights, bf16, fsdp=1,sp=2, batch 1,
# save-attention checkpointing; every run under RUN_TIMEOUT_S (default 300), each stage fits one 10-minute call.
#   bash compare/bench/gpu_train_memory.sh parity [SEQ_LEN] [BACKENDS]   3 steps at SEQ_LEN (default 32768) per backend
#                                                              (default torch,jax): peak memory per GPU, tokens/s
#   bash compare/bench/gpu_train_memory.sh longest BACKEND LENS      one step at each of LENS (ascending, comma-separated)
#                                                              until the first that fails: the longest that trains
#   bash compare/bench/gpu_train_memory.sh plan LENS                 JAX only: XLA's GPU memory plan of the step at each
#                                                              length (compiles, nothing loaded): where to start
# Everything lands in $OUT (default ./out): runs.tar.gz (every train.jsonl and log) and summary.json, printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
runs="$OUT/runs"
mkdir -p "$runs"
stage=${1:?stage: parity | longest | plan}
common=(--model llama3.1-8b --mesh fsdp=1,sp=2 --batch 1 --dtype bf16 --data random
        --activation-checkpointing save-attention)

train() {  # train BACKEND SEQ_LEN STEPS: one run; exit status of the command
    local run="train-$1-$2"
    timeout "${RUN_TIMEOUT_S:-300}" python3 -m compare.cli train --backend "$1" --seq-len "$2" --steps "$3" \
        "${common[@]}" --out "$runs/$run" > "$runs/$run.log" 2>&1
    local status=$?
    echo "exit $status" >> "$runs/$run.log"
    return $status
}

case "$stage" in
parity)
    len=${2:-32768}; backends=${3:-torch,jax}
    for backend in ${backends//,/ }; do train "$backend" "$len" 3; done
    ;;
longest)
    backend=${2:?backend: torch | jax}; lens=${3:?seq lens, e.g. 32768,49152,65536}
    for len in ${lens//,/ }; do train "$backend" "$len" 1 || break; done
    ;;
plan)
    lens=${2:?seq lens}
    for len in ${lens//,/ }; do
        timeout "${RUN_TIMEOUT_S:-300}" python3 -m compare.cli train --backend jax --seq-len "$len" --steps 1 \
            "${common[@]}" --plan-memory 2>&1 | tee "$runs/plan-jax-$len.log" | tail -n 1
    done
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac

gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | paste -sd ';')
commit=$(git rev-parse HEAD 2>/dev/null || echo "unknown: fill in the commit sent")
python3 - "$runs" "$OUT/summary.json" "$*" "$gpus" "$commit" <<'PY'
import json, pathlib, sys
runs, out, args, gpu, commit = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), *sys.argv[3:]
rows = []
for log in sorted(runs.glob("train-*.log")):
    records = [json.loads(line) for line in (runs / log.stem / "train.jsonl").read_text().splitlines()] \
        if (runs / log.stem / "train.jsonl").exists() else []
    backend, seq_len = log.stem.split("-")[1], int(log.stem.split("-")[2])
    steady = records[1:] or records  # the first step includes compilation
    rows.append({"backend": backend, "seq_len": seq_len, "exit": log.read_text().split()[-1],
                 "steps": len(records),
                 "tokens_per_s": sorted(r["tokens_per_s"] for r in steady)[len(steady) // 2] if steady else None,
                 "peak_memory_gib": max(max(r["peak_memory_bytes"]) for r in records) / 2**30 if records else None,
                 "last_log_line": ([""] + log.read_text().strip().splitlines())[-2][-300:]})
plans = {log.stem: log.read_text().strip().splitlines()[-1] for log in sorted(runs.glob("plan-*.log"))}
summary = {"command": f"bash compare/bench/gpu_train_memory.sh {args}", "commit": commit, "gpus": gpu,
           "config": "llama3.1-8b shape, random weights, bf16, fsdp=1,sp=2, batch 1, save-attention",
           "runs": rows, "plans": plans}
out.write_text(json.dumps(summary, indent=1))
print(f"{'backend':8} {'seq_len':>8} {'exit':>5} {'steps':>5} {'tokens/s':>10} {'peak GiB':>9}")
for r in rows:
    print(f"{r['backend']:8} {r['seq_len']:>8} {r['exit']:>5} {r['steps']:>5} "
          f"{r['tokens_per_s'] or 0:>10,.0f} {r['peak_memory_gib'] or 0:>9.2f}")
for name, line in plans.items():
    print(name, line[-160:])
PY
tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$runs"
