"""The report dict of `twinflash compare` (format "twinflash-compare/1", schema compare/report/schema.json) from
its jobs' results: the benchmark arithmetic of each point (throughput, TFLOP/s, MFU, communication bandwidth,
exposed communication, scaling efficiency (GPUs only: CPU timings rank nothing), time to N tokens), every job's
setup time beside its measured time, the environment the numbers were measured in, and the model's description.
Every point names its precision (the run's dtype, or "fp8"); the precision section is compare/report/precision.py's.
`compare/harness/` runs the jobs; `compare/report/write.py` writes the dict, rendered.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path

from compare.args import recorded_command
from compare.harness import jobs as J
from compare.harness.plan import CompareSettings
from weights import LlamaConfig
from weights.flops import PEAK_FLOPS_PER_DEVICE, forward_flops_per_token, model_flops_per_token
from weights.parallel import MeshShape, step_comm_bytes, weights_regathered_for_backward

MFU_FORMULA = (f"MFU = model FLOPs per second / ({PEAK_FLOPS_PER_DEVICE / 1e12:.0f} TFLOP/s x devices); "
               "model FLOPs per token = 6 N + 6 x layers x heads x head_dim x S (training: forward + backward, causal attention, no credit for recomputation) "
               "or a third of that (forward mode); N = parameters multiplied in matmuls (weights.flops)")
_MEASURED = ("step_s", "forward_s", "backward_s", "comm_s", "comm_exposed_s", "comm_bytes", "comm_bandwidth_gbps", "tokens_per_s",
             "tflops_per_device", "mfu", "peak_memory_bytes", "scaling_efficiency", "time_to_tokens_s")


def _flops_per_token(config: LlamaConfig, seq_len: int, mode: str) -> float:
    return (model_flops_per_token if mode == "train" else forward_flops_per_token)(config, seq_len)


def _parameter_gathers(job: J.Job, train: bool) -> int:
    """All-gathers of the weights per step: both backends regather each layer's only when checkpointing."""
    return 2 if (train and weights_regathered_for_backward(job.remat)) else 1


def benchmark_point(job: J.Job, result: dict, config: LlamaConfig, settings: CompareSettings) -> dict:
    """One row of the benchmark section (scaling efficiency filled in later by `add_scaling`)."""
    point = {"backend": job.backend, "seq_len": job.seq_len, "devices": job.devices, "attention": job.attention,
             "kernel": job.attention_backend, "precision": "fp8" if job.fp8 else job.dtype, "scheme": job.scheme,
             "ulysses_degree": job.ulysses_degree,
             "status": result["status"], "message": result.get("message"), "trace": None,
             **dict.fromkeys(_MEASURED)}
    if result["status"] != "ok":
        return point
    step_s, train = result["step_s"], job.mode == "train"
    tflops = job.seq_len * _flops_per_token(config, job.seq_len, job.mode) / step_s / job.devices / 1e12
    exposed = result.get("comm_exposed_s")
    point.update(step_s=step_s, forward_s=result["forward_s"], comm_s=result["comm_s"],
                 comm_exposed_s=None if exposed is None else min(exposed, step_s),
                 backward_s=max(0.0, step_s - result["forward_s"]) if train else None,
                 tokens_per_s=job.seq_len / step_s, tflops_per_device=tflops,
                 mfu=tflops * 1e12 / PEAK_FLOPS_PER_DEVICE if settings.platform == "gpu" else None,
                 peak_memory_bytes=result["peak_memory_bytes"],
                 time_to_tokens_s=settings.time_to_tokens * step_s / job.seq_len)
    if result.get("peak_memory_source") == "XLA plan":
        point["message"] = "; ".join(filter(None, (
            point["message"], "peak memory from XLA's plan of the step: an earlier job of the same process peaked "
                              "higher, and JAX's peak counter cannot be reset")))
    if job.devices > 1:
        compute_bytes = 2 if job.dtype == "bf16" else 4
        point["comm_bytes"] = step_comm_bytes(
            config, seq_len=job.seq_len, batch=1, mesh=MeshShape(sp=job.devices), compute_bytes=compute_bytes,
            train=train, remat=job.remat, parameter_gathers=_parameter_gathers(job, train),
            gradient_bytes=4 if job.backend == "torch" else compute_bytes, sp_scheme=job.scheme,
            ulysses_degree=job.ulysses_degree)["total"]
        if result["comm_s"]:
            point["comm_bandwidth_gbps"] = point["comm_bytes"] / result["comm_s"] / 1e9
    if result.get("trace"):
        point["trace"] = os.path.relpath(result["trace"], settings.out)
    return point


