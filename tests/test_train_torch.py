"""`twinflash train --backend torch` on CPU: real gloo process groups started by the command itself (torchrun),
the tiny preset, byte-level stdlib text. Twin of tests/test_train_jax.py.

Each training run costs a process start per rank (seconds on a small machine), so every run is a module-scoped
fixture that several tests read, and the checks of bad input run in this process (the command refuses them
before starting anything). Runs: fsdp=2 x sp=2 (ring variant, "save-attention" activation checkpointing,
checkpoints, export), fsdp=1 x sp=4 (allgather variant, "full" activation checkpointing, small loss chunks), one
process, a stopped-and-resumed copy of the first, and a short bf16 run with the default (triton) kernel; the
others use the plain-math "reference" pair attention.

Tolerances:
  sharded vs one process, fp32: 1e-5 relative per step. The same float32 math summed in another order (per-rank
  partial losses and gradients, ring merges) moves a loss of ~5 by ~1e-6 per step; AdamW's division by sqrt(v)
  amplifies that somewhat over 20 steps, still far below 1e-5.
  stop + resume vs uninterrupted: exact (same ops on the same numbers; the checkpoint stores fp32 bit for bit).
  bf16 vs fp32: 3e-2 absolute on the first losses (~5): bf16 keeps 8 bits of mantissa, ~4e-3 relative per rounding.
  HF logits vs ours: 1e-4 absolute, the repository's bridge tolerance (same fp32 math, different kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from compare.commands.train import main
from torch_impl.checkpointing import completed_checkpoints
from torch_impl.kernels.flash_attention import flash_attention
from torch_impl.model import load_model, next_token_loss
from torch_impl.train import AdamW, ShardedNextTokenLoss, clip_grad_norm_
from weights import PRESETS, RandomWeights, write_converted_checkpoint
from weights.flops import matmul_parameters, model_flops_per_token
from weights.parallel import REMAT_MODES, MeshShape, checkpointed_layers
from weights.schedule import OptimizerConfig
from weights.settings import TrainSettings
from weights.training import adamw_coefficients, next_token_targets

LAUNCH_TIMEOUT_S = 300
STEPS = 20
COMMON = ["--backend", "torch", "--model", "tiny", "--seq-len", "64", "--steps", str(STEPS), "--batch", "2",
          "--attention-backend", "reference"]
SHARDED_RTOL = 1e-5  # module docstring
BF16_ATOL = 3e-2  # module docstring
HF_ATOL = 1e-4  # module docstring
SHARDED_ARGS = ("--mesh", "fsdp=2,sp=2", "--activation-checkpointing", "save-attention")


def _train(out, *extra) -> list[dict]:
    """Runs the command in a fresh interpreter (it starts torchrun itself); returns OUT/train.jsonl's records."""
    command = [sys.executable, "-m", "compare.commands.train", *COMMON, "--out", str(out), *map(str, extra)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> np.ndarray:
    return np.array([r["loss"] for r in records])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """fsdp=2 x sp=2, checkpoints every 10 steps (keep 1), final weights exported."""
    root = tmp_path_factory.mktemp("sharded")
    records = _train(root / "out", *SHARDED_ARGS, "--ckpt-dir", root / "ckpt", "--ckpt-every", 10, "--keep", 1,
                     "--export", root / "export")
    return root, records


@pytest.fixture(scope="module")
def sequence_parallel(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp4") / "out"
    return _train(out, "--mesh", "fsdp=1,sp=4", "--ring-variant", "allgather", "--activation-checkpointing",
                  "--loss-chunk-tokens", 24)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("single") / "out", "--mesh", "fsdp=1,sp=1")


@pytest.mark.slow
def test_sharded_runs_learn_on_real_text(sharded, sequence_parallel):
    for records in (sharded[1], sequence_parallel):
        assert [r["step"] for r in records] == list(range(STEPS))
        losses = _losses(records)
        assert np.all(np.isfinite(losses))
        assert losses[-5:].mean() < losses[:5].mean() - 0.5, losses
        for record in records:
            assert len(record["peak_memory_bytes"]) == 4 and min(record["peak_memory_bytes"]) > 0
            assert record["mfu"] is None  # no GPU peak to compare with on CPU
            assert record["tokens_per_s"] > 0 and record["tflops_per_device"] > 0 and record["grad_norm"] > 0
        assert records[0]["lr"] == OptimizerConfig(lr=3e-3, total_steps=STEPS).learning_rate(0)


@pytest.mark.slow
def test_sharded_runs_match_a_single_process_run(sharded, sequence_parallel, single_process):
    reference = _losses(single_process)
    for records in (sharded[1], sequence_parallel):
        np.testing.assert_allclose(_losses(records), reference, rtol=SHARDED_RTOL, atol=0)
        np.testing.assert_allclose([r["grad_norm"] for r in records], [r["grad_norm"] for r in single_process],
                                   rtol=SHARDED_RTOL, atol=0)


@pytest.mark.slow
def test_stop_and_resume_reproduces_the_uninterrupted_run_bit_for_bit(sharded, tmp_path):
    root, uninterrupted = sharded
    assert [p.name for p in completed_checkpoints(root / "ckpt")] == ["step-00000020"]  # --keep 1
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = [*SHARDED_ARGS, "--ckpt-dir", ckpt, "--ckpt-every", 5, "--keep", 2]
    first = _train(out, *args, "--stop-at", 10)
    assert [r["step"] for r in first] == list(range(10))
    assert [p.name for p in completed_checkpoints(ckpt)] == ["step-00000005", "step-00000010"]
    # what a crash could leave behind: a save that never finished, and a step directory without its meta.json
    (ckpt / ".step-00000015.partial").mkdir()
    (ckpt / "step-00000015").mkdir()
    resumed = _train(out, *args, "--resume")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in uninterrupted], key
    assert [p.name for p in completed_checkpoints(ckpt)] == ["step-00000015", "step-00000020"]
    assert not (ckpt / ".step-00000015.partial").exists()


