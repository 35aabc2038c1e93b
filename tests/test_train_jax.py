"""JAX distributed training on CPU (4 emulated devices, tiny preset, byte-level stdlib text): falling loss on the
fsdp=2 x sp=2 and fsdp=1 x sp=4 meshes, sharded runs equal to a single-device run, stop + resume equal to the
uninterrupted run bit for bit (with a crash mid-save in between), refusal of incompatible checkpoints, export that
Hugging Face transformers loads, the chunked sharded loss against the model's plain loss, AdamW against
torch.optim.AdamW, and `twinflash train` with both backends writing the same train.jsonl (torch twin's losses).
Twin of tests/test_train_torch.py.

One jitted step is compiled per (mesh, dtype, remat, loss chunk) and reused by every run of that spec in this
process, so the module's runs share a handful of compilations. Ring steps use the plain-math "reference" backend
(the Pallas kernels run in interpret mode on CPU, far too slow for 20 training steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import orbax.checkpoint._src.path.atomicity as orbax_atomicity
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec

from compare.commands.train import main as train_main
from weights.data import training_batches
from jax_impl import checkpointing
from jax_impl.model import Llama, load_model, parameter_dict, stack_layers, unstack_layers
from jax_impl.model import next_token_loss as model_next_token_loss
from jax_impl.memory_plan import step_memory_plan
from jax_impl.parallel import load_parameters, make_mesh, sharded_batch
from jax_impl.train import StepSpec, adamw_update, clip_gradients, init_optimizer_state, next_token_loss, run_training
from weights import (BadInputError, CheckpointError, RandomWeights, parameter_shapes, preset,
                     write_converted_checkpoint)
from weights.layout import LayoutError
from weights.parallel import MeshShape
from weights.schedule import OptimizerConfig
from weights.settings import TrainSettings
from weights.training import adamw_coefficients, check_compatible, run_metadata

SEQ_LEN = 64
BATCH = 4
STEPS = 20
# Sharded vs single-device: the same fp32 arithmetic summed in another order (per-device partial sums, psum),
# which moves a loss of ~4 by ~1e-6 after 20 steps of training (measured: 2e-7 relative); the bound is 1e-5.
SHARDED_RTOL = 1e-5
# torch vs JAX: same fp32 math, different kernels and reduction orders; the bound (measured ~1e-6).
TWIN_ATOL = 1e-4
MESHES = {"fsdp2_sp2": MeshShape(fsdp=2, sp=2), "fsdp1_sp4": MeshShape(fsdp=1, sp=4)}
# Per-mesh variations, so each option's paths run: per-layer checkpointing keeping the attention's outputs or not
# (the single-device run checkpoints nothing), and a loss chunk that splits a device's 64 rows into one scanned
# chunk of 40 plus a remainder of 24.
MESH_OPTIONS = {"fsdp2_sp2": {"activation_checkpointing": "save-attention"},
                "fsdp1_sp4": {"activation_checkpointing": "full", "loss_chunk_tokens": 40}}


def _settings(model, mesh: MeshShape, **fields) -> TrainSettings:
    return TrainSettings(backend="jax", model=str(model), seq_len=SEQ_LEN, steps=STEPS, mesh=mesh, batch=BATCH,
                         attention_backend="reference", **fields)


@dataclasses.dataclass
class Run:
    settings: TrainSettings
    records: list[dict]
    state: dict

    @property
    def losses(self) -> np.ndarray:
        return np.array([r["loss"] for r in self.records])


def _train(settings: TrainSettings, devices=None) -> Run:
    records: list[dict] = []
    batches = training_batches(settings, preset("tiny"))
    state = run_training(settings, batches, lambda **record: records.append(record), devices=devices)
    return Run(settings, records, state)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """A converted checkpoint of the tiny preset's random weights (seed 1): what both backends load."""
    directory = tmp_path_factory.mktemp("weights") / "tiny"
    source = RandomWeights(preset("tiny"), seed=1)
    write_converted_checkpoint(dict(source), source.config, directory)
    return directory


