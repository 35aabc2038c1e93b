"""The fast path of `twinflash compare` and `twinflash check` (compare/harness/fastpath.py and its backends' halves)
and the attention perturbations of `--perturb` (compare/harness/perturb.py): the exact answer and the bf16 rounding
against torch's own, the rules on hand-made errors (each with a negative control), the step's per-parameter
distances from files, the perturbation wrappers of both backends on plain attention, the parsing and routing of
`--perturb`, `twinflash check`'s bad input; and (slow) the attention jobs of both backends run by the compare
workers on 4 emulated CPU devices with our interpreted kernels, clean and with each tensor perturbed, and `twinflash
check` end to end on a 2x2 mesh in both backends, clean and perturbed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from compare.cli import main as cli_main
from compare.harness import fastpath as F
from compare.harness import jobs as J
from compare.harness import perturb as P
from compare.harness.fastpath_torch import ScaledAttention
from compare.harness.launches import run_jobs
from compare.harness.plan import CompareSettings, fast_path_jobs
from weights import PRESETS, BadInputError, parameter_shapes


def _torch_exact(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Causal GQA attention and its gradients by torch autograd in float64 (K/V repeated per query head)."""
    q, k, v = (torch.tensor(inputs[n], dtype=torch.float64, requires_grad=True) for n in ("q", "k", "v"))
    group = q.shape[2] // k.shape[2]
    kk, vv = (x.repeat_interleave(group, dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    out = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~mask, -math.inf).softmax(-1), vv)
    out.backward(torch.tensor(inputs["dout"], dtype=torch.float64))
    return {"out": out.detach().numpy(), "dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy()}


def test_exact_attention_is_torch_autograd_in_float64_and_the_inputs_are_bf16_values():
    inputs = F.attention_inputs(2, 24, 6, 2, 8, seed=3)
    for name, array in inputs.items():  # bf16 values: a bf16 round trip changes nothing (torch rounds to even too)
        assert np.array_equal(torch.from_numpy(array).bfloat16().float().numpy(), array), name
    exact, expected = F.exact_attention(*(inputs[n] for n in ("q", "k", "v", "dout"))), _torch_exact(inputs)
    for name in F.TENSORS:
        np.testing.assert_allclose(exact[name], expected[name], rtol=1e-12, atol=1e-12)
    shifted = dict(inputs, k=np.roll(inputs["k"], 1, axis=1))  # negative control: a key block one position off
    assert np.abs(F.exact_attention(*(shifted[n] for n in ("q", "k", "v", "dout")))["out"]
                  - expected["out"]).max() > 0.1
    ties = np.array([1.00390625, 1.01171875, -3.3], np.float32)  # halfway cases round to even, like torch's cast
    assert np.array_equal(F.bf16_values(ties), torch.from_numpy(ties).bfloat16().float().numpy())


def _noisy(exact: dict[str, np.ndarray], scale: float, seed: int) -> dict[str, np.ndarray]:
    """`exact` with relative noise of `scale` per element, as bf16 rounding leaves it."""
    rng = np.random.default_rng(seed)
    return {n: (a * (1 + scale * rng.standard_normal(a.shape))).astype(np.float32) for n, a in exact.items()}


def test_the_rule_passes_honest_kernels_and_names_a_scaled_tensor():
    inputs = F.attention_inputs(1, 32, 4, 2, 16)
    exact = F.exact_attention(*(inputs[n] for n in ("q", "k", "v", "dout")))
    vendor = _noisy(exact, 2e-3, seed=1)
    honest = F.attention_comparison(_noisy(exact, 3e-3, seed=2), vendor, exact)
    assert all(c["passed"] for c in honest) and len(honest) == len(F.TENSORS) * (len(F.STATISTICS) + 1)
    broken = _noisy(exact, 3e-3, seed=2)
    broken["dq"] = broken["dq"] * 1.01  # what --perturb BACKEND:attention-dq=1.01 does
    failing = {(c["tensor"], c["statistic"]) for c in F.attention_comparison(broken, vendor, exact)
               if not c["passed"]}
    assert failing and {tensor for tensor, _ in failing} == {"dq"}
    assert ("dq", "norm_bias") in failing and ("dq", "relative") in failing
    # a broken yardstick (the vendor's, or the harness's reading of both: a batch scrambled alike) fails its ceiling
    scrambled = {name: array[:, ::-1] for name, array in exact.items()}
    failing = {(c["tensor"], c["statistic"]) for c in F.attention_comparison(scrambled, scrambled, exact)
               if not c["passed"]}
    assert failing == {(tensor, "vendor_relative") for tensor in F.TENSORS}


def test_the_step_compares_every_parameter_from_files_and_names_the_one_off(tmp_path):
    rng = np.random.default_rng(0)
    exact = {f"grad/p{i}": rng.standard_normal((64, 8)).astype(np.float32) for i in range(3)}

    def near(scale):
        return {k: (v * (1 + scale * rng.standard_normal(v.shape))).astype(np.float32) for k, v in exact.items()}

    ours = near(1e-2)
    ours["grad/p1"] = exact["grad/p1"] * 1.1  # 10 % off: 5x the vendor's distance
    for name, arrays in (("ref", exact), ("ours", ours), ("vendor", near(1e-2))):
        save_file(arrays, str(tmp_path / f"{name}.safetensors"))
    checks = F.step_comparison(*(tmp_path / f"{n}.safetensors" for n in ("ref", "ours", "vendor")))
    assert [c["name"] for c in checks] == ["p0", "p1", "p2"]
    assert [c["passed"] for c in checks] == [True, False, True]
    assert checks[1]["ours"] == pytest.approx(0.1, rel=1e-6) and checks[0]["vendor"] == pytest.approx(1e-2, rel=0.2)


def test_the_section_from_jobs_fails_with_the_job_that_did_not_run_and_fits_the_schema(tmp_path):
    """The section from files as the workers leave them: the attention's ours and vendor on one device, the bf16
    step's with the float32 step; the vendor's attention job errs, so its check fails naming it, while the step
    passes. The report with the section validates and renders it."""
    from test_compare_report import make_report

    from compare.report.render import render_markdown
    from compare.report.write import validate_report

    jobs = fast_path_jobs("torch", "cpu", "tiny", 32, (1,), 1)
    reference = J.Job(id="reference-equivalence", kind="equivalence", backend="torch", model="tiny", seq_len=32,
                      devices=1, attention="reference", attention_backend="reference", dtype="fp32",
                      mode="forward", steps=1)
    inputs = F.attention_inputs(1, 32, 4, 2, 32)
    exact = F.exact_attention(*(inputs[n] for n in ("q", "k", "v", "dout")))
    save_file(_noisy(exact, 2e-3, seed=1), str(tmp_path / "torch-fast-path-d1-ours.safetensors"))
    rng = np.random.default_rng(0)
    grads = {f"grad/{n}": rng.standard_normal(s).astype(np.float32) for n, s in parameter_shapes(PRESETS["tiny"]).items()}
    for job_id, scale in (("reference-equivalence", 0), ("torch-bf16-step-ours", 1e-2),
                          ("torch-bf16-step-reference", 1e-2)):
        save_file({k: (v * (1 + scale * rng.standard_normal(v.shape))).astype(np.float32) for k, v in grads.items()},
                  str(tmp_path / f"{job_id}.safetensors"))
    for job in [*jobs, reference]:
        failed = job.id == "torch-fast-path-d1-reference"
        J.write_result(tmp_path, job, {"status": "error", "message": "RuntimeError: boom"} if failed else
                       {"status": "ok"})
    section = F.fast_path_section(jobs, tmp_path, reference)
    (attention,), (step,) = section["attention"], section["steps"]
    assert not section["passed"] and not attention["passed"] and step["passed"]
    assert section["failures"] == ["torch attention on 1 device(s), ours (triton) vs reference (reference): "
                                   "torch-fast-path-d1-reference: error: RuntimeError: boom"]
    assert len(step["checks"]) == len(grads) and section["heads"] == 4 and section["batch"] == 1
    report = {**make_report(), "plots": []}
    report["equivalence"]["fast_path"] = section
    validate_report(report)
    text = render_markdown(report)
    assert "bf16 fast path: FAIL" in text and "RuntimeError: boom" in text
    assert "torch-fast-path-d1-reference: error" in text.split("## Setup")[0]  # in the verdict at the top


def _scaled_gradients(wrapper) -> dict[str, torch.Tensor]:
    """out and the gradients of plain attention wrapped by `wrapper` (None: unwrapped), float64."""
    from torch_impl.attention import reference_attention

    inputs = F.attention_inputs(1, 8, 2, 1, 4)
    q, k, v = (torch.tensor(inputs[n], dtype=torch.float64, requires_grad=True) for n in ("q", "k", "v"))
    fn = reference_attention if wrapper is None else wrapper(reference_attention)
    out = fn(q, k, v)
    out.backward(torch.tensor(inputs["dout"], dtype=torch.float64))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@pytest.mark.parametrize("tensor", P.ATTENTION_TENSORS)
def test_the_torch_wrapper_scales_its_tensor_alone(tensor):
    clean, scaled = _scaled_gradients(None), _scaled_gradients(ScaledAttention(tensor, 1.25))
    for name in F.TENSORS:
        torch.testing.assert_close(scaled[name], clean[name] * (1.25 if name == tensor else 1.0))


@pytest.mark.parametrize("tensor", P.ATTENTION_TENSORS)
def test_the_jax_wrapper_scales_its_tensor_alone(tensor):
    import jax

    from compare.harness.fastpath_jax import ScaledAttention as JaxScaledAttention
    from jax_impl.attention import reference_attention

    inputs = F.attention_inputs(1, 8, 2, 1, 4)

    def run(fn):
        out, backward = jax.vjp(fn, *(inputs[n] for n in ("q", "k", "v")))
        return dict(zip(F.TENSORS, (out, *backward(inputs["dout"]))))

    clean, scaled = run(reference_attention), run(JaxScaledAttention(tensor, 1.25)(reference_attention))
    for name in F.TENSORS:
        np.testing.assert_allclose(scaled[name], clean[name] * (1.25 if name == tensor else 1.0), rtol=1e-6)
    assert hash(JaxScaledAttention(tensor, 1.25)) == hash(JaxScaledAttention(tensor, 1.25))  # a jit cache key


def test_perturb_parsing_and_which_jobs_carry_it():
    params = parameter_shapes(PRESETS["tiny"])
    attention = P.parse("jax:attention-dq=1.01", ("torch", "jax"), params)
    assert (attention.backend, attention.target, attention.factor) == ("jax", "attention-dq", 1.01)
    assert P.parse("torch:attention-out", ("torch",), params).factor == 1.01  # the default factor
    carried = attention.for_job("jax", "attention", "ours", "bf16")
    assert P.attention_scaling(carried) == ("dq", 1.01) and P.weight_scaling(carried) is None
    # the bf16 jobs of our kernels that time nothing; never the vendor's, the float32 checks, the points, torch
    assert [attention.for_job(*job) is not None for job in (
        ("jax", "gradients", "ours", "bf16"), ("jax", "curve", "ours", "bf16"), ("jax", "attention", "vendor", "bf16"),
        ("jax", "equivalence", "ours", "fp32"), ("jax", "bench", "ours", "bf16"), ("torch", "attention", "ours",
                                                                                   "bf16"))] == [
        True, True, False, False, False, False]
    weight = P.parse("torch:norm.weight", ("torch", "jax"), params)
    assert weight.for_job("torch", "equivalence", "ours", "fp32") == "norm.weight"
    assert weight.for_job("torch", "curve", "reference", "bf16") == "norm.weight"  # both runs: a clean floor
    assert weight.for_job("torch", "gradients", "ours", "bf16") is None
    for bad in ("jax:attention-dz=1.01", "jax:attention-dq=0", "jax:attention-dq=x", "mx:attention-dq=1.01",
                "jax:no.such.weight"):
        with pytest.raises(BadInputError):
            P.parse(bad, ("torch", "jax"), params)


def test_the_plan_has_the_fast_path_per_backend_and_device_count_with_the_perturbation(tmp_path):
    settings = CompareSettings(model="tiny", mode="train", seq_lens=(128,), device_counts=(1, 4), devices=4, steps=2,
                               dtype="fp32", backends=("torch", "jax"), attention_ablation=("ours",),
                               activation_checkpointing="off", check_seq_len=128, check_layers=2, bench=False,
                               platform="cpu", weights="tiny",
                               perturb=P.Perturbation("jax", "attention-dk", 1.01))
    from compare.harness.plan import plan_jobs

    jobs = {j.id: j for j in plan_jobs(settings, "tiny", tmp_path) if j.kind in J.FAST_PATH_KINDS}
    assert sorted(jobs) == sorted(
        [f"{b}-fast-path-d{d}-{a}" for b in ("torch", "jax") for d in (1, 4) for a in ("ours", "reference")]
        + [f"{b}-bf16-step-{a}" for b in ("torch", "jax") for a in ("ours", "reference")])
    assert {j.id for j in jobs.values() if j.perturb} == {"jax-fast-path-d1-ours", "jax-fast-path-d4-ours",
                                                          "jax-bf16-step-ours"}
    assert all(j.dtype == "bf16" and j.seq_len == 128 and j.steps == 2 for j in jobs.values())
    gpu = fast_path_jobs("torch", "gpu", "tiny", 2048, (2,), 2)
    assert {j.attention_backend for j in gpu} == {"triton", "sdpa_cudnn"}  # the vendor's kernel on GPUs


@pytest.mark.parametrize("args, message", [
    (["--mesh", "fsdp=0"], "mesh"),
    (["--seq-len", "7"], "7"),
    (["--layers", "9"], "--layers"),
    (["--perturb", "torch:norm.weight"], "attention"),
    (["--perturb", "jax:attention-dq=1.01"], "--perturb"),  # another backend than the one checked
])
def test_check_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    out = tmp_path / "check"
    assert cli_main(["check", "--backend", "torch", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("twinflash: error:") and "\n" not in err and message in err
    assert not out.exists()


@pytest.mark.slow
def test_each_attention_perturbation_fails_its_tensor_in_both_backends(tmp_path):
    """The attention jobs as a compare run makes them (4 emulated devices, our interpreted kernels in bf16 and the
    reference as the vendor), clean and with each of out, dq, dk, dv scaled by 1 %: the clean ones pass, each
    perturbed one fails on its tensor alone."""
    settings = CompareSettings(model="tiny", mode="forward", seq_lens=(64,), device_counts=(4,), devices=4, steps=1,
                               dtype="fp32", backends=("torch", "jax"), attention_ablation=("ours",),
                               activation_checkpointing="off", check_seq_len=64, check_layers=2, bench=False,
                               platform="cpu")
    jobs = []
    for backend in ("torch", "jax"):
        clean = [j for j in fast_path_jobs(backend, "cpu", "tiny", 64, (4,), 4) if j.kind == "attention"]
        jobs += clean + [J.Job(**{**vars(clean[0]), "id": f"{clean[0].id}-{t}", "perturb": f"attention-{t}=1.01"})
                         for t in P.ATTENTION_TENSORS]
    run_jobs(jobs, settings, tmp_path, timeout_s=600, on_done=lambda job: None)
    assert all(J.read_result(tmp_path, j.id)["status"] == "ok" for j in jobs)
    inputs = F.attention_inputs(1, 64, 4, 2, 32)
    exact = F.exact_attention(*(inputs[n] for n in ("q", "k", "v", "dout")))

    def failing(ours_id: str, vendor_id: str) -> set[str]:
        from safetensors.numpy import load_file

        ours, vendor = (load_file(str(tmp_path / f"{i}.safetensors")) for i in (ours_id, vendor_id))
        return {c["tensor"] for c in F.attention_comparison(ours, vendor, exact) if not c["passed"]}

    for backend in ("torch", "jax"):
        ours, vendor = f"{backend}-fast-path-d4-ours", f"{backend}-fast-path-d4-reference"
        assert failing(ours, vendor) == set(), backend
        for tensor in P.ATTENTION_TENSORS:
            assert failing(f"{ours}-{tensor}", vendor) == {tensor}, (backend, tensor)


@pytest.mark.slow
@pytest.mark.parametrize("backend, tensor", [("torch", "dk"), ("jax", "dv")])
def test_check_on_a_2x2_mesh_passes_and_a_perturbed_tensor_fails_naming_it(tmp_path, capsys, backend, tensor):
    """`twinflash check --backend B --mesh fsdp=2,sp=2`: two sequences, each over a ring of two emulated devices;
    clean it passes (exit 0) at bf16's errors, with --perturb B:attention-T=1.01 it fails (exit 1) naming T."""
    import json

    mesh = ["--backend", backend, "--mesh", "fsdp=2,sp=2", "--seq-len", "64"]
    assert cli_main(["check", *mesh, "--out", str(tmp_path / "clean")]) == 0
    section = json.loads((tmp_path / "clean" / "check.json").read_text())
    assert section["passed"] and section["batch"] == 2 and section["attention"][0]["mesh"] == "fsdp=2,sp=2"
    # both against float64 at bf16's size (a harness that scrambled the batch rows failed only the ceiling)
    assert max(c["ours"] for c in section["attention"][0]["checks"] if c["statistic"] == "relative") < 5e-3
    assert max(c["ours"] for c in section["steps"][0]["checks"]) < 0.1  # the bf16 step is near the float32 one
    assert cli_main(["check", *mesh, "--perturb", f"{backend}:attention-{tensor}=1.01",
                     "--out", str(tmp_path / "broken")]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and f"{backend} attention on 4 device(s)" in out and f"{tensor} norm bias" in out
    failing = {c["tensor"] for c in json.loads((tmp_path / "broken" / "check.json").read_text())["attention"][0][
        "checks"] if not c["passed"]}
    assert failing == {tensor}
