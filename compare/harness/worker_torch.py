"""The torch backend's side of `twinflash compare`: runs the jobs of a job file (`compare/harness/jobs.py`) on this
torchrun launch's ranks, one process per device, each job over all of them (its mesh: fsdp=1, sp=world in a
compare run; the fast path's jobs are `fastpath_torch.py`'s). Twin of
`compare/harness/worker_jax.py`; the models, kernels, ring and training step are `torch_impl`'s own, built by
`torch_impl.train.build_training` exactly as `twinflash train` builds them (a curve job of the bf16 noise floor
trains as `twinflash train` does: the same settings, batches and `train_step`).

`python -m torch.distributed.run --nproc-per-node=P -m compare.harness.worker_torch JOBFILE`. Rank 0 writes the files;
a failing job raises, which ends the launch (see compare/harness/jobs.py).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.numpy import save_file
from torch.profiler import ProfilerActivity, profile

from compare.harness import fastpath_torch
from compare.harness.jobs import (Job, Phases, SetupClock, bench_units, exposed_seconds,
                                  forward_passes, job_batches, launched_at, mark_progress, mark_started,
                                  read_job_file, timed_steps, union_seconds, write_result)
from compare.launch import end_process
from compare.nodes import Nodes
from torch_impl.parallel import local_batch
from torch_impl.train import Training, all_ranks, build_training, init_distributed, peak_memory_bytes, train_step
from weights.layout import gather_sequence
from weights.parallel import RING_LAYOUT
from weights.training import valid_target_count


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor on every rank (a collective: all ranks call it in the same order)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _weight_sums(run: Training) -> dict[str, list[float]]:
    """float64 [sum, sum of squares] of every parameter as loaded (on rank 0; the gather involves every rank)."""
    sums = {}
    for name, param in run.llama.named_parameters():
        whole = _full(param.detach())
        if dist.get_rank() == 0:
            whole = whole.double()
            sums[name] = [float(whole.sum()), float(whole.square().sum())]
    return sums


def _global_loss(share: torch.Tensor) -> float:
    total = share.detach().clone()
    dist.all_reduce(total)
    return float(total)


def _gathered_logits(local: torch.Tensor, run: Training) -> np.ndarray:
    """float32 [B, S, vocab] in position order from every sp rank's [B, S_local, vocab]."""
    group = run.mesh["sp"].get_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return gather_sequence([p.cpu().numpy() for p in parts], RING_LAYOUT)


def equivalence(job: Job, work_dir: Path, device: torch.device, clock: SetupClock) -> None:
    """An equivalence job (jobs.py), or a "gradients" job of the fast path: its gradients alone (no weight sums,
    logits or loss curve)."""
    phases = Phases()  # each lap after a host read, which waits for the GPU's work
    settings = job.settings()
    batches = job_batches(job)
    run = build_training(settings, device)
    clock.weights_loaded()
    phases.lap("build")
    fastpath_torch.perturb(run, job.perturb)
    whole = job.kind == "equivalence"
    sums = _weight_sums(run) if whole else None
    phases.lap("weight sums")
    tokens, targets, positions = local_batch(batches[0], run.mesh, device)
    count = valid_target_count(settings.batch, job.seq_len)
    share, local_logits = run.model(tokens, positions, targets, count, with_logits=True) if whole else (
        run.model(tokens, positions, targets, count), None)
    share.backward()
    loss = _global_loss(share)
    phases.lap("loss and gradients")
    arrays = {"logits": _gathered_logits(local_logits, run)} if whole else {}
    rank0 = dist.get_rank() == 0
    for name, param in run.llama.named_parameters():
        full = _full(param.grad)  # a collective: every rank takes part, rank 0 keeps the copy
        if rank0:  # float32 already (fp32 master weights): one copy to the host, no conversion
            arrays[f"grad/{name}"] = full.cpu().numpy()
    for p in run.llama.parameters():
        p.grad = None
    phases.lap("gather to host")
    curve = []
    if whole and job.mode == "train":
        for step in range(settings.steps):
            curve.append(train_step(run.model, run.optimizer, *local_batch(batches[step], run.mesh, device), step,
                                    count)[0])
    phases.lap("loss curve steps")
    if rank0:
        save_file(arrays, str(work_dir / f"{job.id}.safetensors"))
        phases.lap("write")
        write_result(work_dir, job, {"status": "ok", "loss": loss, "loss_curve": curve, "weight_sums": sums,
                                     "phases_s": phases.seconds, "setup": clock.result()})


