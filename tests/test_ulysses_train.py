"""`twinflash train --sp-scheme {ulysses,hybrid}` in both backends on CPU (the tiny preset: 4 query and 2 KV heads,
so Ulysses over 4 repeats each KV head to 2 devices): a few fp32 steps on 4 devices give the losses and grad norms of
one device's run, with activation checkpointing (whose backward reruns the all-to-alls) and with fsdp beside sp; and
the schemes the mesh or the model's heads cannot take are refused by the command with one line, before anything
starts. The torch runs start gloo processes through torchrun (seconds each), the JAX runs use the 4 emulated host
devices in this process.

Tolerance: 1e-5 relative per step, tests/test_train_torch.py's and tests/test_train_jax.py's for sharded runs: the
same float32 math summed in another order (the all-to-alls only move numbers; the ring inside the hybrid merges by
log-sum-exp) moves a loss of ~5 by ~1e-6.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from compare.commands.train import main
from jax_impl.memory_plan import lowered_step, step_memory_plan
from jax_impl.parallel import make_mesh
from jax_impl.train import run_training, step_spec
from weights import preset
from weights.data import training_batches
from weights.parallel import MeshShape
from weights.settings import TrainSettings

STEPS = 4
SHARDED_RTOL = 1e-5  # module docstring
COMMON = ["--model", "tiny", "--seq-len", "64", "--steps", str(STEPS), "--batch", "2", "--attention-backend",
          "reference"]
# (mesh, scheme arguments, activation checkpointing) of each sharded run, the same in both backends
RUNS = {"ulysses-fsdp2-sp2": ("fsdp=2,sp=2", ["--sp-scheme", "ulysses"], "save-attention"),
        "ulysses-sp4": ("fsdp=1,sp=4", ["--sp-scheme", "ulysses"], "off"),
        "hybrid-u2-sp4": ("fsdp=1,sp=4", ["--sp-scheme", "hybrid", "--ulysses-degree", "2"], "full")}


def _torch_train(out, mesh: str, *extra) -> list[dict]:
    command = [sys.executable, "-m", "compare.commands.train", "--backend", "torch", *COMMON, "--mesh", mesh,
               "--out", str(out), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def _jax_train(mesh: str, scheme_args: list[str], remat: str) -> list[dict]:
    scheme = dict(zip(scheme_args[::2], scheme_args[1::2]))
    settings = TrainSettings(backend="jax", model="tiny", seq_len=64, steps=STEPS, mesh=MeshShape.parse(mesh),
                             batch=2, attention_backend="reference", activation_checkpointing=remat,
                             sp_scheme=scheme.get("--sp-scheme", "ring"),
                             ulysses_degree=int(scheme["--ulysses-degree"]) if "--ulysses-degree" in scheme else None)
    records: list[dict] = []
    shape = MeshShape.parse(mesh)
    run_training(settings, training_batches(settings, preset("tiny")), lambda **record: records.append(record),
                 devices=jax.devices()[:shape.size])
    return records


def _assert_same_steps(records: list[dict], reference: list[dict]) -> None:
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=SHARDED_RTOL,
                                   atol=0, err_msg=key)


@pytest.mark.slow
def test_torch_schemes_train_as_one_process(tmp_path):
    reference = _torch_train(tmp_path / "single", "fsdp=1,sp=1")
    for name, (mesh, scheme, remat) in RUNS.items():
        records = _torch_train(tmp_path / name, mesh, *scheme, "--activation-checkpointing", remat)
        assert [r["step"] for r in records] == list(range(STEPS)), name
        _assert_same_steps(records, reference)


@pytest.mark.slow
def test_jax_schemes_train_as_one_device():
    reference = _jax_train("fsdp=1,sp=1", [], "off")
    for name, run in RUNS.items():
        _assert_same_steps(_jax_train(*run), reference)


def test_jax_step_and_its_memory_plan_run_the_scheme_they_are_given():
    """The JAX step of each scheme lowers to its collectives (the ring's permutes, the all-to-alls, both in the
    hybrid), and `--plan-memory`'s plan compiles for the scheme."""
    for scheme, degree in (("ring", None), ("ulysses", None), ("hybrid", 2)):
        settings = TrainSettings(backend="jax", model="tiny", seq_len=64, steps=1, mesh=MeshShape(sp=4), batch=1,
                                 attention_backend="reference", sp_scheme=scheme, ulysses_degree=degree)
        text = lowered_step(step_spec(settings, preset("tiny"), make_mesh(settings.mesh)), 1, 64).as_text()
        assert ("all_to_all" in text) == (scheme != "ring"), scheme
        assert ("collective_permute" in text) == (scheme != "ulysses"), scheme
    assert step_memory_plan(settings)["temporaries"] > 0


def _bad(capsys, argv, *fragments) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("twinflash: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_schemes_the_mesh_or_heads_cannot_take_are_refused(capsys, tmp_path, backend):
    base = ["--backend", backend, *COMMON, "--out", str(tmp_path / "out")]
    _bad(capsys, base + ["--mesh", "fsdp=1,sp=4", "--sp-scheme", "hybrid"], "needs its Ulysses degree U")
    _bad(capsys, base + ["--mesh", "fsdp=1,sp=4", "--sp-scheme", "hybrid", "--ulysses-degree", "3"],
         "hybrid Ulysses degree 3 over sp=4", "(one of 2)")
    _bad(capsys, base + ["--mesh", "fsdp=2,sp=2", "--sp-scheme", "ring", "--ulysses-degree", "2"],
         "the ring scheme over sp=2 has Ulysses degree 1, got 2")
    _bad(capsys, base + ["--mesh", "fsdp=1,sp=8", "--seq-len", "128", "--sp-scheme", "ulysses"],
         "Ulysses degree 8 must divide the 4 query heads")
    assert not (tmp_path / "out").exists()
