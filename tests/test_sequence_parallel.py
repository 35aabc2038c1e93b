"""Sequence parallelism end to end and across frameworks: the Llama models with ring attention on P = 4 against one
device (logits and parameter gradients, both backends), the torch ring against the JAX ring, and the Triton kernel
against the Pallas kernel, on identical inputs.

Tolerances: fp32 throughout. The sequence-parallel model does the single-device model's float32 math in another
order (attention merged by log-sum-exp over ring steps, gradients summed over ranks), which moves logits of magnitude
~1 by ~1e-6: 1e-4 max-abs on logits is the issue's bound, and gradients (summed over 64 positions) get 1e-4 relative
to their largest entry. Torch vs JAX kernels and rings: the same float32 algorithm in two frameworks, ~1e-6 apart;
1e-5 leaves an order of magnitude. A negative control shows the model comparison sees a wrong position layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import run_on_ranks
from flax import nnx

from jax_impl import flash_attention as jax_flash
from jax_impl import ring_attention_sharded
from jax_impl.model import load_model as load_jax_model
from jax_impl.parallel import make_mesh, ring_attention_fn, sharded_batch
from jax_impl.ring_attention import gather_from_ring as jax_gather
from torch_impl import flash_attention as torch_flash
from torch_impl import gather_from_ring, ring_attention, shard_for_ring
from torch_impl.model import load_model as load_torch_model
from weights.layout import rank_positions
from weights.parallel import MeshShape

WORLD = 4
SEQ = 64
LOGIT_ATOL = 1e-4
GRAD_RTOL = 1e-4
CROSS_TOL = dict(rtol=1e-5, atol=1e-5)


def _tokens(seq: int = SEQ) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (2, seq))


def _loss_weights(shape) -> np.ndarray:
    """Fixed random weights: loss = sum(logits * W) gives every logit its own gradient."""
    return np.random.default_rng(4).standard_normal(shape).astype(np.float32)


def _torch_single_device(tokens: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    model = load_torch_model("tiny")
    logits = model(torch.from_numpy(tokens))
    (logits * torch.from_numpy(_loss_weights(logits.shape))).sum().backward()
    return logits.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


def case_model(rank, world, *, layout, variant, backend, positions_layout=None):
    """Sequence-parallel tiny Llama on this rank's tokens; rank 0 returns gathered logits and summed grads."""
    tokens = torch.from_numpy(_tokens())
    attention = functools.partial(ring_attention, layout=layout, variant=variant, backend=backend)
    model = load_torch_model("tiny", attention_fn=attention)
    positions = torch.from_numpy(rank_positions(SEQ, world, rank, positions_layout or layout))
    local_logits = model(shard_for_ring(tokens, None, layout), positions)
    logits = gather_from_ring(local_logits, None, layout)
    (logits * torch.from_numpy(_loss_weights(logits.shape))).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)
        grads[name] = param.grad.numpy()
    return {"logits": logits.detach().numpy(), "grads": grads} if rank == 0 else {}


def case_ring(rank, world, *, causal, layout, variant):
    """Full-sequence (out, lse, dq, dk, dv) of the torch ring on `_attention_inputs`, gathered on every rank."""
    q, k, v, dout = (torch.from_numpy(x) for x in _attention_inputs())
    q, k, v = (shard_for_ring(x, None, layout).requires_grad_() for x in (q, k, v))
    out, lse = ring_attention(q, k, v, causal=causal, layout=layout, variant=variant, return_lse=True)
    out.backward(shard_for_ring(dout, None, layout))
    gather = functools.partial(gather_from_ring, group=None, layout=layout)
    return {"out": gather(out).detach().numpy(), "lse": gather(lse, dim=2).numpy(),
            **{name: gather(x.grad).numpy() for name, x in (("dq", q), ("dk", k), ("dv", v))}}