@pytest.mark.slow
def test_exported_weights_load_in_transformers_and_reproduce_our_logits(sharded):
    from transformers import LlamaForCausalLM

    export = sharded[0] / "export"
    ours = load_model(export / "converted")
    initial = load_model("tiny")
    assert not torch.equal(ours.layers[0].attention.wq.weight, initial.layers[0].attention.wq.weight)  # trained
    hf = LlamaForCausalLM.from_pretrained(export / "hf", attn_implementation="eager", dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 48)))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=HF_ATOL, rtol=0)


@pytest.mark.slow
def test_bf16_run_with_the_default_kernel_tracks_fp32(sharded, tmp_path):
    """The triton kernels (Triton's interpreter on CPU: seconds per step, hence only 3 steps) in bf16."""
    bf16 = _train(tmp_path / "out", "--mesh", "fsdp=2,sp=2", "--dtype", "bf16", "--attention-backend", "triton",
                  "--stop-at", 3)
    np.testing.assert_allclose(_losses(bf16), _losses(sharded[1])[:3], atol=BF16_ATOL, rtol=0)


# --- bad input: refused before any process starts -----------------------------------------------------------------

def _snapshot(*paths) -> dict:
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for root in paths if root.exists()
            for p in [root, *root.rglob("*")]}


def _bad(capsys, argv, *fragments) -> None:
    assert main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinflash: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.slow
