"""`twinflash bench train-peer` (compare/bench/train_peer.py): the peer's attention function computes our attention
(CPU, through SDPA's math backend, with a negative control); PyTorch's `context_parallel` shards the peer's tokens,
targets and positions into exactly the parts our ring's ranks hold (`local_batch`, the zigzag layout; 4 gloo
processes); our torch and JAX rows are measured and agree (the bench's path without GPUs, the peer aside); the
command's bad input exits 2 with one line (no GPUs here), its table prints ours / peer; on 2 GPUs,
the whole bench: PyTorch's context parallelism in our training step agrees with our ring on the first step's loss and
gradient norm (the bench's own check, exit 1 when not)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from distributed import run_on_ranks
from torch.nn.attention import SDPBackend

from compare.bench import train_peer
from compare.bench.train_peer import ROWS, main, pytorch_cp_attention, render
from compare.harness.hf_rows import compare_rows
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
    from compare.bench.train_peer import _measure

    return _measure("ours", plan, torch.device("cpu"))


def test_our_rows_are_measured_and_agree_across_backends(tmp_path):
    """The bench's measuring path without GPUs, the peer aside: our torch row (its worker's `_measure`, 2 gloo ranks,
    the kernels under Triton's interpreter) and our JAX row (`twinflash train --backend jax`, 2 emulated devices), the
    same weights and tokens, compared as the bench compares them; a negative control for the comparison: another seed
    (other weights and tokens) disagrees."""
    torch_row = run_on_ranks(2, {"row": ("ours_torch_row", {"plan": PLAN})}, module=__name__)[0]["row"]
    assert "error" not in torch_row, torch_row
    jax_row, failure = train_peer.jax_row(PLAN, tmp_path, timeout_s=600)
    assert failure is None, failure
    assert [len(row["step_seconds"]) for row in (torch_row, jax_row)] == [2, 2]
    ours, jax = compare_rows([torch_row, jax_row])
    assert ours["agrees"] and jax["agrees"], (ours["loss"], jax["loss"], ours["grad_norm"], jax["grad_norm"])
    (tmp_path / "other").mkdir()
    other, _ = train_peer.jax_row(dict(PLAN, seed=1), tmp_path / "other", timeout_s=600)
    assert compare_rows([torch_row, other])[1]["agrees"] is False


def test_without_gpus_the_bench_exits_2_with_one_line(capsys):
    assert main(["--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs CUDA GPUs" in err


def test_the_table_prints_ours_over_the_peer():
    row = dict(model=ROWS["peer"], step_s=0.2, tokens_per_s=1000.0, mfu=0.4, peak_memory_bytes=2**31, loss=1.0,
               speed_vs_ours=1 / 1.25, agrees=True)
    table = render([dict(row, model=ROWS["ours"], speed_vs_ours=1.0), row])
    assert "1.250" in table.splitlines()[2] and "1.000" in table.splitlines()[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_the_peer_agrees_with_our_ring(tmp_path):
    out = tmp_path / "peer.json"
    code = main(["--model", "llama3.2-1b", "--seq-len", "8192", "--devices", "2", "--warmup", "1", "--steps", "1",
                 "--out", str(out)])
    document = json.loads(out.read_text())
    assert code == 0, document["failure"]
    assert [row["kind"] for row in document["rows"]] == ["ours", "peer"]
    assert all(row["agrees"] for row in document["rows"])