@pytest.fixture(scope="module")
def single_device(weights_dir) -> Run:
    return _train(_settings(weights_dir, MeshShape()), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def runs(weights_dir, tmp_path_factory) -> dict[str, Run]:
    """20 uninterrupted steps on each mesh; the fsdp2_sp2 run also exports its final weights."""
    export = tmp_path_factory.mktemp("export")
    return {name: _train(_settings(weights_dir, mesh, export_dir=export / name if name == "fsdp2_sp2" else None,
                                   **MESH_OPTIONS[name]))
            for name, mesh in MESHES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_loss_falls_and_matches_single_device(runs, single_device, mesh):
    run = runs[mesh]
    assert [r["step"] for r in run.records] == list(range(STEPS))
    assert np.all(np.isfinite(run.losses))
    assert run.losses[-5:].mean() < run.losses[:5].mean() - 0.8  # byte-level text: ~5.5 -> ~3.5 in 20 steps
    np.testing.assert_allclose(run.losses, single_device.losses, rtol=SHARDED_RTOL, atol=0)
    np.testing.assert_allclose([r["lr"] for r in run.records],
                               [run.settings.optimizer.learning_rate(s) for s in range(STEPS)], rtol=0, atol=0)
    assert all(r["grad_norm"] > 0 and r["seconds"] > 0 and r["peak_memory_bytes"] for r in run.records)


@pytest.mark.slow
def test_stop_and_resume_equals_uninterrupted_run(runs, weights_dir, tmp_path, monkeypatch):
    """Stop at step 10, crash while saving step 15, resume from 10: steps 10..19 and the final state are the
    uninterrupted run's, bit for bit; the half-written step is never listed and is cleaned up."""
    uninterrupted = runs["fsdp2_sp2"]
    ckpt = tmp_path / "ckpt"
    settings = _settings(weights_dir, MESHES["fsdp2_sp2"], ckpt_dir=ckpt, ckpt_every=5, keep=2,
                         **MESH_OPTIONS["fsdp2_sp2"])
    first = _train(dataclasses.replace(settings, stop_at=10))
    assert [p.name for p in checkpointing.completed_checkpoints(ckpt)] == ["step_00000005", "step_00000010"]

    async def crash(self):
        raise RuntimeError("simulated crash before the checkpoint's rename")

    with monkeypatch.context() as patch:
        patch.setattr(orbax_atomicity.AtomicRenameTemporaryPath, "finalize", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _train(dataclasses.replace(settings, resume=True, stop_at=15))
    assert any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())  # the half-written step 15
    assert checkpointing.latest_checkpoint(ckpt).name == "step_00000010"

    resumed = _train(dataclasses.replace(settings, resume=True))
    assert [r["step"] for r in resumed.records] == list(range(10, STEPS))
    np.testing.assert_array_equal(np.concatenate([first.losses, resumed.losses]), uninterrupted.losses)
    for name, param in uninterrupted.state["model"].items():
        np.testing.assert_array_equal(np.asarray(resumed.state["model"][name]), np.asarray(param), err_msg=name)
    assert [p.name for p in ckpt.iterdir()] and not any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())
    assert [p.name for p in checkpointing.completed_checkpoints(ckpt)] == ["step_00000015", "step_00000020"]
    meta = checkpointing.read_metadata(checkpointing.latest_checkpoint(ckpt))
    assert (meta["step"], meta["data_position"], meta["mesh"]) == (20, 20, {"fsdp": 2, "sp": 2})

    # Another mesh, model or data stream: one clear line, nothing trained or written.
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(CheckpointError, match="another mesh") as refused:
        _train(dataclasses.replace(settings, mesh=MESHES["fsdp1_sp4"], resume=True))
    assert "\n" not in str(refused.value)
    with pytest.raises(CheckpointError, match="another data stream"):
        _train(dataclasses.replace(settings, seq_len=32, resume=True))
    other_model = run_metadata(settings, dataclasses.replace(preset("tiny"), num_layers=3))
    latest = checkpointing.latest_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="another model config .*num_layers 2 -> 3"):
        check_compatible(latest, checkpointing.read_metadata(latest), other_model)
    with pytest.raises(CheckpointError, match="pass --resume"):
        _train(settings)
    assert sorted(p.name for p in ckpt.iterdir()) == before


