"""The GPU benchmarks: `bench kernels` (kernel_bench.py), `bench ring` (ring_bench.py plans and reports,
ring_bench_workers.py measures), `bench hf` (hf_bench.py: HF transformers' Llama with our ring beside our torch
model, measured by compare/harness/hf_rows.py), `bench train-peer` (train_peer.py: PyTorch's context parallelism as
the attention of our training step beside ours, measured by compare/harness/peer_rows.py), the block-size sweeps of
the Pallas and Gluon kernels (pallas_sweep.py, gluon_sweep.py), one forward+backward for Nsight Compute
(kernel_ncu.py), the JAX compile profile (jax_compile_profile.py),
our kernels on packed documents (document_kernels.py) and, on the CPU, the ring layouts' balance with documents
(document_balance.py), what they share (common.py: results go to --out, by default under out/), and the stage
scripts of GPU tests and benchmarks that each fit one device call (*.sh). They import the harness's trace helpers and
measurements, never the report or the commands (compare/__init__.py draws the arrows)."""