def test_bad_input_exits_2_with_one_line_and_writes_nothing(sharded, capsys, tmp_path, monkeypatch):
    root = sharded[0]
    ckpt, out, export = root / "ckpt", root / "out", root / "export"
    before = _snapshot(ckpt, out, export)
    base = COMMON + ["--mesh", "fsdp=2,sp=2"]
    resume = base + ["--ckpt-dir", ckpt, "--resume", "--out", tmp_path / "out"]

    _bad(capsys, COMMON + ["--mesh", "fsdp=2,sp=2", "--ckpt-dir", ckpt], "holds checkpoints", "--resume")
    _bad(capsys, base + ["--out", out], "train.jsonl exists")
    _bad(capsys, base + ["--export", export], "exists and is not empty")
    _bad(capsys, COMMON + ["--mesh", "fsdp=1,sp=4", "--ckpt-dir", ckpt, "--resume"], "another mesh", "sp 2 -> 4")
    _bad(capsys, [*resume, "--seq-len", 128], "another data stream", "seq_len 64 -> 128")
    other = tmp_path / "one-layer"
    config = dataclasses.replace(PRESETS["tiny"], num_layers=1)
    write_converted_checkpoint(dict(RandomWeights(config)), config, other)
    _bad(capsys, [*resume, "--model", other], "another model config", "num_layers 2 -> 1")

    _bad(capsys, base + ["--seq-len", 62], "sequence length 62", "multiple of 4")
    _bad(capsys, base + ["--batch", 3], "batch size 3", "fsdp=2")
    _bad(capsys, base + ["--resume"], "--resume needs --ckpt-dir")
    _bad(capsys, base + ["--stop-at", STEPS + 1], "--stop-at")
    _bad(capsys, COMMON + ["--mesh", "fsdp=0"], "bad mesh")
    _bad(capsys, base + ["--attention-backend", "pallas"], "--attention-backend")
    _bad(capsys, base + ["--checkpointed-layers", 1], "--checkpointed-layers needs")
    _bad(capsys, [*base, "--activation-checkpointing", "full", "--checkpointed-layers", 3], "within 0..2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # as under torchrun with 2 processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    _bad(capsys, base, "needs 4 devices", "2 are available")
    assert _snapshot(ckpt, out, export) == before
    assert not (tmp_path / "out").exists()


# --- pieces, in this process --------------------------------------------------------------------------------------

def test_adamw_matches_torch_adamw_and_clipping_matches_torch():
    torch.manual_seed(0)
    shapes = {"matrix": (6, 5), "vector": (5,)}
    ours = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
    theirs = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ours.items()}
    config = OptimizerConfig(lr=1e-2, warmup_steps=2, total_steps=6, grad_clip_norm=0.5)
    optimizer = AdamW(ours, config)
    reference = torch.optim.AdamW([{"params": [theirs["matrix"]], "weight_decay": config.weight_decay},
                                   {"params": [theirs["vector"]], "weight_decay": 0.0}],
                                  lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, foreach=False)
    for step in range(6):
        grads = {n: torch.randn(s) * 3 for n, s in shapes.items()}
        for n in shapes:
            ours[n].grad, theirs[n].grad = grads[n].clone(), grads[n].clone()
        norm = clip_grad_norm_(list(ours.values()), config.grad_clip_norm)
        torch_norm = torch.nn.utils.clip_grad_norm_(list(theirs.values()), config.grad_clip_norm)
        # same norm up to float32 summation order (sum of squares vs norm of per-tensor norms)
        assert norm == pytest.approx(float(torch_norm), rel=1e-6)
        for group in reference.param_groups:
            group["lr"] = config.learning_rate(step)
        optimizer.step(adamw_coefficients(config, step), step)
        reference.step()
        for n in shapes:
            torch.testing.assert_close(ours[n].data, theirs[n].data, rtol=1e-6, atol=1e-7)