def job_timing(job: J.Job, result: dict) -> dict:
    """One row of the report's "jobs": where the job's time went (setup beside measurement), null where the job
    did not run."""
    setup = result.get("setup") or {}
    return {"id": job.id, "kind": job.kind, "backend": job.backend, "devices": job.devices,
            "status": result["status"], **{key: setup.get(key) for key in ("launch_s", "weights_s", "compile_s",
                                                                           "measured_s")},
            "phases_s": result.get("phases_s")}


def add_scaling(points: list[dict], platform: str) -> None:
    """scaling_efficiency = step_s(1 device) / (devices x step_s(devices)) for the same backend, length, kernel
    and precision; on GPUs only (CPU timings measure interpreters on emulated devices: they rank nothing)."""
    if platform != "gpu":
        return

    def key(p: dict) -> tuple:
        return p["backend"], p["seq_len"], p["attention"], p.get("precision"), p.get("scheme", "ring")

    single = {key(p): p["step_s"] for p in points if p["devices"] == 1 and p["step_s"]}
    for p in points:
        base = single.get(key(p))
        if base and p["step_s"]:
            p["scaling_efficiency"] = base / (p["devices"] * p["step_s"])


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(command: list[str], cwd: Path | None = None) -> str | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True, timeout=20, cwd=cwd).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


CHECKOUT = Path(__file__).resolve().parents[2]  # the twinflash checkout this module runs from


def checkout_commit(root: Path) -> str | None:
    """The commit checked out in `root` when `root` is the top of a git work tree (a clone or a worktree), with
    " + uncommitted changes" when tracked files differ from it (a copy of a newer tree under an older .git, as a
    device machine's copy can be, would otherwise pass for that commit); None otherwise: a checkout without its own
    .git would show the commit of a repository above it."""
    top = _command_output(["git", "rev-parse", "--show-toplevel"], cwd=root)
    if top is None or Path(top).resolve() != root.resolve():
        return None
    head = _command_output(["git", "rev-parse", "HEAD"], cwd=root)
    changed = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return f"{head} + uncommitted changes" if head and changed else head


def environment(settings: CompareSettings) -> dict:
    if settings.platform == "gpu":
        import torch

        names = [torch.cuda.get_device_name(i) for i in range(settings.devices)]
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        driver = driver.splitlines()[0] if driver else None
    else:
        names, driver = [f"cpu ({settings.devices} emulated devices: gloo processes, XLA host devices)"], None
    libraries = {name: _version(name) for name in ("torch", "triton", "jax", "jaxlib", "flax", "numpy")}
    return {"platform": settings.platform, "devices": names, "driver": driver,
            "python": platform.python_version(), "libraries": libraries,
            "git_commit": checkout_commit(CHECKOUT),
            "hostname": socket.gethostname(), "cpu_count": os.cpu_count() or 1}


def model_section(name: str, config: LlamaConfig) -> dict:
    return {"name": name, "num_params": config.num_params, "layers": config.num_layers,
            "hidden": config.hidden_size, "heads": config.num_heads, "kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "vocab": config.vocab_size}


def report_dict(*, settings: CompareSettings, config: LlamaConfig, equivalence: dict, points: list[dict],
                peers: list[dict], argv: list[str], jobs: list[dict] | None = None, hf: dict | None = None,
                training_peer: dict | None = None) -> dict:
    """The report without its precision section ("precision": null; `compare.report.precision.precision_section`
    makes it from this dict) and without its plots (`write_report` lists them). `hf`: the Hugging Face section
    (compare/report/hf.py), `training_peer` the live training peer's (compare/report/peer.py); a disagreement in
    either fails the report."""
    return {
        "format": "twinflash-compare/1",
        "command": recorded_command(["twinflash", "compare", *argv]),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "passed": (equivalence["passed"] and equivalence.get("fast_path", {"passed": True})["passed"]
                   and all(section is None or section["passed"] for section in (hf, training_peer))),
        "settings": settings.public(),
        "environment": environment(settings),
        "model": model_section(settings.model, config),
        "flops": {"formula": MFU_FORMULA,
                  "peak_flops_per_device": PEAK_FLOPS_PER_DEVICE if settings.platform == "gpu" else None},
        "equivalence": equivalence,
        "benchmark": {"points": points},
        "precision": None,
        "hf": hf,
        "training_peer": training_peer,
        "peers": peers,
        "jobs": jobs or [],
        "plots": [],
    }
