"""`twinflash compare`: the embedded default end to end (both backends, 4 emulated CPU devices, report checked
against its schema), the harness catching a perturbed weight (negative control: exit 1, the report names the
parameter), bad input (one line, exit 2, nothing written), the launch loop's handling of a worker that dies
(OOM recorded, the sweep goes on) or hangs (timeout), and launches on disjoint GPUs side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from compare.cli import main as cli_main
from compare.harness import jobs as J
from compare.harness.launches import Launch, launch_polls, run_launch, run_side_by_side
from compare.report.write import validate_report
from weights import PRESETS
from weights.parallel import MeshShape, step_comm_bytes, weights_regathered_for_backward

ROOT = Path(__file__).resolve().parent.parent


def _compare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "compare.cli", "compare", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)


@pytest.mark.slow
def test_embedded_default_writes_a_passing_full_report(tmp_path):
    out = tmp_path / "report"
    run = _compare("--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert report["passed"] and report["equivalence"]["passed"]
    assert {c["name"] for c in report["equivalence"]["comparisons"]} == {
        "torch vs reference", "jax vs reference", "torch vs jax"}
    assert set(report["equivalence"]["loss_curves"]) == {"reference", "torch", "jax"}
    points = report["benchmark"]["points"]
    ours = [p for p in points if p["attention"] == "ours"]
    assert {(p["backend"], p["devices"]) for p in ours} == {(b, d) for b in ("torch", "jax") for d in (1, 4)}
    assert all(p["status"] == "ok" and p["tokens_per_s"] > 0 and p["peak_memory_bytes"] > 0 for p in ours)
    assert all(p["comm_s"] > 0 and p["comm_bandwidth_gbps"] > 0 for p in ours if p["devices"] > 1)
    assert {p["status"] for p in points if p["attention"] == "vendor"} == {"unsupported"}  # no GPU here
    assert all(p["status"] == "ok" for p in points if p["attention"] == "reference")
    assert report["plots"]
    for plot in report["plots"]:
        path = out / plot
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # not a blank image
    traces = [p["trace"] for p in points if p["trace"]]
    assert traces and all((out / t).exists() for t in traces)
    md = (out / "report.md").read_text()
    assert "PASS" in md and (out / "report.html").exists()
    assert not list((out / "work").glob("*.safetensors"))  # the big arrays are summarised, then removed
    # exposed communication: its own number, never more than the step, beside the kernels' busy time
    assert all(0 <= p["comm_exposed_s"] <= p["step_s"] for p in points if p["comm_exposed_s"] is not None)
    assert all(p["comm_exposed_s"] is not None for p in ours if p["devices"] > 1 and p["backend"] == "jax")
    # (torch on CPU: not measured, Triton's interpreter leaves no profiler event for the compute that hides it)
    # the CPU caveat at the top; nothing ranked; no small value printed as 0.0
    assert "CPU run: not a benchmark." in md.split("## Setup")[0]
    assert all(p["scaling_efficiency"] is None for p in points) and "speed-up vs vendor" not in md
    assert not re.search(r"(?<![\d.,])0\.0+(?![\d])", md)
    # the weights were made once, before any job, and every job's process read them from the run's directory
    made = json.loads((out / "work" / "weights.json").read_text())
    assert made["model"] == "tiny" and made["directory"] == "weights"
    for job_file in (out / "work").glob("jobs-*.json"):
        assert {job["model"] for job in json.loads(job_file.read_text())["jobs"]} == {str(out / "work" / "weights")}
    assert not (out / "work" / "weights").exists() and not (out / "work" / "cache").exists()  # removed after
    # one launch per backend and device count, and every job's setup beside its measured time
    assert sorted(p.name for p in (out / "work" / "logs").iterdir()) == sorted(
        f"{b}-{d}.log" for b in ("torch", "jax") for d in (1, 4))
    timed = [j for j in report["jobs"] if j["status"] == "ok"]
    assert len(timed) == len(report["jobs"]) - 2  # the vendor kernels are unsupported here
    assert all(j["weights_s"] >= 0 and j["measured_s"] > 0 for j in timed)
    assert sum(j["launch_s"] > 0 for j in timed) == 4  # the first job of each launch pays its start
    # the equivalence checks say where their measured time went, phase by phase; the report's table shows it
    for job in (j for j in timed if j["kind"] == "equivalence"):
        assert list(job["phases_s"])[:3] == ["build", "weight sums", "loss and gradients"], job["id"]
    assert "loss and gradients " in md


@pytest.mark.slow
def test_perturbed_weight_fails_and_the_report_names_it(tmp_path):
    out, name = tmp_path / "report", "layers.1.feed_forward.w2.weight"
    run = _compare("--no-bench", "--mode", "forward", "--seq-lens", "64", "--perturb", f"jax:{name}",
                   "--out", str(out))
    assert run.returncode == 1, run.stderr[-3000:]
    assert name in run.stderr
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert not report["passed"]
    verdicts = {c["name"]: c for c in report["equivalence"]["comparisons"]}
    assert verdicts["torch vs reference"]["passed"]  # the unperturbed backend still matches
    for failing in ("jax vs reference", "torch vs jax"):
        comparison = verdicts[failing]
        assert not comparison["passed"]
        assert not next(c for c in comparison["checks"] if c["metric"].startswith("logits max-abs"))["passed"]
        moved = [p["name"] for p in comparison["parameters"] if p["weight_sum_diff"] > 1e-12]
        assert moved == [name]
    assert name in (out / "report.md").read_text()


@pytest.mark.slow
def test_a_perturbed_attention_gradient_fails_the_fast_path_which_names_backend_and_tensor(tmp_path):
    """`--perturb jax:attention-dq=1.01`: JAX's attention function on the points' path returns dq scaled by 1 %. The
    float32 checks (another path) still pass; the fast path fails on JAX's dq alone, at every device count, and the
    run exits 1 with lines naming them."""
    out = tmp_path / "report"
    run = _compare("--no-bench", "--mode", "forward", "--seq-lens", "64", "--perturb", "jax:attention-dq=1.01",
                   "--out", str(out))
    assert run.returncode == 1, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    fast = report["equivalence"]["fast_path"]
    assert report["equivalence"]["passed"] and not fast["passed"] and not report["passed"]
    failing = {(e["backend"], e["devices"], c["tensor"]) for e in fast["attention"] for c in e["checks"]
               if not c["passed"]}
    assert failing == {("jax", 1, "dq"), ("jax", 4, "dq")}
    assert all(e["passed"] for e in fast["steps"])  # a 1 % dq moves the step's gradients < 2x the vendor's
    assert "jax attention on 4 device(s), ours (pallas)" in run.stderr and "dq relative" in run.stderr
    assert "bf16 fast path: FAIL" in (out / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--seq-lens", "100"], "100"),
    (["--devices", "0"], "--devices"),
    (["--backends", "torch,mxnet"], "--backends"),
    (["--backends", "jax"], "name torch too (--backends torch,jax)"),  # the reference's backend left out
    (["--perturb", "jax:no.such.weight"], "--perturb"),
    (["--model", "/no/such/dir"], "/no/such/dir"),
    (["--ablation", "fastest"], "--ablation"),
    (["--device-counts", "1,four"], "--device-counts"),
    (["--device-counts", "1,8"], "--device-counts"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "report"
    assert cli_main(["compare", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinflash: error:") and "\n" not in err and message in err
    assert not out.exists()


def test_existing_output_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["compare", "--out", str(out)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


_FAKE_WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from compare.harness import jobs as J
    jobs, work_dir = J.read_job_file(Path(sys.argv[1]))
    for job in jobs:
        J.mark_started(work_dir, job)
        began = time.time()
        if job.id.startswith("oom"):
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB", flush=True)
            sys.exit(1)
        if job.id == "hang":
            time.sleep(60)
        if job.id.startswith("segfault") and (job.id == "segfault-always" or not (work_dir / "crashed").exists()):
            (work_dir / "crashed").touch()
            os.kill(os.getpid(), signal.SIGSEGV)
        if job.id.startswith("slow"):
            time.sleep(1.5)
        J.write_result(work_dir, job, {"status": "ok", "span": [began, time.time()],
                                       "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                       "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
                                       "triton_cache": os.environ.get("TRITON_CACHE_DIR")})
""")