def curve(job: Job, work_dir: Path, device: torch.device, clock: SetupClock) -> None:
    """A curve job (compare/harness/jobs.py): `twinflash train`'s steps on its batches, the loss of each."""
    settings = job.settings()
    batches = job_batches(job)
    run = build_training(settings, device)
    clock.weights_loaded()
    fastpath_torch.perturb(run, job.perturb)
    count = valid_target_count(settings.batch, job.seq_len)
    rank0 = dist.get_rank() == 0
    losses, seconds = [], []
    for step in range(settings.steps):
        if rank0:
            mark_progress(work_dir, job, step, settings.steps, f"step {step + 1}/{settings.steps}")
        began = time.perf_counter()
        losses.append(train_step(run.model, run.optimizer, *local_batch(batches[step], run.mesh, device), step,
                                 count)[0])  # waits for the step
        seconds.append(time.perf_counter() - began)
    if rank0:
        steady = statistics.median(seconds[1:]) if len(seconds) > 1 else None
        write_result(work_dir, job, {"status": "ok", "losses": losses, "seconds": time.time() - clock.began,
                                     "setup": clock.result(seconds[0] if steady else None, steady)})


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _activity_intervals(prof, device: torch.device) -> tuple[list, list]:
    """(communication, compute) (start, end) seconds of this rank: on the GPU, NCCL kernels and every other kernel;
    on CPU, gloo's transfers and the aten operators."""
    communication, compute = [], []
    for event in prof.events():
        name = event.name.lower()
        interval = (event.time_range.start / 1e6, event.time_range.end / 1e6)
        if device.type == "cuda":
            if event.device_type == torch.autograd.DeviceType.CUDA:
                (communication if "nccl" in name else compute).append(interval)
        elif name.startswith("gloo:"):
            communication.append(interval)
        elif name.startswith("aten::"):
            compute.append(interval)
    return communication, compute


def bench(job: Job, work_dir: Path, device: torch.device, clock: SetupClock) -> None:
    settings = job.settings()
    batches = job_batches(job)
    rank0 = dist.get_rank() == 0
    units = bench_units(job.steps)
    run = build_training(settings, device)
    clock.weights_loaded()
    count = valid_target_count(1, job.seq_len)
    inputs = [local_batch(batch, run.mesh, device) for batch in batches]

    def progress(done: int, phase: str) -> None:
        if rank0:
            mark_progress(work_dir, job, done, units, phase)

    def forward(i: int) -> float:
        tokens, targets, positions = inputs[i]
        with torch.no_grad():
            return _global_loss(run.model(tokens, positions, targets, count))

    def step(i: int) -> float:
        if job.mode == "train":
            return train_step(run.model, run.optimizer, *inputs[i], i, count)[0]
        return forward(i)

    def timed(fn, i: int, phase: str, done: int) -> float:
        progress(done, phase)
        _synchronize(device)
        began = time.perf_counter()
        fn(i)  # both end in a host read of the loss, which waits for the step
        # the slowest rank's time: every rank then takes the same decisions on it (how many passes, jobs.LONG_STEP_S)
        return max(all_ranks(round((time.perf_counter() - began) * 1e9), device)) / 1e9

    first_s = timed(step, 0, "warm-up step", 1)  # compilation (Triton autotuning) and allocator warm-up
    step_times = timed_steps(lambda i: timed(step, i, f"step {i}/{job.steps}", 1 + i), len(inputs) - 1)
    step_s = statistics.median(step_times)
    if device.type == "cuda":  # no_grad is a graph of its own for torch.compile (GPUs only): compiled here, untimed
        forward(0)
    forward_s = statistics.median(timed(forward, i, "forward", 2 + job.steps + i)
                                  for i in range(min(forward_passes(step_s), len(inputs))))
    comm_s = exposed_s = prof = None
    if job.devices > 1 or job.trace_dir is not None:  # one device: no communication to find, no trace asked for
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        progress(units - 1, "profiled step")
        with profile(activities=activities) as prof:
            step(0)
            _synchronize(device)
    if job.devices > 1:
        communication, compute = _activity_intervals(prof, device)
        comm_s = union_seconds(communication)
        if device.type == "cuda":  # measured in the profiled step
            exposed_s = min(exposed_seconds(communication, compute), step_s)
        # on CPU, not measured: Triton's interpreter leaves no profiler event for a kernel, so the compute that
        # hides a gloo transfer cannot be told from a wait for it
    peaks = all_ranks(peak_memory_bytes(device), device)
    if not rank0:
        return
    trace = None
    if job.trace_dir is not None:
        trace = str(Path(job.trace_dir) / f"{job.id}.pt.trace.json")
        prof.export_chrome_trace(trace)
    write_result(work_dir, job, {"status": "ok", "step_s": step_s, "first_step_s": first_s,
                                 "forward_s": forward_s, "comm_s": comm_s, "comm_exposed_s": exposed_s,
                                 "peak_memory_bytes": max(peaks), "trace": trace, "platform": device.type,
                                 "setup": clock.result(first_s, step_s)})


def _allow_recompiles() -> None:
    """One launch serves many jobs, each compiling its modules for its own shapes and dtype: raise dynamo's
    per-function recompile limit (8) so that a later job is not silently left uncompiled."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 64))


def main(argv: list[str]) -> int:
    jobs, work_dir = read_job_file(Path(argv[0]))
    started_at = launched_at()
    nodes = Nodes.from_env()  # a launch spanning nodes: every collective's wait bounded by the rendezvous timeout
    device = init_distributed(None if nodes is None else nodes.timeout_s)
    _allow_recompiles()
    try:
        for job in jobs:
            if dist.get_rank() == 0:
                mark_started(work_dir, job)
            clock = SetupClock(started_at)
            started_at = None  # the launch's start is the first job's setup alone
            {"equivalence": equivalence, "gradients": equivalence, "attention": fastpath_torch.attention,
             "bench": bench, "curve": curve}[job.kind](job, work_dir, device, clock)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
