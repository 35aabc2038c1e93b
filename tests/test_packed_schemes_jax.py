"""`twinflash train --backend jax --pack` on the Ulysses and hybrid schemes (issue 38, part 2), twin of
tests/test_packed_schemes_torch.py: on CPU (emulated host devices, the tiny model on the reference pair attention,
fp32) the packed runs of `--sp-scheme ulysses` over sp=2 and `--sp-scheme hybrid --ulysses-degree 2` over sp=4 give
the losses of the packed ring over sp=2, though they hold the sequence in zigzag where the ring holds it in
zigzag_stripes (`weights.parallel.scheme_layout`): at 1024 tokens over sp=2 the stripes are not zigzag's chunks, so
data sharded in one layout and attended in the other would fail. 1024 tokens over 2 x 2 is also a length whose
groups' zigzag_stripes (2 x 128) are not a ring's over 2 (256): the hybrid trains at any length. The negative
control (the same Ulysses run unpacked) differs.

Tolerance: LOSS_RTOL, tests/test_packed_training.py's 1e-5 (the same float32 math summed in another order).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from weights.layout import rank_positions, stripe_tokens
from weights.parallel import PACKED_RING_LAYOUT, RING_LAYOUT

LOSS_RTOL = 1e-5  # module docstring
STEPS = 3
SEQ_LEN = 1024  # over sp=2: 4 stripes of 128 per device in zigzag_stripes, where zigzag has 2 chunks of 256
COMMON = ["--backend", "jax", "--model", "tiny", "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--batch", "2",
          "--attention-backend", "reference", "--data", "text"]


def _train(out, *extra) -> np.ndarray:
    """The losses of one `twinflash train` run in a fresh interpreter."""
    command = [sys.executable, "-m", "compare.commands.train", *COMMON, "--out", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return np.array([json.loads(line)["loss"] for line in (out / "train.jsonl").read_text().splitlines()])


@pytest.mark.slow
def test_packed_ulysses_and_hybrid_train_as_the_packed_ring(tmp_path):
    # the layouts differ at this length: a run sharding in one and attending in the other is told apart
    assert (rank_positions(SEQ_LEN, 2, 0, PACKED_RING_LAYOUT) != rank_positions(SEQ_LEN, 2, 0, RING_LAYOUT)).any()
    assert 2 * stripe_tokens(SEQ_LEN, 4) != stripe_tokens(SEQ_LEN, 2)  # a length zigzag_stripes' hybrid cannot take
    ring = _train(tmp_path / "ring", "--pack", "--mesh", "fsdp=1,sp=2")
    ulysses = _train(tmp_path / "ulysses", "--pack", "--mesh", "fsdp=1,sp=2", "--sp-scheme", "ulysses")
    hybrid = _train(tmp_path / "hybrid", "--pack", "--mesh", "fsdp=1,sp=4", "--sp-scheme", "hybrid",
                    "--ulysses-degree", "2")
    assert len(ring) == STEPS
    np.testing.assert_allclose(ulysses, ring, rtol=LOSS_RTOL)
    np.testing.assert_allclose(hybrid, ring, rtol=LOSS_RTOL)
    unpacked = _train(tmp_path / "ulysses-unpacked", "--mesh", "fsdp=1,sp=2", "--sp-scheme", "ulysses")
    assert np.max(np.abs(unpacked - ring)) > 1e-3  # negative control: without the documents the losses move