def _job(job_id: str) -> J.Job:
    return J.Job(id=job_id, kind="bench", backend="torch", model="tiny", seq_len=64, devices=1, attention="ours",
                 attention_backend="triton", dtype="fp32", mode="train", steps=1)


def test_a_dead_worker_is_recorded_and_the_sweep_goes_on(tmp_path):
    done = []
    jobs = [_job("a"), _job("oom"), _job("b"), _job("hang"), _job("c")]
    run_launch(jobs, [sys.executable, "-c", _FAKE_WORKER], {"PYTHONPATH": str(ROOT)}, tmp_path, tmp_path / "log",
               timeout_s=3.0, on_done=lambda job: done.append(job.id))
    status = {j.id: J.read_result(tmp_path, j.id) for j in jobs}
    assert sorted(done) == sorted(j.id for j in jobs)
    assert {k: v["status"] for k, v in status.items()} == {"a": "ok", "oom": "oom", "b": "ok", "hang": "timeout",
                                                            "c": "ok"}
    assert "OutOfMemoryError" in status["oom"]["message"]


def test_a_job_whose_worker_crashed_runs_once_more_in_a_fresh_launch(tmp_path):
    """A worker killed by SIGSEGV: its job runs again in a new launch and, if it passes, says so; one that crashes
    again is recorded as an error naming the signal. Negative control: an out-of-memory job is not run again."""
    jobs = [_job("a"), _job("segfault-once"), _job("oom"), _job("segfault-always"), _job("b")]
    run_launch(jobs, [sys.executable, "-c", _FAKE_WORKER], {"PYTHONPATH": str(ROOT)}, tmp_path, tmp_path / "log",
               timeout_s=30.0, on_done=lambda job: None)
    results = {j.id: J.read_result(tmp_path, j.id) for j in jobs}
    assert {k: v["status"] for k, v in results.items()} == {"a": "ok", "segfault-once": "ok", "oom": "oom",
                                                             "segfault-always": "error", "b": "ok"}
    assert "died by SIGSEGV" in results["segfault-once"]["message"]
    assert "SIGSEGV, the second time" in results["segfault-always"]["message"]
    log = (tmp_path / "log").read_text()
    assert log.count("running it once more") == 2 and "oom: its worker" not in log


