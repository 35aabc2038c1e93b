"""The GPU benchmarks: `bench kernels` (kernel_bench.py), `bench ring` (ring_bench.py plans and reports,
ring_bench_workers.py measures), the Pallas block-size sweep (pallas_sweep.py), what they share (common.py), and
gpu_suite.sh, the stages of GPU tests and benchmarks that each fit one device call."""
