"""The plan of `twinflash compare` (compare/harness/plan.py), without running a job: the default sweep that fits
the machine (1, 2, 4 and 8 reported GPUs; the CPU default), the points skipped up front for memory, the weights
made once per run and read by every job, one launch per backend and device count (the bf16 noise floor's curve
jobs inside them, beside the points of their shape), and the exposed-communication
arithmetic (never more than the communication, nor than the step)."""

from __future__ import annotations

import dataclasses

import pytest

from compare.cli import build_parser
from compare.harness import jobs as J
from compare.harness import plan as P
from weights import open_weights
from weights.checkpoint import ConvertedCheckpoint, RandomWeights

H200_BYTES = 150_000_000_000  # 139.7 GiB, as torch reports an H200


def _settings(argv: list[str], gpus: int, memory: int | None = H200_BYTES) -> P.CompareSettings:
    args = build_parser().parse_args(["compare", *argv])
    return P.plan_settings(args, gpus, memory)


@pytest.mark.parametrize("gpus, counts, lengths", [
    (1, (1,), (8192, 32768)),  # 128k of the 1B shape needs ~230 GiB on one GPU: not in the default sweep
    (2, (1, 2), (8192, 32768, 131072)),
    (4, (1, 2, 4), (8192, 32768, 131072)),
    (8, (1, 2, 4, 8), (8192, 32768, 131072)),
])
def test_the_default_sweep_fits_the_machine(gpus, counts, lengths):
    settings = _settings(["--model", "llama3.2-1b"], gpus)
    assert settings.device_counts == counts and settings.devices == gpus
    assert settings.seq_lens == lengths
    assert settings.platform == "gpu" and settings.dtype == "bf16"


def test_points_beyond_the_device_are_skipped_up_front_with_their_reason(tmp_path):
    # the preset's name as the weights: planning reads its config only (no 5 GB of weights made)
    settings = dataclasses.replace(_settings(["--model", "llama3.2-1b", "--backends", "torch"], 2),
                                   weights="llama3.2-1b")
    jobs = {j.id: j for j in P.plan_jobs(settings, settings.weights, tmp_path)}
    skipped = {job_id for job_id, job in jobs.items() if job.skip}
    # plain attention keeps heads x S/2 x S scores per layer: beyond 8k on 2 GPUs it cannot fit
    assert skipped == {"torch-s131072-d1-ours", "torch-s32768-d2-reference", "torch-s131072-d2-reference"}
    assert "GiB per device" in jobs["torch-s131072-d1-ours"].skip
    assert not jobs["torch-s131072-d2-ours"].skip and not jobs["torch-s8192-d2-reference"].skip


def test_the_memory_estimate_tracks_measured_peaks():
    config = open_weights("llama3.2-1b").config
    measured = {32768: 21.03, 131072: 62.46}  # GiB, torch, 4 H200s (compare/results/compare-llama3.2-1b-...)
    for seq_len, gib in measured.items():
        estimate = P.estimated_peak_bytes(config, seq_len=seq_len, devices=4, attention="ours", dtype="bf16",
                                          mode="train", remat="off") / 2**30
        assert abs(estimate / gib - 1) < 0.1  # a decision aid: within 10 % of what was measured


def test_the_cpu_default_is_the_embedded_run():
    settings = _settings([], 0, None)
    assert (settings.devices, settings.device_counts, settings.seq_lens) == (4, (1, 4), (128,))
    assert settings.platform == "cpu" and settings.device_memory_bytes is None
    # on CPU one device and all of them: the points are no benchmark, every code path runs at those two counts
    assert [_settings(["--devices", str(n)], 0, None).device_counts for n in (1, 2, 8)] == [(1,), (1, 2), (1, 8)]


def test_weights_are_made_once_per_run_and_every_job_reads_them(tmp_path, monkeypatch):
    drawn = []
    original = RandomWeights.tensor
    monkeypatch.setattr(RandomWeights, "tensor", lambda self, name: drawn.append(name) or original(self, name))
    settings = _settings([], 0, None)
    first = P.prepare_weights(settings, tmp_path)
    generated = len(drawn)
    assert generated == len(open_weights("tiny").names())
    second = P.prepare_weights(settings, tmp_path)  # a second job's view of the run: nothing generated again
    assert len(drawn) == generated and second.weights == first.weights
    jobs = P.plan_jobs(first, P.check_model(first, tmp_path), tmp_path)
    assert all(isinstance(open_weights(job.model), ConvertedCheckpoint) for job in jobs)
    assert {job.model for job in jobs} == {first.weights}
    assert len(drawn) == generated  # planning and opening read the shared files


