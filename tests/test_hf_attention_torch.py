"""Hugging Face transformers' LlamaForCausalLM with our attention registered (`torch_impl.hf_attention`) against
the same model with HF's own "sdpa": logits, loss and every parameter's gradient, on one device ("twin_attention")
and on rings of 4 and 1 gloo ranks ("twin_ring", the batch sharded and the loss taken on the shards), with our
Triton kernels in the interpreter in float32 (the interpreter computes bf16 tl.dot wrong). The refusals (padding,
4-D masks, caches, packed positions, an unregistered mask, an unsupported transformers), on one rank and when only
one rank of a ring has the bad input (every rank raises the same line, nothing hangs).

Tolerance, `assert_close`: max |ours - sdpa| <= 1e-5 x max |sdpa| per tensor. Both sides run float32 math and
differ in summation order only (block-wise softmax merged by log-sum-exp against one softmax; gradients summed per
block, per ring step and over ranks against one matmul): a few float32 ulps of the largest value, observed <= 2e-6
relative. Dropping the causal mask moves the logits by > 1e-2 relative (`test_the_tolerance_sees_a_dropped_causal_
mask` measures it), so the check can fail.

The pinned range's ends (`pyproject.toml`'s `hf` extra): CI's environment holds its upper side (5.24); its lower end
was run by installing transformers 4.53.3 with the dependencies it pins into a folder put first on PYTHONPATH
(`pip install --no-deps --target DIR transformers==4.53.3 'tokenizers<0.22' 'huggingface-hub<1.0' requests`
and requests' own dependencies), and every test here passed there too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import transformers

from distributed import run_on_ranks
from hf_fixtures import make_ring_hf_checkpoint
from compare.harness import hf_rows
from torch_impl import hf_attention

ROOT = Path(__file__).resolve().parent.parent
BATCH, SEQ = 2, 64  # 64: zigzag over 4 ranks gives chunks of 8 tokens, each rank 16
RELATIVE_TOL = 1e-5  # module docstring


def tokens(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(1))


def load(hf_dir, implementation: str) -> transformers.LlamaForCausalLM:
    return transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation=implementation)  # float32


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def sdpa_reference(hf_dir, ids: torch.Tensor) -> dict:
    """HF's own full-sequence run: logits, mean next-token loss, gradients."""
    model = load(hf_dir, "sdpa")
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {"logits": _numpy(out.logits), "loss": out.loss.item(),
            "grads": {name: _numpy(p.grad) for name, p in model.named_parameters()}}


def assert_close(got: dict, expected: dict) -> None:
    pairs = [("logits", got["logits"], expected["logits"]), ("loss", got["loss"], expected["loss"])]
    pairs += [(f"grad {name}", got["grads"][name], grad) for name, grad in expected["grads"].items()]
    for name, ours, theirs in pairs:
        error, scale = np.max(np.abs(np.subtract(ours, theirs))), np.max(np.abs(theirs))
        assert error <= RELATIVE_TOL * scale, f"{name}: max error {error:.3g} against max |sdpa| {scale:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# One device, in this process
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-hf")
    make_ring_hf_checkpoint(directory)
    return directory


@pytest.fixture(scope="module")
def reference(hf_dir):
    return sdpa_reference(hf_dir, tokens())


def run_ours(model, ring: hf_attention.HFRing, ids: torch.Tensor) -> dict:
    out = model(**ring.shard(ids, labels=ids))
    out.loss.backward()
    ring.sum_gradients(model)
    return {"logits": _numpy(ring.gather_logits(out.logits)), "loss": ring.full_loss(out.loss).item(),
            "grads": {name: _numpy(p.grad) for name, p in model.named_parameters()}}


def test_one_device_matches_sdpa(hf_dir, reference):
    ring = hf_attention.register()
    assert_close(run_ours(load(hf_dir, hf_attention.ONE_DEVICE), ring, tokens()), reference)


def test_the_tolerance_sees_a_dropped_causal_mask(hf_dir, reference):
    """The negative control of the tolerance: HF's sdpa with a 4-D all-ones mask (every token sees every token)
    is far outside it."""
    ids = tokens()
    everything = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    logits = _numpy(load(hf_dir, "sdpa")(input_ids=ids, attention_mask=everything).logits)
    error, scale = np.max(np.abs(logits - reference["logits"])), np.max(np.abs(reference["logits"]))
    assert error > 1e-2 * scale


