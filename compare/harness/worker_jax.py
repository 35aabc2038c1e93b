"""The JAX backend's side of `twinflash compare`: runs the jobs of a job file (`compare/harness/jobs.py`) in this one
process, each job over the first `devices` of JAX's devices (fsdp=1, sp=devices). Twin of
`compare/harness/worker_torch.py`; the models, kernels, ring and training step are `jax_impl`'s own, built by
`jax_impl.train.build_training` exactly as `twinflash train` builds them.

`python -m compare.harness.worker_jax JOBFILE` (on CPU with XLA_FLAGS asking for the host devices, which the harness
sets). An out-of-memory or other error of a job is recorded as its result and the next job runs.

Equivalence jobs run with float32 matmuls at full precision (`jax.default_matmul_precision("highest")`): on GPUs
XLA's default for float32 dots is TF32, which torch does not use (torch.backends.cuda.matmul.allow_tf32 is off).
"""

from __future__ import annotations

import glob
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from compare.harness.jobs import (PERTURBATION, Job, union_seconds, is_collective_op, is_out_of_memory, job_batches,
                          mark_started, read_job_file, write_result)
from jax_impl.model import stack_layers, unstack_layers
from jax_impl.parallel import sharded_batch
from jax_impl.train import Training, build_training, next_token_loss, peak_memory_bytes, step_scalars, train_step
from weights.layout import inverse_order, layout_order
from weights.parallel import RING_LAYOUT
from weights.training import adamw_coefficients

_loss_and_grads = jax.jit(jax.value_and_grad(next_token_loss, has_aux=True), static_argnames=("spec", "with_logits"))
_forward_loss = jax.jit(next_token_loss, static_argnames=("spec",))


def _perturb(run: Training, name: str | None) -> None:
    if name is not None:  # the state stacks the layers' weights: perturbed by name, stacked again as it was
        params = unstack_layers(run.state["model"])
        params[name] = params[name] * (1 + PERTURBATION)
        shardings = jax.tree.map(lambda p: p.sharding, run.state["model"])
        run.state["model"] = jax.device_put(stack_layers(params), shardings)


def _weight_sums(run: Training) -> dict[str, list[float]]:
    """float64 [sum, sum of squares] of every parameter as loaded."""
    sums = {}
    for name, param in unstack_layers(run.state["model"]).items():
        whole = np.asarray(param).astype(np.float64)
        sums[name] = [float(whole.sum()), float(np.square(whole).sum())]
    return sums


def _train_steps(run: Training, batches: np.ndarray, steps: range) -> list[float]:
    """Losses of optimizer steps `steps` on `batches` (the state is donated and replaced in `run`)."""
    losses = []
    for step in steps:
        coefficients = adamw_coefficients(run.spec.optimizer, step)
        run.state, loss, _ = train_step(run.state, *sharded_batch(batches[step], run.mesh),
                                        step_scalars(coefficients), spec=run.spec)
        losses.append(float(loss))  # waits for the step
    return losses


def equivalence(job: Job, work_dir: Path, devices: list) -> dict:
    settings = job.settings()
    batches = job_batches(job)
    with jax.default_matmul_precision("highest"):
        run = build_training(settings, devices)
        _perturb(run, job.perturb)
        sums = _weight_sums(run)
        tokens, targets, positions = sharded_batch(batches[0], run.mesh)
        (loss, logits), grads = _loss_and_grads(run.state["model"], tokens, targets, positions, spec=run.spec,
                                                with_logits=True)
        order = layout_order(job.seq_len, job.devices, RING_LAYOUT)
        arrays = {"logits": np.asarray(logits)[:, inverse_order(order)]}
        arrays.update({f"grad/{name}": np.asarray(g) for name, g in unstack_layers(grads).items()})
        curve = _train_steps(run, batches, range(settings.steps)) if job.mode == "train" else []
    save_file(arrays, str(work_dir / f"{job.id}.safetensors"))
    return {"status": "ok", "loss": float(loss), "loss_curve": curve, "weight_sums": sums}


def communication_intervals(trace_dir: str, platform: str) -> list[tuple[float, float]]:
    """(start, end) seconds of device 0's communication in a profile: NCCL kernels on GPU 0, the XLA collectives'
    events on the host threads that run the CPU devices."""
    (xplane,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    intervals = []
    for plane in jax.profiler.ProfileData.from_file(xplane).planes:
        on_gpu0 = plane.name == "/device:GPU:0"
        if not (on_gpu0 if platform == "gpu" else plane.name.startswith("/host:CPU")):
            continue
        for line in plane.lines:
            for event in line.events:
                if ("nccl" in event.name.lower()) if on_gpu0 else is_collective_op(event.name):
                    intervals.append((event.start_ns / 1e9, event.end_ns / 1e9))
    return intervals


def bench(job: Job, work_dir: Path, devices: list) -> dict:
    settings = job.settings()
    batches = job_batches(job)
    run = build_training(settings, devices)
    inputs = [sharded_batch(batch, run.mesh) for batch in batches]

    def forward(i: int) -> float:
        return float(_forward_loss(run.state["model"], *inputs[i], spec=run.spec))

    def step(i: int) -> float:
        return _train_steps(run, batches, range(i, i + 1))[0] if job.mode == "train" else forward(i)

    def timed(fn, i: int) -> float:
        began = time.perf_counter()
        fn(i)  # both end in a host read of the loss, which waits for the step
        return time.perf_counter() - began

    first_s = timed(step, 0)  # compilation and allocator warm-up
    step_times = [timed(step, i) for i in range(1, len(inputs))]
    forward(0)  # compiles the forward alone
    forward_s = statistics.median(timed(forward, i) for i in range(min(2, len(inputs))))
    trace_dir = job.trace_dir and str(Path(job.trace_dir) / job.id)
    with tempfile.TemporaryDirectory() as scratch:
        log_dir = trace_dir or scratch
        with jax.profiler.trace(log_dir):
            step(0)
        platform = jax.default_backend()
        comm_s = union_seconds(communication_intervals(log_dir, platform)) if job.devices > 1 else None
    return {"status": "ok", "step_s": statistics.median(step_times), "first_step_s": first_s,
            "forward_s": forward_s, "comm_s": comm_s, "peak_memory_bytes": max(peak_memory_bytes(run.mesh)),
            "trace": trace_dir, "platform": platform}


def main(argv: list[str]) -> int:
    jobs, work_dir = read_job_file(Path(argv[0]))
    for job in jobs:
        mark_started(work_dir, job)
        try:
            result = (equivalence if job.kind == "equivalence" else bench)(job, work_dir, jax.devices()[:job.devices])
        except Exception as failure:  # recorded in the report; the sweep goes on
            message = f"{type(failure).__name__}: {failure}"
            traceback.print_exc()
            result = {"status": "oom" if is_out_of_memory(message) else "error", "message": message[:2000]}
        write_result(work_dir, job, result)
        jax.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