@pytest.mark.slow
def test_export_loads_in_transformers_and_reproduces_our_logits(runs):
    converted, hf = runs["fsdp2_sp2"].settings.export_paths
    state = unstack_layers(runs["fsdp2_sp2"].state["model"])
    ours = load_model(converted)
    exported = parameter_dict(ours)
    assert set(exported) == set(state)
    for name, param in state.items():  # the converted checkpoint holds exactly the trained master weights
        np.testing.assert_array_equal(np.asarray(exported[name]), np.asarray(param), err_msg=name)
    tokens = np.random.default_rng(3).integers(0, 256, (2, SEQ_LEN))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = hf_model(torch.from_numpy(tokens)).logits.numpy()
    # fp32 logits, same math in another operation order (the model tests' bound, see tests/test_model.py).
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), reference, rtol=0, atol=1e-4)


def test_chunked_sharded_loss_equals_the_model_loss_and_its_gradient():
    """The loss of the train step (zigzag order, ring attention, chunks of 7 of a device's 12 rows: one scanned
    chunk and a remainder) against the model's plain mean loss in natural order on one device."""
    mesh = make_mesh(MESHES["fsdp2_sp2"])
    source = RandomWeights(preset("tiny"))
    params = load_parameters(source, mesh)
    tokens_np = np.random.default_rng(1).integers(0, 256, (2, 24))
    spec = StepSpec(config=source.config, mesh=mesh, dtype="fp32", remat="off", attention_backend="reference",
                    ring_variant="ring", loss_chunk_tokens=7, optimizer=OptimizerConfig())
    chunked, chunked_grads = jax.jit(jax.value_and_grad(next_token_loss), static_argnames="spec")(
        params, *sharded_batch(tokens_np, mesh), spec=spec)

    def plain_loss(params):
        tokens = jnp.asarray(tokens_np)
        return model_next_token_loss(Llama(source.config, params)(tokens), tokens)

    plain, plain_grads = jax.value_and_grad(plain_loss)({n: jnp.asarray(v) for n, v in source})
    np.testing.assert_allclose(float(chunked), float(plain), rtol=1e-6)  # summation order only
    chunked_grads = unstack_layers(chunked_grads)
    for name in ("output.weight", "layers.0.attention.wq.weight"):
        np.testing.assert_allclose(np.asarray(chunked_grads[name]), np.asarray(plain_grads[name]), rtol=1e-4,
                                   atol=1e-7, err_msg=name)  # float32 sums of ~100 terms in another order


@pytest.mark.slow
def test_bf16_compute_trains_close_to_fp32(weights_dir, single_device):
    run = _train(_settings(weights_dir, MeshShape(), dtype="bf16", stop_at=5), devices=jax.devices()[:1])
    # bf16 matmuls round activations to 8 bits of mantissa: losses of ~5 move by ~1e-2, not by 0.1.
    np.testing.assert_allclose(run.losses, single_device.losses[:5], rtol=0, atol=0.1)
    assert all(p.dtype == jnp.float32 for p in run.state["model"].values())  # fp32 master weights


def test_memory_plan_of_the_step_without_weights(capsys):
    # 4 emulated devices, the parameters split over all of them: fp32 weights + two AdamW moments, 12 bytes per
    # parameter over 4 devices, plus the batch's few KiB. (What checkpointing saves: tests/test_remat_jax.py's
    # test_remat_keeps_only_layer_inputs; the tiny preset's two layers are too few to show it.)
    settings = dataclasses.replace(_settings("tiny", MESHES["fsdp1_sp4"]), batch=1, seq_len=2048, dtype="bf16")
    plan = step_memory_plan(settings)
    state_bytes = 12 * preset("tiny").num_params / 4
    assert 0 < plan["arguments"] - state_bytes < 64 * 1024
    assert plan["aliased"] == state_bytes  # the donated state is updated in place
    assert 0 < plan["outputs"] - plan["aliased"] < 1024  # the loss and the grad norm
    assert plan["temporaries"] > 2048 // 4 * 128 * 2 * 2  # at least each layer's input activations
    assert train_main(["--backend", "jax", "--model", "tiny", "--seq-len", "64", "--steps", "1", "--mesh",
                       "fsdp=1,sp=4", "--batch", "1", "--plan-memory"]) == 0
    assert "XLA memory plan of the tiny train step, S=64" in capsys.readouterr().out
    assert train_main(["--backend", "torch", "--model", "tiny", "--seq-len", "64", "--steps", "1",
                       "--plan-memory"]) == 2
    assert "--plan-memory needs --backend jax" in capsys.readouterr().err


