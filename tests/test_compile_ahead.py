"""The JAX worker's attention kernels compiled ahead (`compare.harness.worker_jax.compile_attention_ahead`).

Mosaic GPU keeps each compiled kernel under a hash of its bytes, so compiling `lowered_ring_attention` helps a
later train step only if its kernels hash the same as the step's own. Both are lowered here for CUDA on the CPU
(cross-platform lowering, the Pallas calls switched from the interpreter to Mosaic GPU as on a Hopper GPU) and
their `kernel_hash` attributes compared; a warm-up of another length is the negative control (the comparison
would pass vacuously if hashes ignored the shapes, or if no kernel were found).
"""

import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from compare.harness import jobs as J
from compare.harness.worker_jax import attention_shapes_ahead, compile_attention_ahead
from jax_impl import train as T
from jax_impl.parallel import lowered_ring_attention, make_mesh, parameter_shardings
from weights.config import LlamaConfig
from weights.parallel import ACTIVATION_SHARDING, MeshShape
from weights.settings import TrainSettings

# 1B's attention proportions at a small size: head dim 64 (a Mosaic one), GQA 2
CONFIG = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5, rope_scaling=None,
                     tie_word_embeddings=True, max_position_embeddings=1 << 20)
SEQ_LEN = 2048


def _kernel_hashes(lowered) -> set[str]:
    return set(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', lowered.as_text()))


def _step_lowered(mesh, seq_len: int):
    settings = TrainSettings(backend="jax", model="tiny", seq_len=seq_len, steps=1, batch=1,
                             mesh=MeshShape(fsdp=1, sp=2), dtype="bf16", attention_backend="pallas_mosaic")
    spec = T.step_spec(settings, CONFIG, mesh)
    shapes = T.state_shapes(CONFIG)
    shardings = parameter_shardings(mesh, shapes)
    params = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[n]) for n, s in shapes.items()}
    state = {"model": params, "optimizer": {"exp_avg": params, "exp_avg_sq": params}}
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32,
                                  sharding=NamedSharding(mesh, PartitionSpec(*ACTIVATION_SHARDING["tokens"])))
    positions = jax.ShapeDtypeStruct((seq_len,), jnp.int32,
                                     sharding=NamedSharding(mesh, PartitionSpec(*ACTIVATION_SHARDING["positions"])))
    scalars = jax.eval_shape(lambda: T.step_scalars(T.adamw_coefficients(spec.optimizer, 0)))
    return T._jitted_step(spec.compiler_options).trace(state, tokens, tokens, positions, scalars, spec=spec).lower(
        lowering_platforms=("cuda",))


def _warm_lowered(mesh, seq_len: int):
    return lowered_ring_attention(mesh, batch=1, seq_len=seq_len, heads=CONFIG.num_heads,
                                  kv_heads=CONFIG.num_kv_heads, head_dim=CONFIG.head_dim, dtype=jnp.bfloat16,
                                  backend="pallas_mosaic", platforms=("cuda",))


def test_compiled_ahead_kernels_are_the_steps(monkeypatch):
    # the module, not the package's `flash_attention` function of the same name
    monkeypatch.setattr(importlib.import_module("jax_impl.flash_attention"), "_interpret", lambda: False)
    mesh = make_mesh(MeshShape(fsdp=1, sp=2), jax.devices()[:2])
    step = _kernel_hashes(_step_lowered(mesh, SEQ_LEN))
    assert len(step) >= 4, "the step's ring should run several Mosaic kernels (forward and backward, per block kind)"
    assert step <= _kernel_hashes(_warm_lowered(mesh, SEQ_LEN))
    assert not step & _kernel_hashes(_warm_lowered(mesh, 2 * SEQ_LEN)), "negative control: other shapes, other kernels"


def _job(job_id: str, *, seq_len: int, devices: int = 2, attention_backend: str = "pallas", kind: str = "bench"):
    return J.Job(id=job_id, kind=kind, backend="jax", model="tiny", seq_len=seq_len, devices=devices,
                 attention="ours", attention_backend=attention_backend, dtype="fp32", mode="train", steps=2)


def test_points_compiled_ahead():
    jobs = [_job("a", seq_len=64), _job("vendor", seq_len=64, attention_backend="cudnn"),
            _job("same-as-first", seq_len=64), _job("b", seq_len=128), _job("b-again", seq_len=128),
            _job("curve", seq_len=256, kind="curve"), _job("c", seq_len=128, devices=1)]
    assert [job.id for job in attention_shapes_ahead(jobs)] == ["b", "c"]
    assert attention_shapes_ahead(jobs[:1]) == []


def test_compile_ahead_runs_on_the_tiny_model(capsys):
    # on CPU the kernels are interpreted (nothing kept): this checks the plumbing from a job to its compilation
    jobs = [_job("first", seq_len=64), _job("later", seq_len=128)]
    compile_attention_ahead(jobs, jax.devices())
    assert "attention kernels of 1 later points compiled ahead" in capsys.readouterr().err
    broken = dataclasses.replace(jobs[1], id="broken", seq_len=130)  # not divisible over the ring: reported, no raise
    compile_attention_ahead([jobs[0], broken], jax.devices())
    assert "broken: attention not compiled ahead" in capsys.readouterr().err

