#!/usr/bin/env bash
# Issue 21's GPU acceptance on a 2x H200 host (the device tool's nvidia-h200-x2), run from the repository root with
# the image's python3 (the checkout on PYTHONPATH): two "nodes" on one host, one GPU each (CUDA_VISIBLE_DEVICES),
# the coordinator on localhost, NCCL between them.
#   train:   two `twinflash train` commands with --nnodes 2, beside each the one-node run of the same mesh on both
#            GPUs. Llama-3.2-1B shape, random weights and tokens, bf16, 32k tokens, fsdp=1,sp=2 (the ring spans
#            the two nodes), 4 steps; torch with --eager (no torch.compile: its compile time would not fit the
#            budget; the step's numerics are the same), JAX as it is. Expected about 200 s.
#   compare: two `twinflash compare` commands with --nnodes 2: the 1B shape at 8k, device counts 1 (node 0) and 2
#            (both nodes: the equivalence check and the 2-GPU points), both backends, ours only, forward mode, one
#            timed step, the equivalence on 2 layers. Four launches (torch 1 and 2, JAX 2 and 1) of ~15 s start-up
#            and ~20 s compilation each: expected about 150 s, bounded by COMPARE_S (default 170 s: --time-limit-s
#            30 s below it, so the report of what finished is written).
#   bash compare/bench/gpu_two_nodes.sh [BACKENDS] [STAGES]     (defaults torch,jax and train,compare)
# Every train run is under `timeout` (RUN_TIMEOUT_S, default 100 s, cut to what is left of TOTAL_S, default 235 s; a
# run that would start with less than 30 s left is recorded as not run). Expected wall time about 350 s in all.
# Everything lands in $OUT (default ./out): runs.tar.gz (every train.jsonl and log, the compare's work directory),
# compare-report.{md,json} and summary.json (the command, GPUs, commit; per backend: per-step losses of both train
# runs, their largest relative difference, median tokens/s of the steps after the first; the compare's exit codes,
# one line per node, its points and equivalence verdict), with a short table printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
runs="$OUT/runs"
mkdir -p "$runs"
backends=${1:-torch,jax}
stages=${2:-train,compare}
total_s=${TOTAL_S:-235}
began=$SECONDS
# SHAPE: a CPU rehearsal runs e.g. SHAPE="--model tiny --seq-len 64 --dtype fp32 --attention-backend reference"
# and COMPARE_SHAPE="--model tiny --seq-lens 64 --devices 2"
common=(${SHAPE:---model llama3.2-1b --seq-len 32768 --dtype bf16} --steps 4 --mesh fsdp=1,sp=2 --batch 1
        --data random --rendezvous-timeout-s 60)

budget() {  # seconds the next run may take, or nothing when too little is left
    local left=$(( total_s - (SECONDS - began) ))
    local limit=${RUN_TIMEOUT_S:-100}
    (( left < 30 )) && return 1
    echo $(( left < limit ? left : limit ))
}

extra() { [ "$1" = torch ] && echo --eager; }

one_node() {  # one_node BACKEND
    local run="$1-one" limit
    limit=$(budget) || { echo "not run: time budget spent" > "$runs/$run.log"; return; }
    timeout "$limit" python3 -m compare.cli train --backend "$1" "${common[@]}" $(extra "$1") \
        --out "$runs/$run" > "$runs/$run.log" 2>&1
    echo "exit $?" >> "$runs/$run.log"
}

two_nodes() {  # two_nodes BACKEND: node 0 on GPU 0, node 1 on GPU 1, both writing into one --out
    local run="$1-two" limit port=$(( 29500 + RANDOM % 1000 )) rank
    limit=$(budget) || { echo "not run: time budget spent" > "$runs/$run.log"; return; }
    for rank in 0 1; do
        CUDA_VISIBLE_DEVICES=$rank timeout "$limit" python3 -m compare.cli train --backend "$1" "${common[@]}" \
            $(extra "$1") --nnodes 2 --node-rank $rank --coordinator "localhost:$port" --out "$runs/$run" \
            > "$runs/$run-node$rank.log" 2>&1 &
    done
    local status=0 pid
    for pid in $(jobs -p); do wait "$pid" || status=$?; done
    cat "$runs/$run-node0.log" "$runs/$run-node1.log" > "$runs/$run.log"
    echo "exit $status" >> "$runs/$run.log"
}

two_node_compare() {  # node 0 on GPU 0, node 1 on GPU 1, one --out; each node's exit code and log kept
    local port=$(( 29500 + RANDOM % 1000 )) rank limit=${COMPARE_S:-170}
    for rank in 0 1; do
        CUDA_VISIBLE_DEVICES=$rank timeout "$limit" python3 -m compare.cli compare \
            ${COMPARE_SHAPE:---model llama3.2-1b --seq-lens 8k} --device-counts 1,2 --backends "$backends" --ablation ours --mode forward --steps 1 \
            --check-layers 2 --time-limit-s $(( limit - 30 )) --rendezvous-timeout-s 60 --nnodes 2 \
            --node-rank $rank --coordinator "localhost:$port" --out "$runs/compare" \
            > "$runs/compare-node$rank.log" 2>&1 &
    done
    local pid
    for pid in $(jobs -p); do wait "$pid"; echo "exit $?" >> "$runs/compare-exits"; done
    cp "$runs/compare/report.md" "$OUT/compare-report.md" 2>/dev/null
    cp "$runs/compare/report.json" "$OUT/compare-report.json" 2>/dev/null
}