def _attention_inputs() -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    shapes = [(1, 48, 4, 32), (1, 48, 2, 32), (1, 48, 2, 32), (1, 48, 4, 32)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


TORCH_MODEL_CASES = {
    "zigzag-ring-triton": ("case_model", dict(layout="zigzag", variant="ring", backend="triton")),
    "contiguous-allgather-reference": ("case_model", dict(layout="contiguous", variant="allgather",
                                                          backend="reference")),
    "wrong-positions": ("case_model", dict(layout="zigzag", variant="ring", backend="reference",
                                           positions_layout="contiguous")),
}
RING_CASES = {f"{c}-{layout}-{variant}": ("case_ring", dict(causal=c == "causal", layout=layout, variant=variant))
              for c in ("causal", "full") for layout in ("zigzag", "contiguous") for variant in ("ring", "allgather")}


@pytest.fixture(scope="module")
def torch_p4():
    return run_on_ranks(WORLD, {**TORCH_MODEL_CASES, **RING_CASES}, module=__name__)


@pytest.fixture(scope="module")
def single_device():
    return _torch_single_device(_tokens())


def _assert_grads_close(grads: dict, expected: dict) -> None:
    assert sorted(grads) == sorted(expected)
    for name, grad in grads.items():
        scale = np.abs(expected[name]).max()
        np.testing.assert_allclose(grad, expected[name], rtol=0, atol=GRAD_RTOL * scale, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["zigzag-ring-triton", "contiguous-allgather-reference"])
def test_torch_model_on_4_ranks_matches_one_device(torch_p4, single_device, case):
    result = torch_p4[0][case]
    assert "error" not in result, result
    np.testing.assert_allclose(result["logits"], single_device[0], rtol=0, atol=LOGIT_ATOL)
    _assert_grads_close(result["grads"], single_device[1])


@pytest.mark.slow
def test_negative_control_wrong_positions_fail(torch_p4, single_device):
    """RoPE positions from the wrong layout (the classic sharding bug) must break the comparison."""
    assert np.abs(torch_p4[0]["wrong-positions"]["logits"] - single_device[0]).max() > 10 * LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("backend, variant", [("pallas", "ring"), ("reference", "allgather")])
def test_jax_model_on_4_devices_matches_one_device(single_device, backend, variant):
    mesh = make_mesh(MeshShape(fsdp=1, sp=WORLD))
    tokens_np = _tokens()
    tokens, _, positions = sharded_batch(tokens_np, mesh)
    model = load_jax_model("tiny", attention_fn=ring_attention_fn(mesh, backend=backend, variant=variant))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    weights = jnp.asarray(_loss_weights((*tokens_np.shape, 256)))

    def logits_and_loss(params):
        logits = jax_gather(nnx.merge(graphdef, params, rest)(tokens, positions), WORLD, "zigzag")
        return jnp.sum(logits * weights), logits

    grads, logits = jax.jit(jax.grad(logits_and_loss, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(logits), single_device[0], rtol=0, atol=LOGIT_ATOL)
    flat = {".".join(map(str, path)): np.asarray(v[...]) for path, v in nnx.to_flat_state(grads)}
    _assert_grads_close(flat, single_device[1])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RING_CASES))
def test_torch_ring_equals_jax_ring(torch_p4, case):
    kwargs = RING_CASES[case][1]
    q, k, v, dout = (jnp.asarray(x) for x in _attention_inputs())
    mesh = make_mesh(MeshShape(fsdp=1, sp=WORLD))

    def loss(q, k, v):
        out, lse = ring_attention_sharded(q, k, v, mesh, return_lse=True, **kwargs)
        return jnp.sum(out * dout), (out, lse)

    (dq, dk, dv), (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    expected = torch_p4[0][case]
    assert "error" not in expected, expected
    for name, value in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        np.testing.assert_allclose(np.asarray(value), expected[name], **CROSS_TOL, err_msg=name)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_q, seq_k", [(97, 97), (40, 97)])
def test_triton_kernel_equals_pallas_kernel(causal, seq_q, seq_k):
    rng = np.random.default_rng(seq_q + causal)
    q = rng.standard_normal((1, seq_q, 4, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, seq_k, 1, 64)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    t_out, t_lse = torch_flash(tq, tk, tv, causal=causal, return_lse=True)
    t_out.backward(torch.from_numpy(dout))

    def loss(q, k, v):
        out, lse = jax_flash(q, k, v, causal=causal, return_lse=True)
        return jnp.sum(out * dout), (out, lse)

    grads, (j_out, j_lse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    pairs = [(t_out, j_out), (t_lse, j_lse), (tq.grad, grads[0]), (tk.grad, grads[1]), (tv.grad, grads[2])]
    for torch_value, jax_value in pairs:
        np.testing.assert_allclose(torch_value.detach().numpy(), np.asarray(jax_value), **CROSS_TOL)