def test_the_state_stacks_the_layers_in_layer_order_and_unstacks_in_canonical_order():
    config = dataclasses.replace(preset("tiny"), num_layers=12)  # "layers.10" sorts before "layers.2" as text
    named = {name: np.full(shape, i, np.float32) for i, (name, shape) in enumerate(parameter_shapes(config).items())}
    shuffled = dict(sorted(named.items()))
    stacked = stack_layers(shuffled)
    wq = stacked["layers.*.attention.wq.weight"]
    assert wq.shape == (12, *named["layers.0.attention.wq.weight"].shape)
    assert [int(layer[0, 0]) for layer in wq] == [int(named[f"layers.{i}.attention.wq.weight"][0, 0])
                                                  for i in range(12)]
    assert list(unstack_layers(stack_layers(named))) == list(named)  # canonical order, as the checkpoint has it
    assert all(np.array_equal(unstack_layers(stacked)[name], value) for name, value in named.items())


def test_a_checkpoint_of_the_per_layer_state_layout_is_refused(tmp_path):
    """A training checkpoint written before the state stacked the layers (one array per layer weight, no
    "state_layout" in its metadata): one line naming the reason, before orbax's tree mismatch."""
    source = RandomWeights(preset("tiny"))
    state = {"model": load_parameters(source, make_mesh(MeshShape(), jax.devices()[:1]))}
    manager = checkpointing.open_manager(tmp_path, keep=1)
    old_state = {"model": {name: jnp.asarray(value) for name, value in source}}
    manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(old_state),
                                            meta=ocp.args.JsonSave({"step": 1})))
    manager.wait_until_finished()
    with pytest.raises(CheckpointError, match="one array per layer weight") as refused:
        checkpointing.load_checkpoint(manager, checkpointing.latest_checkpoint(tmp_path), state)
    assert "\n" not in str(refused.value)
    manager.close()


def test_optimizer_state_compiles_once_per_shape_and_sharding():
    """A compare launch builds one training after another: their optimizer states come from compiled zeros cached
    per (shape, sharding), so a second state compiles nothing (a function jitted anew per parameter compiled twice
    per parameter and training). Shapes of this test only, so that the negative control (the first state compiles,
    once per distinct shape and sharding) holds whatever ran before."""
    from compare.harness.worker_jax import backend_compiles

    mesh = make_mesh(MESHES["fsdp2_sp2"])
    rows, stacked = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    params = {"a": jax.device_put(jnp.ones((8, 13)), rows), "b": jax.device_put(jnp.ones((8, 13)), rows),
              "c": jax.device_put(jnp.ones((3, 8, 13)), stacked)}
    with backend_compiles() as first:
        state = init_optimizer_state(params)
    with backend_compiles() as second:
        init_optimizer_state(params)
    assert first["count"] == 2 and second["count"] == 0
    for name, param in params.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            value = state[moment][name]
            assert value.sharding == param.sharding and value.dtype == jnp.float32 and not np.asarray(value).any()


def test_bad_input_is_refused_before_training(weights_dir):
    with pytest.raises(BadInputError, match="needs 4 devices, but 2 are available"):
        _train(_settings(weights_dir, MESHES["fsdp2_sp2"]), devices=jax.devices()[:2])
    with pytest.raises(LayoutError, match="multiple of 8"):
        _train(dataclasses.replace(_settings(weights_dir, MESHES["fsdp1_sp4"]), seq_len=60))
    with pytest.raises(BadInputError, match="multiple of fsdp=2"):
        _train(dataclasses.replace(_settings(weights_dir, MESHES["fsdp2_sp2"]), batch=3))