def test_one_launch_per_backend_and_device_count(tmp_path):
    settings = P.CompareSettings(model="tiny", mode="train", seq_lens=(128, 256), device_counts=(1, 2, 4), devices=4,
                                 steps=2, dtype="fp32", backends=("torch", "jax"),
                                 attention_ablation=("ours", "vendor", "reference"), activation_checkpointing="off",
                                 check_seq_len=128, check_layers=2, bench=True, platform="cpu", weights="tiny")
    launches = P.group_launches(P.plan_jobs(settings, "tiny", tmp_path))
    keys = [(backend, devices) for backend, devices, _ in launches]
    assert sorted(keys) == sorted({(b, d) for b in ("torch", "jax") for d in (1, 2, 4)})
    assert len(keys) == len(set(keys))
    for backend, devices, group in launches:
        assert all(job.backend == backend and job.devices == devices for job in group)
        kinds = [job.kind for job in group]
        assert kinds == sorted(kinds, key=lambda kind: kind != "equivalence")  # equivalence first
        attention = [job.attention for job in group if job.kind == "bench"]
        assert "reference" not in attention or attention.index("reference") == len(attention) - attention.count(
            "reference")  # the plain reference last
    reference = next(g for b, d, g in launches if (b, d) == ("torch", 1))
    assert reference[0].id == "reference-equivalence"


def test_the_noise_floor_runs_in_the_launches_beside_the_points_of_their_shape(tmp_path):
    """The bare 2-GPU compare: the four bf16 trainings join the 2-device launches (no process, weights or compile
    of their own), each right after the benchmark point of its length and kernel."""
    from compare.harness import noise_floor as N

    args = build_parser().parse_args(["compare", "--model", "llama3.2-1b"])
    settings = dataclasses.replace(P.plan_settings(args, 2, H200_BYTES), weights="llama3.2-1b")
    jobs = P.plan_jobs(settings, settings.weights, tmp_path)
    curves = N.plan_jobs(N.plan(args, settings), settings, settings.weights)
    launches = P.group_launches(jobs + curves)
    assert [(b, d) for b, d, _ in launches] == [(b, d) for b, d, _ in P.group_launches(jobs)]  # no launch more
    for backend, devices, group in launches:
        ids = [job.id for job in group]
        for attention in ("ours", "vendor"):
            if devices == 2:
                after = ids[ids.index(f"{backend}-s8192-d2-{attention}") + 1]
                assert after == f"noise-floor-{backend}-{attention}"
        assert all(job.kind != "curve" for job in group) or devices == 2


def test_exposed_communication_is_the_part_no_compute_hides():
    comm = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    compute = [(0.5, 1.5), (2.5, 5.5)]
    # comm union [0, 3) + [5, 6) = 4 s; hidden: [0.5, 1.5) + [2.5, 3) + [5, 5.5) = 2 s
    assert J.exposed_seconds(comm, compute) == pytest.approx(2.0)
    assert J.exposed_seconds(comm, []) == pytest.approx(J.union_seconds(comm))
    assert J.exposed_seconds(comm, [(-1.0, 10.0)]) == pytest.approx(0.0)
    assert J.exposed_seconds([], compute) == 0.0


def test_the_live_view_has_a_line_per_started_job_with_an_estimate(tmp_path):
    import io

    from rich.console import Console

    from compare.harness.progress import RunProgress

    jobs = [J.Job(id=f"torch-s64-d1-{name}", kind="bench", backend="torch", model="tiny", seq_len=64, devices=1,
                  attention=name, attention_backend=name, dtype="fp32", mode="train", steps=4)
            for name in ("ours", "reference")]
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    view = RunProgress(jobs, tmp_path, console)
    with view.shown():
        J.mark_progress(tmp_path, jobs[0], 2, J.bench_units(4), "step 1/4")
        view._poll()
        J.mark_progress(tmp_path, jobs[0], 4, J.bench_units(4), "step 3/4")
        view._poll()
        line = view.lines[jobs[0].id]
        assert jobs[1].id not in view.lines  # not started: no line yet
        assert line.left({"done": 4, "total": 9}) is not None  # an estimate once timed units went by
        view.done(jobs[0], {"status": "ok", "step_s": 0.5, "setup": {"launch_s": 1.0, "weights_s": 0.5,
                                                                     "compile_s": None, "measured_s": 2.0}})
    shown = console.file.getvalue()
    assert jobs[0].id in shown and "1/2 jobs" in shown and "ok, step 0.5 s" in shown
