#!/usr/bin/env bash
# GPU checks and benchmarks in stages that each fit one 10-minute call on a 4x H200 host (the device tool's
# nvidia-h200-x4; the kernel stages need one GPU), run from the repository root with the image's python3 (no install: the checkout is on PYTHONPATH).
#   bash compare/bench/gpu_suite.sh kernel-tests               GPU kernel tests, both backends, and a quick `bench kernels`
#   bash compare/bench/gpu_suite.sh kernel-bench PART [LENS] [JSON...]   one part (torch | jax) of `bench kernels`,
#                                                                   merged with earlier parts' JSON
#   bash compare/bench/gpu_suite.sh ring      4-GPU ring tests (torch NCCL, JAX), then `bench ring` at Hkv=8
#   bash compare/bench/gpu_suite.sh ring-bench [SEQ_LENS] [KV_HEADS] [PARTS] [JSON...]   `bench ring` (default parts
#                                     torch,peer,jax), merged with earlier runs' JSON (re-measured rows replace theirs)
#   bash compare/bench/gpu_suite.sh compare MODEL [ARGS...]   `twinflash compare` on 4 GPUs at 32k and 128k (1 and 4 GPUs,
#                                                     ablation), stopped launching at 540 s so the report is written
#   bash compare/bench/gpu_suite.sh train MODEL SEQ_LENS [BACKENDS] [STEPS] [ARGS...]   `twinflash train` throughput on
#                                     4 GPUs (fsdp=1,sp=4, bf16, random tokens), each run under RUN_TIMEOUT_S (300);
#                                     every run's train.jsonl and log in one archive, $OUT/train-runs.tar.gz
# Everything lands in $OUT (default ./out): logs, JSON, and the tables printed last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
stage=${1:?stage: kernel-tests | kernel-bench | ring | ring-bench | compare | train}

environment() {
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import sys,torch,triton,jax;print(sys.version.split()[0],'torch',torch.__version__,'triton',\
triton.__version__,'jax',jax.__version__,'gpus',torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
}

summary() {  # the last lines of each log: what the reply's output tail shows
    for log in "$@"; do echo "== $(basename "$log")"; tail -n "${TAIL:-6}" "$log"; done
}

case "$stage" in
kernel-tests)  # GPU kernel tests of both backends, then a quick `bench kernels`; one GPU is enough
    environment
    timeout 240 python3 -m pytest -q -m gpu -x tests/test_flash_attention_torch.py > "$OUT/gpu-tests-torch.log" 2>&1
    timeout 200 python3 -m pytest -q -m gpu -x tests/test_flash_attention_jax.py > "$OUT/gpu-tests-jax.log" 2>&1
    timeout 140 python3 -m compare.bench.kernel_bench --quick --part-timeout-s 65 --out "$OUT/kernels-quick.json" \
        > "$OUT/bench-quick.log" 2>&1
    TAIL=4 summary "$OUT"/gpu-tests-*.log
    tail -n 30 "$OUT/bench-quick.log"
    ;;
kernel-bench)  # kernel-bench PART [SEQ_LENS] [ROWS_FROM...]: one part of the full sweep, merged with earlier JSON
    part=${2:?part: torch | jax}; lens=${3:-4k,16k,64k}; shift 3 || shift $#
    rows=(); for f in "$@"; do rows+=(--rows-from "$f"); done
    timeout 570 python3 -m compare.bench.kernel_bench --parts "$part" --seq-lens "$lens" --part-timeout-s 550 \
        "${rows[@]}" --out "$OUT/kernels-$part.json" > "$OUT/bench-$part.log" 2>&1
    tail -n 45 "$OUT/bench-$part.log"
    ;;
ring)  # 4-GPU ring tests of both backends, then `bench ring` at Hkv=8 (GQA) for 32k and 128k
    environment
    timeout 300 python3 -m pytest -q -m gpu -x tests/test_ring_attention_torch.py > "$OUT/gpu-ring-torch.log" 2>&1
    timeout 100 python3 -m pytest -q -m gpu -x tests/test_ring_attention_jax.py > "$OUT/gpu-ring-jax.log" 2>&1
    timeout 250 python3 -m compare.bench.ring_bench --seq-lens 32k,128k --kv-heads 8 --warmup 2 --iters 3 \
        --launch-timeout-s 160 --out "$OUT/ring.json" > "$OUT/ring.log" 2>&1
    TAIL=4 summary "$OUT"/gpu-ring-*.log
    tail -n 40 "$OUT/ring.log"
    ;;
ring-bench)
    lens=${2:-32k,128k}; heads=${3:-32,8}; parts=${4:-torch,peer,jax}; shift 4 || shift $#
    rows=(); for f in "$@"; do rows+=(--rows-from "$f"); done
    environment
    # the JSON is rewritten after each worker, so a run cut short by the timeout keeps what it measured
    timeout "${RING_TIMEOUT_S:-570}" python3 -m compare.bench.ring_bench --parts "$parts" --seq-lens "$lens" --kv-heads "$heads" \
        --launch-timeout-s 320 "${rows[@]}" --out "$OUT/ring.json" > "$OUT/ring.log" 2>&1
    tail -n 40 "$OUT/ring.log"
    ;;
compare)
    model=${2:?model: a preset or converted directory}; shift 2
    environment
    timeout 590 python3 -m compare.cli compare --model "$model" --seq-lens 32k,128k --devices 4 --device-counts 1,4 \
        --steps 2 --job-timeout-s 240 --time-limit-s 540 "$@" --out "$OUT/compare-$model" > "$OUT/compare.log" 2>&1
    echo "exit $?"; tail -n 45 "$OUT/compare.log"
    ;;
train)
    model=${2:?model: a preset or converted directory}; lens=${3:?seq lens, e.g. 32768,131072}
    backends=${4:-torch,jax}; steps=${5:-3}; shift 5 || shift $#
    environment
    runs="$OUT/train-runs"  # archived at the end: the device tool brings back only a few files per call
    mkdir -p "$runs"
    for len in ${lens//,/ }; do
        for backend in ${backends//,/ }; do
            run="train-$backend-$model-$len"
            timeout "${RUN_TIMEOUT_S:-300}" python3 -m compare.cli train --backend "$backend" --model "$model" \
                --seq-len "$len" --steps "$steps" --mesh fsdp=1,sp=4 --batch 1 --dtype bf16 --data random "$@" \
                --out "$runs/$run" > "$runs/$run.log" 2>&1
            echo "exit $?" >> "$runs/$run.log"
        done
    done
    TAIL=3 summary "$runs"/train-*.log
    tar -czf "$OUT/train-runs.tar.gz" -C "$OUT" train-runs && rm -rf "$runs"
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
