#!/usr/bin/env bash
# Issue 20's measurement: `twinflash train --profile` per point on the GPUs of this host (the device tool's
# nvidia-h200-x2), run from the repository root with the image's python3 (the checkout on PYTHONPATH); the
# training step's time by category (attention, gemm, communication, elementwise, loss, optimizer, recompute, idle)
# beside its tokens/s and MFU.
#   bash compare/bench/gpu_step_profile.sh POINT...
# POINT = backend:model:attention:seq_len[:checkpointing[:extras]] (e.g. torch:llama3.1-8b:sdpa_cudnn:32768:save-attention,
# jax:llama3.2-1b:cudnn:32768, torch:llama3.2-1b:sdpa_cudnn:32768:off:eager+fp8); extras, joined by '+': eager
# (`--eager`), fp8 (`--fp8`; torch needs torchao importable), ulysses (`--sp-scheme ulysses`: all-to-all of the
# heads over sp instead of the ring), hybrid (`--sp-scheme hybrid --ulysses-degree 2`: all-to-alls in pairs of
# adjacent GPUs, a ring of the pairs; needs SP of 4 or more), text (`--data text`: the text corpus instead of random
# tokens), pack (`--data text --pack`: its files packed as documents), layersN (`--checkpointed-layers N`: N of the
# layers checkpointed as the point's checkpointing says, the others keep their activations). Every point: bf16,
# random tokens unless text
# or pack, fsdp=1 x sp=$SP (2), $STEPS steps (7: step 0 compiles, the last 3 are traced), under `timeout $POINT_S`
# (150); a point that could not finish within $BUDGET_S (540) of the script's start is not started (named in the log).
# Lands in $OUT (default ./out): one log per point, profiles.json (every point's train.jsonl rows and profile.json,
# the GPU and the command); a table last, tokens/s and MFU as the median of the untraced steps after step 0.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
SP=${SP:-2} STEPS=${STEPS:-7} POINT_S=${POINT_S:-150} BUDGET_S=${BUDGET_S:-540}
started=$(date +%s)
scratch=$(mktemp -d)
mkdir -p "$OUT"
for point in "$@"; do  # every point's extras checked before the first point runs
    IFS=: read -r _ _ _ _ _ extra <<< "$point"
    for option in ${extra//+/ }; do
        [[ $option =~ ^(eager|fp8|ulysses|hybrid|text|pack|layers[0-9]+)$ ]] ||
            { echo "unknown extra '$option' in point $point (eager, fp8, ulysses, hybrid, text, pack, layersN)" >&2
              exit 2; }
    done
done
for point in "$@"; do
    IFS=: read -r backend model attention seq remat extra <<< "$point"
    # '-' for the extras' '+': the device tool brings back no file whose name has a '+'
    name="$backend-$model-$attention-$seq${remat:+-$remat}${extra:+-${extra//+/-}}"
    if (( $(date +%s) - started + POINT_S > BUDGET_S )); then
        echo "== $name: not started, it might not finish within BUDGET_S=$BUDGET_S"
        continue
    fi
    flags=(--backend "$backend" --model "$model" --attention-backend "$attention" --seq-len "$seq" --steps "$STEPS"
           --mesh "fsdp=1,sp=$SP" --dtype bf16 --profile --out "$scratch/$name")
    [ -n "$remat" ] && flags+=(--activation-checkpointing "$remat")
    data=(--data random)
    for option in ${extra//+/ }; do
        case $option in
            ulysses) flags+=(--sp-scheme ulysses) ;;
            hybrid) flags+=(--sp-scheme hybrid --ulysses-degree 2) ;;
            text) data=(--data text) ;;
            pack) data=(--data text --pack) ;;
            layers*) flags+=(--checkpointed-layers "${option#layers}") ;;
            *) flags+=("--$option") ;;
        esac
    done
    flags+=("${data[@]}")
    began=$(date +%s)
    timeout "$POINT_S" python3 -m compare.cli train "${flags[@]}" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $(( $(date +%s) - began )) s"
done
python3 - "$scratch" "$OUT/profiles.json" "$*" <<'PY'
import glob, json, os, statistics, subprocess, sys

scratch, target, points = sys.argv[1:4]
runs = {}
for directory in sorted(glob.glob(f"{scratch}/*/")):
    name = os.path.basename(directory.rstrip("/"))
    rows = f"{directory}/train.jsonl"
    run = {"train": [json.loads(line) for line in open(rows)] if os.path.exists(rows) else []}
    if os.path.exists(f"{directory}/profile.json"):
        run["profile"] = json.load(open(f"{directory}/profile.json"))
    runs[name] = run
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except FileNotFoundError:
    gpu = "none (no nvidia-smi)"
record = json.dumps({"command": f"bash compare/bench/gpu_step_profile.sh {points}", "gpu": gpu, "runs": runs},
                    indent=1)
open(target, "w").write(record.replace(scratch, "$SCRATCH"))  # no machine paths in results
print(f"{'point':58} {'step ms':>8} {'tok/s':>8} {'MFU %':>6}  traced step: categories (ms)")
for name, run in runs.items():
    profile = run.get("profile", {})
    untraced = run["train"][1:len(run["train"]) - profile.get("steps", 0)] or run["train"][-1:]
    def median(key):
        values = [row[key] for row in untraced if row.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    categories = " ".join(f"{k}={v * 1e3:.0f}" for k, v in profile.get("categories", {}).items())
    print(f"{name:58} {median('seconds') * 1e3:8.1f} {median('tokens_per_s'):8.0f} {median('mfu') * 100:6.1f}  "
          f"{profile.get('step_s', float('nan')) * 1e3:.0f}: {categories}")
PY
rm -rf "$scratch"