def test_the_time_limit_stops_the_sweep_and_records_what_did_not_run(tmp_path):
    import time

    jobs = [_job("a"), _job("hang"), _job("b")]
    run_launch(jobs, [sys.executable, "-c", _FAKE_WORKER], {"PYTHONPATH": str(ROOT)}, tmp_path, tmp_path / "log",
               timeout_s=60.0, on_done=lambda job: None, deadline=time.monotonic() + 2.0)
    results = {j.id: J.read_result(tmp_path, j.id) for j in jobs}
    assert results["a"]["status"] == "ok"
    assert results["hang"]["status"] == "timeout" and "--time-limit-s" in results["hang"]["message"]
    assert results["b"]["status"] == "timeout" and results["b"]["message"].startswith("not run")


def _fake_launch(jobs: list[J.Job], devices: int, work_dir: Path, log: str, done: list) -> Launch:
    def start(gpus):
        env = {"PYTHONPATH": str(ROOT)} | ({"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if gpus is not None else {})
        return launch_polls(jobs, [sys.executable, "-c", _FAKE_WORKER], env, work_dir, work_dir / log,
                            timeout_s=60.0, on_done=lambda job: done.append(job.id))

    return Launch(devices, start)


@pytest.mark.parametrize("side_by_side", [True, False])
def test_launches_on_disjoint_gpus_run_side_by_side(tmp_path, side_by_side):
    """Two one-GPU launches after a two-GPU one (which needs both): side by side, the later one-GPU launch goes
    first on the GPU the earlier one leaves free, the two overlap in time on GPUs of their own, the two-GPU launch
    waits for both; a launch's failing job is recorded and its next job relaunched as in a launch alone. Serial
    (negative control): no overlap, the environment's GPUs untouched."""
    done: list[str] = []
    launches = [_fake_launch([_job("slow-a"), _job("oom-a"), _job("after-oom")], 1, tmp_path, "a.log", done),
                _fake_launch([_job("both")], 2, tmp_path, "both.log", done),
                _fake_launch([_job("slow-b")], 1, tmp_path, "b.log", done)]
    run_side_by_side(launches, ("3", "5") if side_by_side else None)
    results = {name: J.read_result(tmp_path, name) for name in ("slow-a", "oom-a", "after-oom", "both", "slow-b")}
    assert sorted(done) == sorted(results)
    assert {k: v["status"] for k, v in results.items()} == {"slow-a": "ok", "oom-a": "oom", "after-oom": "ok",
                                                            "both": "ok", "slow-b": "ok"}
    a, b, both = results["slow-a"]["span"], results["slow-b"]["span"], results["both"]["span"]
    overlap = min(a[1], b[1]) - max(a[0], b[0])
    if side_by_side:
        assert overlap > 0.5, (a, b)
        assert {results["slow-a"]["gpus"], results["slow-b"]["gpus"]} == {"3", "5"}
        assert results["both"]["gpus"] == "3,5" and both[0] >= max(a[1], b[1])
    else:
        assert overlap < 0 and a[1] <= both[0] <= both[1] <= b[0]  # in the planned order, one at a time
        assert {r["gpus"] for r in results.values() if "gpus" in r} == {None}


@pytest.mark.parametrize("platform, side_by_side", [("gpu", True), ("gpu", False), ("cpu", True)])
def test_the_command_runs_one_gpu_launches_side_by_side_on_gpus_only(tmp_path, monkeypatch, platform, side_by_side):
    """`run_jobs` as the command calls it: on a host of 2 GPUs (CUDA_VISIBLE_DEVICES 4,6), the equivalence checks
    and the noise floor's trainings first, all at once on shared GPUs (JAX's taking memory as needed), then torch's
    and JAX's one-GPU launches overlap, each on a GPU of its own; with --serial-launches and on CPU nothing
    overlaps, and each check runs in its launch ahead of its points."""
    import dataclasses
    import time

    from compare.harness import launches
    from compare.harness.plan import CompareSettings

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setattr(launches, "side_launcher", lambda *args, **kwargs: (
        [sys.executable, "-c", _FAKE_WORKER], {"PYTHONPATH": str(ROOT)}))
    settings = CompareSettings(model="tiny", mode="train", seq_lens=(64,), device_counts=(1, 2), devices=2, steps=1,
                               dtype="fp32", backends=("torch", "jax"), attention_ablation=("ours",),
                               activation_checkpointing="off", check_seq_len=64, check_layers=1, bench=True,
                               platform=platform)
    check = dataclasses.replace(_job("slow-check-reference"), kind="equivalence")
    checks = [check, dataclasses.replace(check, id="slow-check-torch", devices=2),
              dataclasses.replace(check, id="slow-check-jax", backend="jax", devices=2),
              dataclasses.replace(check, id="slow-curve-jax", kind="curve", backend="jax", devices=2)]
    jobs = [_job("slow-torch"), dataclasses.replace(_job("slow-jax"), backend="jax"),
            dataclasses.replace(_job("both"), devices=2), *checks]
    called = []
    launches.run_jobs(jobs, settings, tmp_path, timeout_s=60.0, on_done=lambda job: None, side_by_side=side_by_side,
                      on_checks_done=lambda: called.append(time.time()))
    results = {job.id: J.read_result(tmp_path, job.id) for job in jobs}
    assert all(r["status"] == "ok" for r in results.values()), results

    def overlap(*names):
        spans = [results[name]["span"] for name in names]
        return min(end for _, end in spans) - max(start for start, _ in spans)

    checks_end = max(results[c.id]["span"][1] for c in checks)
    points_start = min(results[name]["span"][0] for name in ("slow-torch", "slow-jax", "both"))
    if platform == "gpu" and side_by_side:
        assert overlap("slow-check-reference", "slow-check-torch", "slow-check-jax", "slow-curve-jax") > 0.5
        assert checks_end <= points_start
        assert [results[c.id]["gpus"] for c in checks] == ["4", "4,6", "4,6", "4,6"]
        assert [results[c.id]["preallocate"] for c in checks] == [None, None, "false", "false"]
        # their autotuning on shared GPUs kept from the points' caches
        assert [Path(results[c.id]["triton_cache"]).relative_to(tmp_path).parts for c in checks] == [
            ("cache", kind, "triton") for kind in ("equivalence", "equivalence", "equivalence", "curve")]
        assert len(called) == 1 and checks_end <= called[0] <= points_start
        assert overlap("slow-torch", "slow-jax") > 0.5
        assert {results["slow-torch"]["gpus"], results["slow-jax"]["gpus"]} == {"4", "6"}
        assert results["both"]["gpus"] == "4,6"
    else:
        spans = sorted(r["span"] for r in results.values())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # one job at a time
        assert {r["gpus"] for r in results.values()} == {None}
        assert results["slow-check-reference"]["span"][1] <= results["slow-torch"]["span"][0]
        assert not called


def test_a_failure_beside_a_running_launch_stops_its_worker(tmp_path):
    """An exception from one launch (an `Interrupted`, a lost node) propagates with the launch beside it stopped:
    no worker of the run is left (negative control: the worker was running when it came)."""
    def failing(gpus):
        for _ in range(10):
            yield
        assert _workers(tmp_path), "the hanging launch's worker should be running by now"
        raise RuntimeError("lost node")

    launches = [_fake_launch([_job("hang")], 1, tmp_path, "hang.log", []), Launch(1, failing)]
    with pytest.raises(RuntimeError, match="lost node"):
        run_side_by_side(launches, ("0", "1"))
    assert not _workers(tmp_path)


def _workers(work_dir: Path) -> list[int]:
    """Processes whose command line names a job file of `work_dir`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(work_dir).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_launch_over_more_gpus_than_given_is_refused():
    with pytest.raises(ValueError, match="more GPUs"):
        run_side_by_side([Launch(3, lambda gpus: iter(()))], ("0", "1"))


def test_the_jax_peak_reads_the_compiled_step_without_compiling_it_again():
    """The JAX worker's memory analysis of a job's train step (`step_temp_bytes`) is served from jit's cache once
    the step ran; negative control: the step's own first call compiles, and is counted."""
    jax = pytest.importorskip("jax")
    from compare.harness.worker_jax import _train_steps, backend_compiles, step_temp_bytes
    from jax_impl.parallel import sharded_batch
    from jax_impl.train import build_training, step_scalars
    from weights.training import adamw_coefficients

    job = J.Job(id="peak", kind="bench", backend="jax", model="tiny", seq_len=64, devices=1, attention="reference",
                attention_backend="reference", dtype="fp32", mode="train", steps=1)
    run = build_training(job.settings(), jax.devices()[:1])
    batches = J.job_batches(job)
    with backend_compiles() as first:
        _train_steps(run, batches, range(1))
    args = (run.state, *sharded_batch(batches[0], run.mesh), step_scalars(adamw_coefficients(run.spec.optimizer, 0)))
    with backend_compiles() as analysis:
        temp = step_temp_bytes(run, args)
    assert first["count"] >= 1 and analysis["count"] == 0, (first, analysis)
    assert temp is not None and temp > 0


def test_the_float32_check_compiles_its_loss_curve_steps_with_its_options(monkeypatch, tmp_path):
    """The JAX equivalence check's training steps (its loss curve) compile with the check's XLA options
    (`worker_jax.CHECK_COMPILER_OPTIONS`: no GEMM autotuning, which took 125 of its 152 s on an H200) on top of the
    step's own; they reach the step as its spec's compiler options."""
    jax = pytest.importorskip("jax")
    from compare.harness import worker_jax

    job = J.Job(id="check", kind="equivalence", backend="jax", model="tiny", seq_len=64, devices=1,
                attention="reference", attention_backend="reference", dtype="fp32", mode="train", steps=2)
    seen, train_step = [], worker_jax.train_step

    def recording(*args, spec, **kwargs):
        seen.append(spec.compiler_options)
        return train_step(*args, spec=spec, **kwargs)

    monkeypatch.setattr(worker_jax, "train_step", recording)
    result = worker_jax.equivalence(job, tmp_path, jax.devices()[:1], J.SetupClock(None), {})
    assert result["status"] == "ok" and len(result["loss_curve"]) == 2
    assert len(seen) == 2
    assert all(options[-len(worker_jax.CHECK_COMPILER_OPTIONS):] == worker_jax.CHECK_COMPILER_OPTIONS
               for options in seen), seen


def test_a_long_step_times_its_forward_once():
    assert J.forward_passes(0.5) == 2 and J.forward_passes(J.LONG_STEP_S) == 2
    assert J.forward_passes(J.LONG_STEP_S + 0.1) == 1


def test_a_long_step_is_timed_once():
    asked = []

    def timed(seconds):
        return lambda i: asked.append(i) or seconds

    assert J.timed_steps(timed(0.5), 3) == [0.5] * 3 and asked == [1, 2, 3]
    asked.clear()
    assert J.timed_steps(timed(J.LONG_STEP_S + 0.1), 3) == [J.LONG_STEP_S + 0.1] and asked == [1]


def test_streamed_equivalence_metrics_match_whole_array_float64(monkeypatch):
    """The comparison streams float64 chunks (CHUNK_ELEMENTS); forced to many small chunks, with a partial last one,
    its metrics equal the whole-array float64 formulas they replaced."""
    from compare.harness import equivalence as E

    rng = np.random.default_rng(0)
    grad = rng.standard_normal(10_007).astype(np.float32)
    ref = (grad + 1e-4 * rng.standard_normal(grad.shape)).astype(np.float32)
    logits = rng.standard_normal((1, 37, 101)).astype(np.float32)
    ref_logits = (logits + 1e-3 * rng.standard_normal(logits.shape)).astype(np.float32)
    monkeypatch.setattr(E, "CHUNK_ELEMENTS", 1000)
    g, r = grad.astype(np.float64), ref.astype(np.float64)
    assert E._gradient_metrics(grad, ref) == pytest.approx(
        (np.abs(g - r).max(), np.abs(r).max(), np.linalg.norm(g), np.linalg.norm(r)), rel=1e-12)
    a, b = logits.astype(np.float64), ref_logits.astype(np.float64)
    logp_a, logp_b = E._log_softmax(a), E._log_softmax(b)
    kl = np.max(np.sum(np.exp(logp_b) * (logp_b - logp_a), axis=-1))
    assert E._logits_metrics(logits, ref_logits) == pytest.approx(
        (np.abs(a - b).max(), np.abs(a - b).mean(), np.abs(b).max(), np.abs(b).mean(), kl), rel=1e-9)


def test_communication_time_is_the_union_of_intervals():
    assert J.union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6)]) == pytest.approx(3.0)
    assert J.union_seconds([]) == 0.0
    assert all(J.is_collective_op(n) for n in ("all-gather.3", "collective-permute-start", "ppermute.1",
                                               "reduce-scatter", "all-reduce-done.2", "all_gather.7",
                                               "psum_scatter.2"))
    assert not any(J.is_collective_op(n) for n in ("end: all-gather", "ynn_fusion", "all-gathering"))


