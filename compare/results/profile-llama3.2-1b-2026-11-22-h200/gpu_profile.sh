#!/bin/bash
# One GPU: --profile of the Llama-3.2-1B shape, bf16, random tokens, fsdp=1 x sp=1, 6 steps (3 profiled).
# Usage (from a tree's root): bash gpu_profile.sh TAG POINT... ; POINT = backend:attention:seq_len[:eager]
# TAG base: no --profile (a tree without it)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" XLA_PYTHON_CLIENT_PREALLOCATE=false
tag=$1; shift; scratch=${SCRATCH:-$(mktemp -d)}
for point in "$@"; do
  IFS=: read backend attention seq mode <<< "$point"
  out=$scratch/$tag-$backend-$attention-$seq${mode:+-$mode}
  extra=""; [ "$tag" != base ] && extra="--profile"; [ "$mode" = eager ] && extra="$extra --eager"
  began=$(date +%s)
  timeout ${POINT_TIMEOUT:-90} python3 -m compare.cli train --backend $backend --attention-backend $attention \
    --model llama3.2-1b --seq-len $seq --steps 6 --mesh fsdp=1,sp=1 --dtype bf16 --data random --out $out $extra \
    > $out.log 2>&1
  echo "== $tag $point rc=$? $(( $(date +%s) - began )) s"; grep -v "━" $out.log | tail -${TAIL:-24}
done
python3 - "$tag" "$scratch" <<'PY'
import glob, json, os, sys, subprocess
tag, scratch = sys.argv[1], sys.argv[2]
runs = {}
for d in sorted(glob.glob(f"{scratch}/{tag}-*")):
    if not os.path.isdir(d):
        continue
    run = {"train": [json.loads(l) for l in open(f"{d}/train.jsonl")] if os.path.exists(f"{d}/train.jsonl") else []}
    if os.path.exists(f"{d}/profile.json"):
        run["profile"] = json.load(open(f"{d}/profile.json"))
    runs[os.path.basename(d)] = run
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
json.dump({"tag": tag, "gpu": gpu, "runs": runs}, open(os.path.join(os.environ["OUT"], f"profiles-{tag}.json"), "w"), indent=1)
PY
