"""`compare/bench/jax_compile_profile.py`'s check mode lowers what compare's float32 equivalence check compiles: the
loss, gradients and logits of the model's first N layers, at the matmul precision asked (CPU, nothing compiled)."""

from __future__ import annotations

import jax
import pytest

from compare.bench.jax_compile_profile import check_lowered
from compare.harness.worker_jax import CHECK_COMPILER_OPTIONS
from jax_impl.parallel import make_mesh
from weights.parallel import MeshShape

SEQ_LEN = 64


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshShape(), jax.devices()[:1])


@pytest.mark.parametrize("layers", [1, 2])
def test_the_check_is_lowered_for_the_first_layers_with_its_logits(mesh, layers):
    lowered = check_lowered("tiny", layers, SEQ_LEN, "reference", "highest", mesh)
    (loss, logits), grads = lowered.out_info
    assert loss.shape == () and logits.shape[:2] == (1, SEQ_LEN) and logits.dtype == jax.numpy.float32
    stacked = {name: g.shape[0] for name, g in grads.items() if name.startswith("layers.")}
    assert stacked and set(stacked.values()) == {layers}  # the layer count asked, not the preset's


def test_the_check_precision_reaches_the_matmuls(mesh):
    # the negative control: "default" leaves the dots at XLA's default, so the HIGHEST seen is the setting's
    def text(precision):
        return check_lowered("tiny", 1, SEQ_LEN, "reference", precision, mesh).as_text()
    assert "HIGHEST" in text("highest")
    assert "HIGHEST" not in text("default")


def test_the_check_compiles_with_xla_autotuning_off(mesh):
    # on GPUs XLA's GEMM autotuning of the check's float32 dots took most of its compilation; the option is a GPU
    # one, so this proves the CPU's XLA (CI's jaxlib) accepts it too, since compare runs the check there
    assert dict(CHECK_COMPILER_OPTIONS) == {"xla_gpu_autotune_level": 0}
    compiled = check_lowered("tiny", 1, SEQ_LEN, "reference", "highest", mesh).compile()
    assert compiled.as_text()