def test_communication_bytes_follow_the_shapes():
    config = PRESETS["llama3.2-1b"]
    one = step_comm_bytes(config, seq_len=4096, batch=1, mesh=MeshShape(sp=1), compute_bytes=2, train=True,
                          remat="off", parameter_gathers=2, gradient_bytes=4)
    assert one["total"] == 0  # nothing leaves a single device
    four = step_comm_bytes(config, seq_len=4096, batch=1, mesh=MeshShape(sp=4), compute_bytes=2, train=False,
                           remat="off", parameter_gathers=1, gradient_bytes=4)
    kv_per_layer = 2 * 1024 * config.num_kv_heads * config.head_dim * 2  # K and V of 1024 local tokens, bf16
    assert four["attention"] == 3 * kv_per_layer * config.num_layers
    assert four["parameters"] == pytest.approx(0.75 * config.num_params * 2)
    # training: the backward moves K, V and float32 dK, dV again; "full" checkpointing repeats the forward's K/V,
    # "save-attention" keeps the attention's output and so does not
    train = {mode: step_comm_bytes(config, seq_len=4096, batch=1, mesh=MeshShape(sp=4), compute_bytes=2,
                                   train=True, remat=mode, parameter_gathers=1, gradient_bytes=4)["attention"]
             for mode in ("off", "full", "save-attention")}
    # (the ring variant's dK/dV make P hops, home included; the allgather variant reduce-scatters P - 1 blocks)
    kv = 2 * 1024 * config.num_kv_heads * config.head_dim
    backward = (3 * 2 + 4 * 4) * kv * config.num_layers
    assert train["off"] == train["save-attention"] == four["attention"] + backward
    assert train["full"] == 2 * four["attention"] + backward
    allgather = step_comm_bytes(config, seq_len=4096, batch=1, mesh=MeshShape(sp=4), compute_bytes=2, train=True,
                                remat="off", parameter_gathers=1, gradient_bytes=4, ring_variant="allgather")
    assert allgather["attention"] == four["attention"] + 3 * (2 + 4) * kv * config.num_layers
    # torch's FSDP2 keeps a layer's gathered weights for its backward unless checkpointing recomputes the layer
    assert [weights_regathered_for_backward(mode) for mode in ("off", "full", "save-attention")] == [False, True, True]
    with pytest.raises(ValueError, match="remat must be one of"):
        weights_regathered_for_backward("on")
    with pytest.raises(ValueError, match="remat must be one of"):
        step_comm_bytes(config, seq_len=4096, batch=1, mesh=MeshShape(sp=4), compute_bytes=2, train=True,
                        remat="on", parameter_gathers=1, gradient_bytes=4)


def test_a_signal_after_the_report_is_written_says_the_report_is_there(tmp_path, monkeypatch, capsys):
    # SIGTERM while the run's bulk files are removed (after the report is written): the line must name the report
    # (it said "no report written": compare/results/compare-llama3.2-1b-2026-11-23-h200x2-512f5af/)
    import signal

    from compare.commands import compare as command
    from compare.launch import Interrupted

    def interrupted(work_dir):
        raise Interrupted(signal.SIGTERM)
    monkeypatch.setattr(command, "_remove_bulk", interrupted)
    out = tmp_path / "report"
    code = cli_main(["compare", "--no-bench", "--mode", "forward", "--seq-lens", "64", "--out", str(out)])
    assert code == 128 + signal.SIGTERM
    assert f"after its report was written: {out / 'report.md'}" in capsys.readouterr().err
    validate_report(json.loads((out / "report.json").read_text()))
