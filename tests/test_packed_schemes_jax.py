"""`twinflash train --backend jax --pack` in the Ulysses and hybrid schemes (issue 38, part 2): the packed documents
reach `jax_impl/ulysses.py`'s attention with their segment ids, in the packed training's layout (zigzag_stripes,
`weights.parallel.ring_layout`), and train as the packed ring does. CPU, emulated host devices (conftest's 4), the
tiny model on the reference pair attention; the runs and the tolerance are tests/test_packed_training.py's
(LOSS_RTOL: the same float32 math summed in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_packed_training import LOSS_RTOL, STEPS, _train


@pytest.mark.slow
def test_packed_ulysses_and_hybrid_train_as_the_packed_ring(tmp_path):
    """3 steps of 4 packed sequences of 256 tokens (two hold a boundary between stdlib files): Ulysses over 2 and
    the hybrid 2 x 2 against the ring over 2; the negative control (the same Ulysses run unpacked) differs."""
    ring = _train(tmp_path / "ring", "jax", "--pack", "--mesh", "fsdp=1,sp=2")
    ulysses = _train(tmp_path / "ulysses", "jax", "--pack", "--mesh", "fsdp=1,sp=2", "--sp-scheme", "ulysses")
    hybrid = _train(tmp_path / "hybrid", "jax", "--pack", "--mesh", "fsdp=1,sp=4", "--sp-scheme", "hybrid",
                    "--ulysses-degree", "2")
    assert len(ring) == STEPS
    np.testing.assert_allclose(ulysses, ring, rtol=LOSS_RTOL)
    np.testing.assert_allclose(hybrid, ring, rtol=LOSS_RTOL)
    unpacked = _train(tmp_path / "ulysses-unpacked", "jax", "--mesh", "fsdp=1,sp=2", "--sp-scheme", "ulysses")
    assert np.max(np.abs(unpacked - ring)) > 1e-3  # negative control: without the documents the losses move