def test_negative_control_attention_without_its_mask_fails(hf_dir):
    """Registered with AttentionInterface alone, transformers hands the attention no mask at all (padding and
    causality dropped silently for implementations that read the mask): ours refuses instead of computing."""
    hf_attention.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = "twin_attention_without_mask"
    AttentionInterface.register(name, hf_attention.attention_function())
    assert name not in ALL_MASK_ATTENTION_FUNCTIONS
    ids = tokens()
    with pytest.raises(ValueError, match="got no mask from twinflash's mask function: register it with "
                                         "transformers' AttentionMaskInterface"):
        load(hf_dir, name)(input_ids=ids, labels=ids)
    AttentionMaskInterface.register(name, hf_attention.twinflash_mask)  # the same name, now with its mask: runs
    assert np.isfinite(load(hf_dir, name)(input_ids=ids, labels=ids).loss.item())


@pytest.mark.parametrize("call, message", [
    (lambda ids: dict(input_ids=ids, attention_mask=torch.ones_like(ids).index_fill(1, torch.tensor([0]), 0)),
     "twin_attention: padding masks are not supported"),
    (lambda ids: dict(input_ids=ids, attention_mask=torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool)),
     "twin_attention: a prepared attention mask (Tensor) is not supported"),
    (lambda ids: dict(input_ids=ids, position_ids=torch.arange(SEQ).remainder(SEQ // 2).expand(BATCH, -1)),
     "twin_attention: position_ids are not this rank's positions in the layout"),
])
def test_one_device_refusals(hf_dir, call, message):
    hf_attention.register()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(hf_dir, hf_attention.ONE_DEVICE)(**call(tokens()))


def test_generation_with_a_cache_is_refused(hf_dir):
    hf_attention.register()
    model = load(hf_dir, hf_attention.ONE_DEVICE).eval()
    with pytest.raises(ValueError, match="a KV cache holding earlier tokens is not supported"):
        model.generate(tokens(1, 8), max_new_tokens=2, do_sample=False)


def test_an_all_ones_padding_mask_is_no_padding(hf_dir, reference):
    hf_attention.register()
    ids = tokens()
    logits = load(hf_dir, hf_attention.ONE_DEVICE)(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert_close({"logits": _numpy(logits), "loss": 0.0, "grads": {}},
                 {"logits": reference["logits"], "loss": 0.0, "grads": {}})


def test_unsupported_transformers_versions_are_refused_in_one_line():
    for version in ("4.52.4", "6.0.0", "3.5"):
        with pytest.raises(ValueError, match=rf"^transformers {version} is installed; torch_impl.hf_attention needs "
                                             r"transformers>=4\.53,<6 .*pip install 'twinflash\[hf\]'$"):
            hf_attention.check_transformers_version(version)
    for version in ("4.53.0", "5.17.0", transformers.__version__):
        hf_attention.check_transformers_version(version)


def test_the_hf_extra_pins_the_range_the_module_supports():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["hf"] == [f"transformers{hf_attention.TRANSFORMERS_RANGE}"]


def test_shard_shifts_labels_before_sharding(monkeypatch):
    """As rank 0 of 2 (zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 of 8 tokens), rank 0's last token of
    chunk 0 predicts the first token of chunk 1, which rank 1 holds."""
    monkeypatch.setattr(hf_attention.HFRing, "rank_and_world", lambda self: (0, 2))
    ids = torch.arange(100, 108).unsqueeze(0)
    rank0 = dict(zip(("input_ids", "labels", "position_ids"), ([100, 101, 106, 107], [101, 102, 107, -100],
                                                             [0, 1, 6, 7])))
    batch = hf_attention.HFRing(None, "zigzag", "ring", "reference").shard(ids, labels=ids)
    assert {key: batch[key][0].tolist() for key in rank0} == rank0
    assert batch["num_items_in_batch"].item() == 7 and batch["use_cache"] is False


# ---------------------------------------------------------------------------------------------------------------
# Rings of gloo ranks: one launch of 4 processes
# ---------------------------------------------------------------------------------------------------------------

def case_ring(rank, world, *, hf_dir, layout="zigzag", variant="ring", backend="triton", ring_size=None):
    """Our ring on `ring_size` ranks (default all; 1: every rank a ring of its own, over gloo) against nothing:
    the results, for the parent to compare with sdpa."""
    group = None if ring_size is None else dist.new_subgroups(ring_size)[0]
    ring = hf_attention.register(group=group, layout=layout, variant=variant, backend=backend)
    return run_ours(load(hf_dir, hf_attention.RING), ring, tokens())


def case_bad_input_on_one_rank(rank, world, *, hf_dir, odd_rank, bad):
    """`bad` input on `odd_rank` only: the line each rank raised, and whether a good call runs afterwards."""
    ring = hf_attention.register()
    model = load(hf_dir, hf_attention.RING)
    batch = ring.shard(tokens(), labels=tokens())
    if rank == odd_rank and bad == "positions":
        batch["position_ids"] = batch["position_ids"] + 1
    if rank == odd_rank and bad == "padding":
        batch["attention_mask"] = torch.ones_like(batch["input_ids"]).index_fill(1, torch.tensor([3]), 0)
    raised = None
    try:
        model(**batch)
    except ValueError as err:
        raised = str(err)
    batch = ring.shard(tokens(), labels=tokens())
    return {"raised": raised, "recovered": bool(np.isfinite(model(**batch).loss.item()))}


def case_mask_not_registered(rank, world, *, hf_dir):
    from transformers import AttentionInterface

    ring = hf_attention.register()
    AttentionInterface.register("twin_ring_without_mask", hf_attention.attention_function(ring))
    try:
        load(hf_dir, "twin_ring_without_mask")(**ring.shard(tokens(), labels=tokens()))
    except ValueError as err:
        return {"raised": str(err)}
    return {"raised": None}


@pytest.fixture(scope="module")
def p4(hf_dir):
    cases = {
        "zigzag-ring": ("case_ring", dict(hf_dir=str(hf_dir))),
        "contiguous-allgather": ("case_ring", dict(hf_dir=str(hf_dir), layout="contiguous", variant="allgather")),
        "one-rank": ("case_ring", dict(hf_dir=str(hf_dir), ring_size=1)),
        "positions-on-rank-2": ("case_bad_input_on_one_rank", dict(hf_dir=str(hf_dir), odd_rank=2, bad="positions")),
        "padding-on-rank-1": ("case_bad_input_on_one_rank", dict(hf_dir=str(hf_dir), odd_rank=1, bad="padding")),
        "mask-not-registered": ("case_mask_not_registered", dict(hf_dir=str(hf_dir))),
    }
    return run_on_ranks(4, cases, module=__name__)


def _results(per_rank, name):
    for rank, results in enumerate(per_rank):
        assert "error" not in results[name], f"rank {rank}: {results[name]['error']}"
    return [results[name] for results in per_rank]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zigzag-ring", "contiguous-allgather", "one-rank"])
def test_ring_matches_sdpa(p4, reference, name):
    """Every rank ends with the full logits, the full-sequence loss and the full gradients: each must be sdpa's."""
    for results in _results(p4, name):
        assert_close(results, reference)


@pytest.mark.slow
@pytest.mark.parametrize("name, line", [
    ("positions-on-rank-2", "twin_ring: position_ids are not this rank's positions in the layout: shard the batch "
                            "with HFRing.shard (packed documents, whose positions restart, are not supported) "
                            "(rank 2 of 4)"),
    ("padding-on-rank-1", "twin_ring: padding masks are not supported (the attention_mask has a zero): pass full "
                          "sequences without padding (rank 1 of 4)"),
])
def test_bad_input_on_one_rank_is_refused_by_every_rank(p4, name, line):
    assert _results(p4, name) == [{"raised": line, "recovered": True}] * 4


@pytest.mark.slow
def test_negative_control_ring_without_its_mask_fails_on_every_rank(p4):
    for results in _results(p4, "mask-not-registered"):
        assert results["raised"].startswith("twin_ring: got no mask from twinflash's mask function")


# ---------------------------------------------------------------------------------------------------------------
# The README's example, as written, under torchrun: 2 CPU processes over gloo
# ---------------------------------------------------------------------------------------------------------------

README = ROOT / "torch_impl" / "README.md"
EXAMPLE_SECTION = "## Hugging Face transformers (`hf_attention.py`)"


def readme_example() -> str:
    """The Python block of torch_impl/README.md's transformers section."""
    section = README.read_text(encoding="utf-8").split(EXAMPLE_SECTION, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_readme_example_runs_as_written(hf_dir, tmp_path):
    """Its three steps run on 2 ranks, and its first loss (the full sequence's, from the shares) is HF sdpa's."""
    script = tmp_path / "hf_ring.py"
    script.write_text(readme_example())
    seq_len = 64
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(hf_dir), str(seq_len)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = re.findall(r"^step (\d): loss (\S+)$", done.stdout, re.MULTILINE)
    assert [step for step, _ in losses] == ["0", "1", "2"], done.stdout
    torch.manual_seed(0)  # the example's first batch
    ids = torch.randint(97, (1, seq_len))
    expected = load(hf_dir, "sdpa")(input_ids=ids, labels=ids).loss.item()
    assert abs(float(losses[0][1]) - expected) <= RELATIVE_TOL * expected


# ---------------------------------------------------------------------------------------------------------------
# `twinflash bench hf` on CPU: HF's model with our ring beside our torch model, from an HF directory
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_hf_rows_agree_with_our_model(hf_dir, tmp_path):
    """Both rows on 2 gloo ranks from the same HF directory (converted for ours): the first step's full loss and
    gradient norm agree within the module's float32 tolerance, and the JSON holds the speeds."""
    out = tmp_path / "hf.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "compare.cli", "bench", "hf", "--model", str(hf_dir), "--seq-len",
                           "64", "--warmup", "1", "--steps", "1", "--out", str(out)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {row["kind"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"hf", "ours"} and rows["hf"]["tokens_per_s"] > 0
    assert rows["hf"]["loss_rel_diff_vs_ours"] <= RELATIVE_TOL
    assert rows["hf"]["grad_norm_rel_diff_vs_ours"] <= RELATIVE_TOL
    assert rows["hf"]["agrees"] and rows["hf"]["agreement_tolerance"] == hf_rows.AGREEMENT_TOLERANCE["fp32"]
    assert 1 < rows["ours"]["loss"] < 20  # random weights, ln(97) ~ 4.6: not a loss of zeros or NaN


@pytest.mark.parametrize("argv, line", [
    (["bench"], "`twinflash bench hf` (HF transformers' Llama with our ring beside our torch model"),
    (["bench", "hf", "--seq-len", "30"], "twinflash: error: sequence length 30 does not split into the zigzag layout "
                                         "over 2 devices: it must be a multiple of 4 (e.g. 28 or 32)"),
    (["bench", "hf", "--seq-len", "64,128"], "twinflash: error: --seq-len takes one length, got 2"),
])
def test_bench_hf_bad_input_is_one_line(capsys, argv, line):
    from compare.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and line in err, err


# ---------------------------------------------------------------------------------------------------------------
# GPUs: the Llama-3.2-1B shape, HF's model with our ring on 2 GPUs (NCCL, bf16) against HF's sdpa
# ---------------------------------------------------------------------------------------------------------------

GPU_SEQ = 4096


def _errors(got: dict, exact: dict) -> dict:
    """Max |logits error|, |loss error| and the largest relative L2 error of a parameter's gradient."""
    grads = max(float((got["grads"][n].float() - g).norm() / g.norm().clamp_min(1e-30))
                for n, g in exact["grads"].items())
    return {"logits": float((got["logits"].float() - exact["logits"]).abs().max()),
            "loss": abs(got["loss"] - exact["loss"]), "grads": grads}


def case_gpu_1b(rank, world, *, hf_dir, seq_len):
    """On each rank: HF sdpa in float32 (the exact answer), HF sdpa in bf16 and HF + twin_ring in bf16 on the ring
    of both GPUs; each bf16 run's errors against float32."""
    device = torch.device("cuda", rank)
    ids = torch.randint(0, 128256, (1, seq_len), generator=torch.Generator().manual_seed(2)).to(device)
    ring = hf_attention.register()

    def run(implementation, dtype):
        model = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation=implementation)
        model.to(device, dtype)
        batch = ring.shard(ids, labels=ids) if implementation == hf_attention.RING else {"input_ids": ids,
                                                                                       "labels": ids}
        out = model(**batch)
        out.loss.backward()
        if implementation == hf_attention.RING:
            ring.sum_gradients(model)
            logits, loss = ring.gather_logits(out.logits), ring.full_loss(out.loss).item()
        else:
            logits, loss = out.logits, out.loss.item()
        return {"logits": logits.detach().float(), "loss": loss,
                "grads": {n: p.grad.float() for n, p in model.named_parameters()}}

    exact = run("sdpa", torch.float32)
    return {"sdpa_bf16": _errors(run("sdpa", torch.bfloat16), exact),
            "ours_bf16": _errors(run(hf_attention.RING, torch.bfloat16), exact)}


@pytest.mark.gpu
def test_gpu_1b_ring_on_2_gpus_matches_sdpa_by_the_flash_rule(tmp_path):
    """Ours in bf16 within twice sdpa's own bf16 error (against float32 sdpa) plus a floor of a bf16 ulp's order:
    the rule of tests/ring_twins.py, here on the whole model (logits, loss, every gradient)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from weights import PRESETS

    config = transformers.LlamaConfig.from_dict(PRESETS["llama3.2-1b"].to_hf_dict("float32"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    per_rank = run_on_ranks(2, {"1b": ("case_gpu_1b", {"hf_dir": str(tmp_path), "seq_len": GPU_SEQ})},
                            module=__name__, comm_backend="nccl", timeout=900)
    floors = {"logits": 2e-2, "loss": 2e-3, "grads": 2e-2}
    for results in _results(per_rank, "1b"):
        for name, floor in floors.items():
            ours, sdpa = results["ours_bf16"][name], results["sdpa_bf16"][name]
            assert ours <= 2 * sdpa + floor, f"{name}: ours {ours:.3g}, sdpa bf16 {sdpa:.3g}"