def test_chunked_sharded_loss_equals_the_model_loss_and_its_gradient():
    llama = load_model("tiny")
    tokens = np.random.default_rng(1).integers(0, 256, (2, 24))
    valid = tokens.shape[0] * (tokens.shape[1] - 1)
    chunked = ShardedNextTokenLoss(llama, chunk_tokens=7)(
        torch.from_numpy(tokens), torch.arange(24), torch.from_numpy(next_token_targets(tokens)), valid)
    chunked.backward()
    chunked_grad = llama.output.weight.grad.clone()
    llama.zero_grad()
    plain = next_token_loss(llama(torch.from_numpy(tokens)), torch.from_numpy(tokens))
    plain.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)  # summation order only
    torch.testing.assert_close(chunked_grad, llama.output.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_loss_equals_the_recomputing_loss_and_its_gradients(dtype):
    """The GPU step's loss (`fused=True`: each chunk's gradients made in the forward, no logits recomputed) against
    the matched-numerics one, every parameter's gradient included; chunks of 7 rows leave a short last chunk, and
    ignored targets (the last position of each sequence) must get no gradient."""
    tokens = np.random.default_rng(3).integers(0, 256, (2, 24))
    targets = torch.from_numpy(next_token_targets(tokens))
    assert (targets == -100).any()  # ignored positions are part of the check
    grads, losses = [], []
    for fused in (False, True):
        llama = load_model("tiny", dtype=dtype)
        loss = ShardedNextTokenLoss(llama, chunk_tokens=7, fused=fused)(
            torch.from_numpy(tokens), torch.arange(24), targets, 46)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.float() for n, p in llama.named_parameters()})
    assert losses[1].dtype == torch.float32
    # float32: summation order only; bf16: the same bf16 matmuls, the loss gradient rounded to bf16 at another
    # point and the chunks' head gradients summed in another order: a few bf16 steps (2^-8) of the largest entry
    loss_tol, grad_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-3, 0.05)
    torch.testing.assert_close(losses[1], losses[0], rtol=loss_tol, atol=0)
    for name, reference in grads[0].items():
        assert reference.abs().max() > 0, name  # negative control: a gradient that is all zero would prove nothing
        scale = reference.abs().max()
        torch.testing.assert_close(grads[1][name] / scale, reference / scale, rtol=0, atol=grad_tol, msg=name)


def test_remat_changes_nothing_numerically_and_save_attention_does_not_rerun_the_attention(monkeypatch):
    """Forward attention calls counted where the pair kernels are dispatched (the "reference" kernel: plain math
    behind the same autograd Function as the Triton one): "full" reruns each layer's in the backward (the negative
    control), "save-attention" does not, "full" on one of the two layers (`--checkpointed-layers 1`) reruns one;
    the gradients are the same in every case, bit for bit (the same fp32 operations on CPU, recomputed or not)."""
    flash_module = sys.modules["torch_impl.kernels.flash_attention"]
    launches, dispatch = [], flash_module._forward
    monkeypatch.setattr(flash_module, "_forward", lambda *args: launches.append(1) or dispatch(*args))
    tokens = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (1, 16)))
    layers = PRESETS["tiny"].num_layers
    grads, counts = {}, {}
    for remat, count in [(mode, None) for mode in REMAT_MODES] + [("full", 1)]:
        llama = load_model("tiny", attention_fn=functools.partial(flash_attention, backend="reference"))
        llama.remat, llama.checkpointed = remat, checkpointed_layers(remat, layers, count)
        launches.clear()
        next_token_loss(llama(tokens), tokens).backward()
        grads[remat, count], counts[remat, count] = {n: p.grad for n, p in llama.named_parameters()}, len(launches)
    assert counts == {("off", None): layers, ("full", None): 2 * layers, ("save-attention", None): layers,
                      ("full", 1): layers + 1}
    for case in grads:
        for name, grad in grads["off", None].items():
            torch.testing.assert_close(grads[case][name], grad, rtol=0, atol=0, msg=f"{case}: {name}")


def test_settings_round_trip_and_flops_formula(tmp_path):
    settings = TrainSettings(backend="torch", model="tiny", seq_len=64, steps=3, mesh=MeshShape(2, 2), batch=2,
                             optimizer=OptimizerConfig(lr=1e-3), ckpt_dir=tmp_path, export_dir=tmp_path / "x")
    assert TrainSettings.from_json(settings.to_json()) == settings
    assert settings.export_paths == (tmp_path / "x" / "converted", tmp_path / "x" / "hf")
    config = PRESETS["llama3.1-8b"]  # untied: the input embedding table does no matmul
    assert matmul_parameters(config) == config.num_params - 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 1000 ** 2 / 2  # 12 * layers * heads * head_dim * S^2 / 2: causal fwd + bwd
    assert model_flops_per_token(config, 1000) * 1000 == pytest.approx(6 * matmul_parameters(config) * 1000
                                                                        + attention, rel=1e-12)
    tied = PRESETS["llama3.2-1b"]
    assert matmul_parameters(tied) == tied.num_params
