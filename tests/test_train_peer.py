"""The live training peer (compare/harness/peer_rows.py) and `twinflash bench train-peer` (compare/bench/
train_peer.py): the peer's attention function computes our attention (CPU, through SDPA's math backend, with a negative
control); PyTorch's `context_parallel` shards the peer's tokens, targets and positions into exactly the parts our ring's
ranks hold (`local_batch`, the zigzag layout; 4 gloo processes); our torch and JAX rows are measured and agree (the
bench's path without GPUs, the peer aside); the command's bad input exits 2 with one line (no GPUs here), its table
prints ours / peer; the compare's section (its plan, rendering, schema, and a disagreement failing it: the negative
control); on 2 GPUs, the whole bench: PyTorch's context parallelism in our training step agrees with our ring on the
first step's loss and gradient norm, and so does our JAX step (the bench's own check, exit 1 when not)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from distributed import run_on_ranks
from torch.nn.attention import SDPBackend

from compare.bench.train_peer import main, render
from compare.harness import peer_rows
from compare.harness.hf_rows import compare_rows
from compare.harness.hf_rows import AGREEMENT_TOLERANCE
from compare.harness.peer_rows import ROWS, pytorch_cp_attention
from torch_impl.attention import reference_attention


def _qkv(heads: int, kv_heads: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 48, h, 16, generator=generator, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_the_peers_attention_is_ours(heads, kv_heads):
    q, k, v = _qkv(heads, kv_heads)
    peer = pytorch_cp_attention((SDPBackend.MATH,))(q, k, v)
    # float64 inputs, but the reference keeps its log-sum-exp in float32 (its contract): differences of ~4e-7
    torch.testing.assert_close(peer, reference_attention(q, k, v, causal=True), rtol=1e-5, atol=2e-6)


def test_a_wrong_head_grouping_is_seen():
    """Negative control: KV heads in another order (head h reading KV head h % Hkv, not h // (H / Hkv)) differ."""
    q, k, v = _qkv(4, 2)
    peer = pytorch_cp_attention((SDPBackend.MATH,))(q, k, v)
    swapped = reference_attention(q, k.flip(2), v.flip(2), causal=True)
    assert (peer - swapped).abs().max() > 1e-2


def shards_of_context_parallel(rank, world, seq_len):
    """On each rank: the peer's buffers as `context_parallel` leaves them, beside our ring's parts of the batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from torch_impl.parallel import local_batch, make_mesh
    from weights.parallel import MeshShape
    from weights.training import next_token_targets

    batch = np.random.default_rng(0).integers(0, 1000, (1, seq_len), dtype=np.int64)
    ours = [t.tolist() for t in local_batch(batch, make_mesh(MeshShape(fsdp=1, sp=world), "cpu"), torch.device("cpu"))]
    buffers = [torch.from_numpy(batch), torch.from_numpy(next_token_targets(batch)), torch.arange(seq_len)[None]]
    with context_parallel(init_device_mesh("cpu", (world,)), buffers=buffers, buffer_seq_dims=[1, 1, 1],
                          no_restore_buffers=set(buffers)):
        peer = [t.tolist() for t in buffers]
    return {"ours": ours, "peer": peer}


def test_context_parallel_shards_the_peers_batch_as_our_ring_does():
    world, seq_len = 4, 64
    per_rank = run_on_ranks(world, {"shards": ("shards_of_context_parallel", {"seq_len": seq_len})},
                            module=__name__)
    for rank, out in enumerate(per_rank):
        shards = out["shards"]
        assert "error" not in shards, shards
        tokens, targets, positions = shards["peer"]
        assert [tokens, targets, positions[0]] == shards["ours"], rank
        # rank r holds chunks r and 2W-1-r of 2W (not contiguous: the negative control of the layout's claim)
        chunk = seq_len // (2 * world)
        assert positions[0] == (list(range(rank * chunk, (rank + 1) * chunk))
                                + list(range((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)))


PLAN = dict(model="tiny", seq_len=128, devices=2, checkpointing="full", checkpointed_layers=None, warmup=1, steps=1,
            seed=0)


def ours_torch_row(rank, world, plan):
    from compare.harness.peer_rows import _measure

    return _measure("ours", plan, torch.device("cpu"))


def test_our_rows_are_measured_and_agree_across_backends(tmp_path):
    """The bench's measuring path without GPUs, the peer aside: our torch row (its worker's `_measure`, 2 gloo ranks,
    the kernels under Triton's interpreter) and our JAX row (`twinflash train --backend jax`, 2 emulated devices), the
    same weights and tokens, compared as the bench compares them; a negative control for the comparison: another seed
    (other weights and tokens) disagrees."""
    torch_row = run_on_ranks(2, {"row": ("ours_torch_row", {"plan": PLAN})}, module=__name__)[0]["row"]
    assert "error" not in torch_row, torch_row
    jax_row, failure = peer_rows.jax_row(PLAN, tmp_path, timeout_s=600)
    assert failure is None, failure
    assert [len(row["step_seconds"]) for row in (torch_row, jax_row)] == [2, 2]
    ours, jax = compare_rows([torch_row, jax_row])
    assert ours["agrees"] and jax["agrees"], (ours["loss"], jax["loss"], ours["grad_norm"], jax["grad_norm"])
    (tmp_path / "other").mkdir()
    other, _ = peer_rows.jax_row(dict(PLAN, seed=1), tmp_path / "other", timeout_s=600)
    assert compare_rows([torch_row, other])[1]["agrees"] is False


def _row(kind: str, loss: float, grad_norm: float, tokens_per_s: float) -> dict:
    return {"kind": kind, "model": ROWS.get(kind, kind), "dtype": "bf16", "seq_len": 256, "devices": 4, "step_s": 0.5,
            "tokens_per_s": tokens_per_s, "tflops_per_device": 400.0, "mfu": 0.4, "peak_memory_bytes": 2**30,
            "loss": loss, "grad_norm": grad_norm}


def _record(rows: list[dict], status: str = "ok", message: str | None = None) -> dict:
    return {"seq_len": 256, "devices": 4, "status": status, "message": message, "versions": {},
            "rows": compare_rows(rows)}


def test_the_compare_reports_the_peer_and_a_disagreement_fails_it():
    """The report's section (compare/report/peer.py): ours over each row's tokens/s, the schema, and the negative
    control: a peer whose first loss is 10x the bf16 tolerance away from ours fails the section and the report."""
    from compare.report.peer import peer_section
    from compare.report.render import render_markdown
    from compare.report.write import validate_report
    from test_compare_report import make_report

    rows = [_row("ours", 5.0, 2.0, 1200.0), _row("peer", 5.0 * (1 + 1e-4), 2.0, 1000.0),
            _row("ours_jax", 5.0, 2.0, 1100.0)]
    close = peer_section([_record(rows)], None)
    assert close["passed"] and not close["failures"]
    report = make_report() | {"training_peer": close, "plots": []}
    validate_report(report)
    text = render_markdown(report)
    assert "PyTorch's context parallelism in our training step" in text and "1.2×" in text  # ours / the peer
    far = peer_section([_record([rows[0], _row("peer", 5.0 * (1 + 10 * AGREEMENT_TOLERANCE["bf16"]), 2.0, 1000.0)])],
                       None)
    assert not far["passed"] and far["failures"] == [f"S=256: {ROWS['peer']} disagrees with our torch row beyond "
                                                     f"its tolerance"]
    report = make_report() | {"training_peer": far, "plots": []}
    report["passed"] = report["passed"] and far["passed"]
    validate_report(report)
    assert "NO" in render_markdown(report)


def test_the_compare_plans_the_peer_on_gpus_only():
    """`plan_peer_rows`: a measurement per length on 2 or more GPUs in train mode with torch, a length skipped up
    front keeping its reason; otherwise one note saying why, which the report shows."""
    from compare.harness.peer_rows import plan_peer_rows
    from compare.harness.plan import CompareSettings
    from compare.report.peer import peer_section
    from compare.report.render import render_markdown
    from compare.report.write import validate_report
    from test_compare_report import make_report

    gpus = CompareSettings(model="tiny", mode="train", seq_lens=(256, 512), device_counts=(2,), devices=2, steps=1,
                           dtype="bf16", backends=("torch", "jax"), attention_ablation=("ours",),
                           activation_checkpointing="full", check_seq_len=64, check_layers=2, bench=True,
                           platform="gpu")
    measurements, note = plan_peer_rows(gpus, False, {512: "estimated peak 90 GiB > 80 GiB"})
    assert note is None and [(m.seq_len, m.devices, m.skip) for m in measurements] == [
        (256, 2, None), (512, 2, "estimated peak 90 GiB > 80 GiB")]
    for change, why in ((dict(platform="cpu"), "it needs GPUs"), (dict(devices=1), "2 or more devices"),
                        (dict(backends=("jax",)), "the torch backend is not in --backends"),
                        (dict(mode="forward"), "--mode train"), (dict(bench=False), "--no-bench"),
                        (dict(dtype="fp32"), "it runs bf16")):
        measurements, note = plan_peer_rows(CompareSettings(**{**gpus.__dict__, **change}), False, {})
        assert measurements == [] and why in note, (change, note)
    assert "spanning nodes" in plan_peer_rows(gpus, True, {})[1]
    report = make_report() | {"training_peer": peer_section([], plan_peer_rows(gpus, True, {})[1]), "plots": []}
    validate_report(report)
    assert "spanning nodes" in render_markdown(report)


def test_without_gpus_the_bench_exits_2_with_one_line(capsys):
    assert main(["--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs CUDA GPUs" in err


def test_the_table_prints_ours_over_the_peer():
    row = dict(model=ROWS["peer"], step_s=0.2, tokens_per_s=1000.0, mfu=0.4, peak_memory_bytes=2**31, loss=1.0,
               speed_vs_ours=1 / 1.25, agrees=True, checkpointed_layers=4)
    table = render([dict(row, model=ROWS["ours"], speed_vs_ours=1.0), row,
                    dict(row, model=peer_rows.JAX_ROW[1], checkpointed_layers=0)])
    assert "1.250" in table.splitlines()[2] and "1.000" in table.splitlines()[1]
    assert [line.split()[-8] for line in table.splitlines()[1:]] == ["4", "4", "0"]  # each row's checkpointed layers


def test_our_jax_row_can_checkpoint_its_own_layers():
    """Each stack at its fastest form: `--jax-checkpointed-layers` sets our JAX row's alone; without it every row
    takes `--checkpointed-layers` (the negative control); the rows record the count they ran."""
    from weights import PRESETS

    plan = dict(PLAN, checkpointing="save-attention", checkpointed_layers=1)
    own = dict(plan, jax_checkpointed_layers=0)
    assert [peer_rows._settings(own, kind).checkpointed_layers for kind in ("ours", "peer", "ours_jax")] == [1, 1, 0]
    assert [peer_rows._settings(plan, kind).checkpointed_layers for kind in ("ours", "peer", "ours_jax")] == [1, 1, 1]
    rows = [peer_rows.row_of((kind, kind), own, PRESETS["tiny"], [1.0, 1.0], [5.0, 5.0], 1.0, 2**30)
            for kind in ("ours", "ours_jax")]
    assert [row["checkpointed_layers"] for row in rows] == [1, 0]
    every = peer_rows.row_of(("ours", "ours"), PLAN, PRESETS["tiny"], [1.0, 1.0], [5.0], 1.0, 2**30)
    assert every["checkpointed_layers"] == PRESETS["tiny"].num_layers  # "full" with no count: all of them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_the_peer_agrees_with_our_ring(tmp_path):
    out = tmp_path / "peer.json"
    code = main(["--model", "llama3.2-1b", "--seq-len", "8192", "--devices", "2", "--warmup", "1", "--steps", "1",
                 "--activation-checkpointing", "save-attention", "--checkpointed-layers", "4",
                 "--jax-checkpointed-layers", "0", "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == 0, document["failure"]
    assert [row["kind"] for row in document["rows"]] == ["ours", "peer", "ours_jax"]
    assert [row["checkpointed_layers"] for row in document["rows"]] == [4, 4, 0]
    assert all(row["agrees"] for row in document["rows"]), [(row["loss"], row["grad_norm"]) for row in document["rows"]]