if [[ ",$stages," == *,train,* ]]; then
    for backend in ${backends//,/ }; do
        one_node "$backend"
        two_nodes "$backend"
    done
fi
[[ ",$stages," == *,compare,* ]] && two_node_compare

gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | paste -sd ';')
commit=$(git describe --always --abbrev=40 --dirty=' + uncommitted changes' 2>/dev/null || echo "unknown: fill in the commit sent")
python3 - "$runs" "$OUT/summary.json" "$backends" "$gpus" "$commit" "$(( SECONDS - began ))" "$stages" <<'PY'
import json, pathlib, sys
runs, out, backends, gpu, commit, wall, stages = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), *sys.argv[3:]


def portable(line):
    """A log line as results keep it: the output folder named $OUT, not by its path on the machine."""
    return line.replace(str(out.parent), "$OUT")[-300:]


def read(run):
    log = runs / f"{run}.log"
    jsonl = runs / run / "train.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    steady = sorted(r["tokens_per_s"] for r in records[1:])  # the first step includes compilation
    text = log.read_text().strip() if log.exists() else "not run"
    return {"exit": text.split()[-1], "losses": [r["loss"] for r in records],
            "tokens_per_s": steady[len(steady) // 2] if steady else None,
            "mfu": sorted(r["mfu"] or 0 for r in records[1:])[len(records[1:]) // 2] if records[1:] else None,
            "peak_memory_gib": max(max(r["peak_memory_bytes"]) for r in records) / 2**30 if records else None,
            "twinflash_lines": [portable(line) for line in text.splitlines() if line.startswith("twinflash:")]}


def compare():
    """The two-node compare: each node's exit code and one line, the report's points and verdict."""
    exits = runs / "compare-exits"
    report = runs / "compare" / "report.json"
    data = json.loads(report.read_text()) if report.exists() else None
    nodes = []
    for rank in (0, 1):
        log = runs / f"compare-node{rank}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        nodes.append([portable(line) for line in text.splitlines() if line.startswith("twinflash:")])
    return {"exits": exits.read_text().split()[1::2] if exits.exists() else None, "node_lines": nodes,
            "equivalence_passed": data["equivalence"]["passed"] if data else None,
            "points": [{k: p[k] for k in ("backend", "devices", "seq_len", "status", "step_s", "tokens_per_s")}
                       for p in data["benchmark"]["points"]] if data else None,
            "jobs": data["jobs"] if data else None}


rows = []
for backend in backends.split(",") if "train" in stages.split(",") else []:
    one, two = read(f"{backend}-one"), read(f"{backend}-two")
    both = len(one["losses"]) == len(two["losses"]) > 0
    diff = max(abs(a - b) / abs(a) for a, b in zip(one["losses"], two["losses"])) if both else None
    rows.append({"backend": backend, "one_node": one, "two_nodes": two, "max_rel_loss_diff": diff})
compared = compare() if "compare" in stages.split(",") else None
summary = {"command": f"bash compare/bench/gpu_two_nodes.sh {backends} {stages}", "commit": commit, "gpus": gpu,
           "wall_s": int(wall),
           "config": "train: llama3.2-1b shape, random weights and tokens, bf16, seq 32768, batch 1, fsdp=1,sp=2, "
                     "4 steps; two nodes = two commands on one host, one GPU each (CUDA_VISIBLE_DEVICES), NCCL "
                     "between them; torch --eager. compare: llama3.2-1b shape at 8k, device counts 1,2, ours, "
                     "forward, 1 step, equivalence on 2 layers, over the same two nodes", "runs": rows,
           "compare": compared}
out.write_text(json.dumps(summary, indent=1))
print(f"{'backend':8} {'run':9} {'exit':>5} {'steps':>5} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}  max rel loss diff")
for row in rows:
    for name in ("one_node", "two_nodes"):
        r = row[name]
        diff = "" if name == "one_node" or row["max_rel_loss_diff"] is None else f"{row['max_rel_loss_diff']:.2e}"
        print(f"{row['backend']:8} {name:9} {r['exit']:>5} {len(r['losses']):>5} {r['tokens_per_s'] or 0:>10,.0f} "
              f"{r['mfu'] or 0:>6.1%} {r['peak_memory_gib'] or 0:>9.2f}  {diff}")
if compared is not None:
    print(f"compare across 2 nodes: exits {compared['exits']}, equivalence passed: {compared['equivalence_passed']}")
    for p in compared["points"] or []:
        print(f"  {p['backend']:6} S={p['seq_len']:>6} dev={p['devices']} {p['status']:>8} "
              f"step {p['step_s'] or 0:.3f} s  {p['tokens_per_s'] or 0:>10,.0f} tok/s")
    for rank, lines in enumerate(compared["node_lines"]):
        print(f"  node {rank}: {' | '.join(lines) or '-'}")
print(f"wall {wall} s")
PY
tar -czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$runs"