def test_adamw_and_clipping_match_torch():
    """20 steps of our AdamW + clipping against torch.optim.AdamW + clip_grad_norm_ (decay on 2-D tensors only),
    with gradients large enough that clipping acts."""
    config = OptimizerConfig()
    rng = np.random.default_rng(0)
    start = {"w": rng.standard_normal((8, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    reference = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in start.items()}
    optimizer = torch.optim.AdamW([{"params": [reference["w"]], "weight_decay": config.weight_decay},
                                   {"params": [reference["b"]], "weight_decay": 0.0}],
                                  lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    params = {n: jnp.asarray(v) for n, v in start.items()}
    state = {"exp_avg": {n: jnp.zeros_like(v) for n, v in params.items()},
             "exp_avg_sq": {n: jnp.zeros_like(v) for n, v in params.items()}}
    for step in range(STEPS):
        grads = {n: (3 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in start.items()}
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate(step)
        for name, p in reference.items():
            p.grad = torch.from_numpy(grads[name].copy())
        torch_norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), config.grad_clip_norm)
        optimizer.step()
        clipped, norm = clip_gradients({n: jnp.asarray(g) for n, g in grads.items()}, config.grad_clip_norm)
        coefficients = {k: jnp.float32(v) for k, v in adamw_coefficients(config, step).items() if k != "lr"}
        params, state = adamw_update(params, clipped, state, coefficients, config)
        assert float(norm) == pytest.approx(float(torch_norm), rel=1e-6)
    for name, p in reference.items():
        # fp32 elementwise arithmetic in a slightly different operation order: a few ulps after 20 steps.
        np.testing.assert_allclose(np.asarray(params[name]), p.detach().numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_both_backends_write_the_same_train_jsonl(runs, weights_dir, tmp_path):
    """`twinflash train` with each backend on the same converted weights and batches (torch: 4 gloo processes it
    starts itself; JAX: this process's 4 devices, reusing the compiled step): the same record fields, the same
    per-step losses, and the JAX command's losses are the `run_training` ones."""
    common = ["--model", str(weights_dir), "--seq-len", str(SEQ_LEN), "--steps", str(STEPS),
              "--mesh", str(MESHES["fsdp2_sp2"]), "--batch", str(BATCH), "--attention-backend", "reference"]
    assert train_main(["--backend", "jax", *common, "--out", str(tmp_path / "jax")]) == 0
    torch_run = subprocess.run([sys.executable, "-m", "compare.commands.train", "--backend", "torch", *common,
                                "--out", str(tmp_path / "torch")], capture_output=True, text=True, timeout=600)
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    records = {backend: [json.loads(line) for line in (tmp_path / backend / "train.jsonl").read_text().splitlines()]
               for backend in ("jax", "torch")}
    assert [set(r) for r in records["jax"]] == [set(r) for r in records["torch"]]
    assert [r["step"] for r in records["jax"]] == [r["step"] for r in records["torch"]] == list(range(STEPS))
    np.testing.assert_array_equal([r["loss"] for r in records["jax"]], runs["fsdp2_sp2"].losses)
    np.testing.assert_allclose([r["loss"] for r in records["torch"]], [r["loss"] for r in records["jax"]],
                               rtol=0, atol=TWIN_ATOL)
    np.testing.assert_allclose([r["grad_norm"] for r in records["torch"]], [r["grad_norm"] for r in records["jax"]],
                               rtol=TWIN_ATOL, atol=0)  # norms of ~1-5: the same bound, relative


@pytest.mark.slow
def test_cli_trains_on_a_cpu_mesh_from_a_fresh_process(tmp_path):
    """`twinflash train --backend jax --mesh fsdp=2,sp=2` in a fresh interpreter without this session's XLA_FLAGS:
    JAX starts there with one CPU device, so the command must run the training where JAX has 4 (a child process)."""
    env = {name: value for name, value in os.environ.items() if name != "XLA_FLAGS"}
    command = [str(Path(sys.executable).with_name("twinflash")), "train", "--backend", "jax", "--mesh", "fsdp=2,sp=2",
               "--model", "tiny", "--seq-len", "16", "--steps", "2", "--batch", "2", "--attention-backend",
               "reference", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)


def test_load_parameters_reads_the_weights_once_with_host_arrays():
    # compare's JAX worker keeps one `host_arrays` dict per weights for all jobs of a launch: the second load must
    # read nothing from the source and give the same parameters (a source that counts its reads)
    source = RandomWeights(preset("tiny"), seed=0)
    reads = []

    class Counted:
        config = source.config
        names = source.names

        def tensor(self, name):
            reads.append(name)
            return source.tensor(name)

        def tensor_slice(self, name, index):
            reads.append(name)
            return source.tensor_slice(name, index)

    mesh = make_mesh(MeshShape(fsdp=2, sp=2))
    kept = {}
    first = load_parameters(Counted(), mesh, kept)
    count = len(reads)
    second = load_parameters(Counted(), mesh, kept)
    assert count > 0 and len(reads) == count
    for name in first:
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(second[name]))
    load_parameters(Counted(), mesh)  # negative control: without the dict every load reads again
    assert len(reads) == 2 * count
