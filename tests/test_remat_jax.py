"""JAX per-layer activation checkpointing (`jax_impl/remat.py`) on CPU: the modes change no number, "save-attention"
keeps each layer's attention forward out of the backward (one device, and the ring, Ulysses and hybrid schemes over
4 emulated devices; and the step lowered for GPUs through the Mosaic kernels; and, on GPUs, the step as XLA compiles
it), the scan's own backward equals JAX's transpose bit for bit, and checkpointing keeps only the layer inputs in
XLA's memory plan. Split from tests/test_train_jax.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_impl import model as model_module
from jax_impl.kernels import flash_attention as flash_attention_module
from jax_impl.kernels.flash_attention import flash_attention
from jax_impl.memory_plan import lowered_step
from jax_impl.model import Llama, load_model, parameter_dict, stack_layers
from jax_impl.model import next_token_loss as model_next_token_loss
from jax_impl.parallel import KERNEL_KNOBS, load_parameters, make_mesh, sharded_batch, step_compiler_options
from jax_impl.remat import checkpointed_layer, kept_layer
from jax_impl.train import StepSpec, next_token_loss
from weights import RandomWeights, preset
from weights.parallel import REMAT_MODES, MeshShape, checkpointed_layers
from weights.schedule import OptimizerConfig

SP4 = MeshShape(fsdp=1, sp=4)  # the 4 emulated devices (conftest) as one sequence-parallel axis


def _layer_gradient_fn(remat: str, tokens: jax.Array):
    """The gradient of the tiny model's loss with the Pallas kernel (interpreted on CPU) as its attention."""
    def loss(params):
        return model_next_token_loss(Llama(preset("tiny"), params, flash_attention, remat=remat)(tokens), tokens)

    return jax.grad(loss)


def test_remat_changes_nothing_numerically():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (1, 16)))
    params = parameter_dict(load_model("tiny"))
    grads = {mode: jax.jit(_layer_gradient_fn(mode, tokens))(params) for mode in REMAT_MODES}
    for mode in ("full", "save-attention"):
        assert grads[mode].keys() == params.keys()
        for name in params:  # the same fp32 operations recomputed: identical up to XLA fusing them differently
            np.testing.assert_allclose(grads[mode][name], grads["off"][name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{mode}: {name}")


@pytest.mark.parametrize("scheme", [None, ("ring", None), ("ulysses", None), ("hybrid", 2)],
                         ids=["one_device", "ring_sp4", "ulysses_sp4", "hybrid_sp4"])
def test_save_attention_does_not_rerun_the_attention_forward(scheme):
    """Forward kernel launches in the traced gradient (forward pass + backward pass, after remat's partial
    evaluation): "full" reruns each layer's attention forward in the backward, "save-attention" does not. With a
    scheme: the train step's loss, the scheme inside shard_map over 4 devices, Pallas kernels (Ulysses' residuals
    are its exchanged q, k, v, inside the shard_map: the rerun must still leave out the forward)."""
    if scheme is not None:
        mesh = make_mesh(SP4)
        source = RandomWeights(preset("tiny"))
        params = load_parameters(source, mesh)
        batch = sharded_batch(np.random.default_rng(1).integers(0, 256, (1, 32)), mesh)

        def gradient(remat):
            spec = StepSpec(config=source.config, mesh=mesh, dtype="fp32", remat=remat, attention_backend="pallas",
                            ring_variant="ring", loss_chunk_tokens=16, optimizer=OptimizerConfig(),
                            sp_scheme=scheme)
            return lambda params: jax.grad(next_token_loss)(params, *batch, spec=spec)
    else:
        params = parameter_dict(load_model("tiny"))
        tokens = jnp.zeros((1, 16), jnp.int32)

        def gradient(remat):
            return _layer_gradient_fn(remat, tokens)

    def forward_kernels(remat: str) -> int:
        return str(jax.make_jaxpr(gradient(remat))(params)).count("name=twinflash_forward")

    launches = {mode: forward_kernels(mode) for mode in REMAT_MODES}
    assert launches["off"] > 0
    assert launches["full"] == 2 * launches["off"]  # the negative control: full checkpointing does rerun them
    assert launches["save-attention"] == launches["off"]


@pytest.mark.parametrize("scheme", [("ring", None), ("ulysses", None)], ids=["ring_sp4", "ulysses_sp4"])
def test_save_attention_lowers_one_mosaic_forward_per_layer_for_gpus(scheme, monkeypatch):
    """The step as a GPU receives it: the gradient lowered for CUDA on this CPU machine, through the Hopper family
    (Mosaic GPU custom calls; the interpreter, which runs them on CPU, is switched off for the lowering), at head
    dim 64: the forward custom calls are as many under "save-attention" as without checkpointing, and twice as many
    under "full" (the negative control). JAX's Ulysses step on GPUs spent twice the ring's forward kernel time
    under save-attention (compare/results/schemes-2026-11-28-h200x2/RUN.md) while this lowering holds one forward:
    if it runs twice, XLA's GPU compile adds the run, below what a CPU test can see."""
    monkeypatch.setattr(flash_attention_module, "_interpret", lambda: False)
    mesh = make_mesh(SP4)
    source = RandomWeights(dataclasses.replace(preset("tiny"), head_dim=64, hidden_size=256))
    params = load_parameters(source, mesh)
    batch = sharded_batch(np.random.default_rng(1).integers(0, 256, (1, 256)), mesh)

    def forward_calls(remat: str) -> int:
        spec = StepSpec(config=source.config, mesh=mesh, dtype="bf16", remat=remat,
                        attention_backend="pallas_hopper", ring_variant="ring", loss_chunk_tokens=64,
                        optimizer=OptimizerConfig(), sp_scheme=scheme)
        gradient = jax.jit(lambda params: jax.grad(next_token_loss)(params, *batch, spec=spec))
        module = gradient.trace(params).lower(lowering_platforms=("cuda",)).as_text()
        return sum("stablehlo.custom_call @mosaic_gpu" in line and "twinflash_forward" in line
                   for line in module.splitlines())

    calls = {mode: forward_calls(mode) for mode in REMAT_MODES}
    assert calls["off"] > 0
    assert calls["full"] == 2 * calls["off"]
    assert calls["save-attention"] == calls["off"]


def _transposed_scan(layer, x, weights, *, mode, dtype=None, gather=None, layers=None):
    """The reference for `jax_impl.remat.checkpointed_scan` (the call `jax_impl.model` makes, for weights already
    in the compute dtype and gathered): a plain `jax.lax.scan` over the runs of layers, in each run one over its
    checkpointed layers and one over its kept ones, each layer reading its weights by index (as the forward of
    `checkpointed_scan`: a Python loop over a run's layers let XLA fuse across them and round bf16 elsewhere),
    whose backward is JAX's transpose."""
    assert dtype is None and gather is None
    layers = layers or checkpointed_layers(mode, jax.tree.leaves(weights)[0].shape[0])
    first_kept = layers.checkpointed_per_group
    kinds = [kind for kind in ((True, 0, first_kept), (False, first_kept, layers.group_size - first_kept)) if kind[2]]

    def run(x, group):
        for checkpointed, first, count in kinds:
            call = checkpointed_layer(layer, mode=mode) if checkpointed else kept_layer(layer)

            def one(x, index, call=call):
                w = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), weights)
                return call(x, w), None
            x = jax.lax.scan(one, x, group * layers.group_size + first + jnp.arange(count))[0]
        return x, None
    return jax.lax.scan(run, x, jnp.arange(layers.groups))[0]


@pytest.mark.parametrize("count", [None, 1, 3], ids=["all", "1_of_4", "3_of_4"])
@pytest.mark.parametrize("remat", ["save-attention", "full"])
def test_the_layer_scan_backward_gives_jax_transpose_numbers(remat, count, monkeypatch):
    """bf16 layers over fp32 stacks: the scan's own backward (`jax_impl.remat.checkpointed_scan`, which returns
    bf16 gradient stacks) against JAX's transpose of a plain scan (`_transposed_scan`) over the same stacks cast
    before it: the same bf16 operations, so the same fp32 gradients bit for bit; every layer checkpointed, or
    `count` of 4 (runs mixing checkpointed and kept layers, one kind with several layers a run); and with
    save-attention no attention forward is rerun (the forward kernels in the traced gradient: as many as JAX's
    transpose has)."""
    config = dataclasses.replace(preset("tiny"), num_layers=4)
    params = stack_layers({name: jnp.asarray(value) for name, value in RandomWeights(config)})
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 256, (1, 16)))

    def gradient(cast_in_layer: bool):
        def loss(params):
            weights = {name: p if cast_in_layer and name.startswith("layers.") else p.astype(jnp.bfloat16)
                       for name, p in params.items()}
            llama = Llama(config, weights, flash_attention, remat=remat,
                          layer_weight_dtype=jnp.bfloat16 if cast_in_layer else None,
                          checkpointed=checkpointed_layers(remat, config.num_layers, count))
            return model_next_token_loss(llama(tokens), tokens)
        return jax.grad(loss)

    def forwards(gradient) -> int:
        return str(jax.make_jaxpr(gradient)(params)).count("name=twinflash_forward")

    ours, our_forwards = jax.jit(gradient(True))(params), forwards(gradient(True))
    with monkeypatch.context() as patch:
        patch.setattr(model_module, "checkpointed_scan", _transposed_scan)
        theirs, their_forwards = jax.jit(gradient(False))(params), forwards(gradient(False))
    for name in params:
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name]), err_msg=name)
    assert our_forwards == their_forwards > 0


def test_remat_keeps_only_layer_inputs():
    # XLA's memory plan of the backward: 8 layers at 4k tokens, whose per-layer activations (the plain attention's
    # [8, 4k, 4k] scores, the MLP's [4k, 2048]) dwarf the layer inputs. A Python loop of `nnx.remat` layers passed
    # this on one GPU but not in the 8B train step, and on CPU not at all (XLA's plan was the same with and
    # without: ratio 0.99); the scan of checkpointed layers keeps a sixth.
    config = dataclasses.replace(preset("tiny"), hidden_size=512, intermediate_size=2048, num_layers=8,
                                 num_heads=8, num_kv_heads=8, head_dim=64)
    params = {name: jnp.asarray(array) for name, array in RandomWeights(config)}
    tokens = jnp.zeros((1, 4096), jnp.int32)

    def temp_bytes(remat: str) -> int:
        def loss(params):
            return model_next_token_loss(Llama(config, params, remat=remat)(tokens), tokens)

        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes("full") < 0.5 * temp_bytes("off")


def _check_some_layers_checkpointed(config, tokens, attention_fn, cast_in_layer: bool) -> dict:
    """`--checkpointed-layers` on `config` (4 layers): "full" checkpointing on 0, 1, 2, 3 or all of them (runs of
    1, 4, 2, 4 and 1 layers: `weights.parallel.checkpointed_layers`; the others `jax_impl.remat.kept_layer`s), in
    fp32 (JAX's transpose of the scan for none and all, the scan's own backward for the runs that mix both) or as
    bf16 layers over fp32 stacks (the scan's own backward throughout, the GPU step's). The gradients equal those
    of checkpointing every layer: in fp32 within float32 rounding of XLA's fusions; in bf16 within twice the
    distance between checkpointing every layer and none ("off", the model's loop of layers: the same operations,
    rounded to bf16 where XLA's fusions of recomputed and kept values differ). Returns XLA's temporary bytes per
    count (None: all)."""
    params = stack_layers({name: jnp.asarray(value) for name, value in RandomWeights(config)})
    dtype = jnp.bfloat16 if cast_in_layer else None

    def gradient(remat: str, count: int | None):
        def loss(params):
            weights = {name: p if remat != "off" and name.startswith("layers.") or dtype is None else p.astype(dtype)
                       for name, p in params.items()}
            llama = Llama(config, weights, attention_fn, remat=remat,
                          layer_weight_dtype=dtype if remat != "off" else None,
                          checkpointed=checkpointed_layers(remat, config.num_layers, count))
            return model_next_token_loss(llama(tokens), tokens)
        return jax.jit(jax.grad(loss))

    reference = gradient("full", None)(params)

    def error(grads) -> float:  # the largest difference from the reference, relative to each gradient's scale
        return max(float(jnp.max(jnp.abs(grads[n] - reference[n])) / jnp.max(jnp.abs(reference[n]))) for n in params)

    bound = 2 * error(gradient("off", None)(params)) if cast_in_layer else 1e-5
    plans = {None: gradient("full", None).lower(params).compile().memory_analysis().temp_size_in_bytes}
    for count in (0, 1, 2, 3):
        compiled = gradient("full", count).lower(params).compile()
        plans[count] = compiled.memory_analysis().temp_size_in_bytes
        # + 1e-6: a floor for when the checkpointed-vs-plain distance is 0 (float32 noise of the relative error)
        assert error(compiled(params)) <= bound + 1e-6, (count, error(compiled(params)), bound)
    return plans


@pytest.mark.parametrize("cast_in_layer", [False, True], ids=["fp32", "bf16_layers"])
def test_checkpointing_some_layers_changes_nothing_numerically_and_keeps_their_activations(cast_in_layer):
    """`_check_some_layers_checkpointed` with plain attention, and XLA's memory plan: checkpointing none of the
    layers (each keeping its matmuls' outputs) plans more than checkpointing all (the negative control of a count
    that did nothing), and more than checkpointing 3 of 4, whose run of 4 layers walks its backward one layer at a
    time. (Before `jax_impl.remat.checkpointed_scan` scanned a run's layers, its backward held every layer's
    backward values of the run at once: 3 of 4 planned 1.7 to 1.9 times none. Fewer checkpointed layers can still
    plan more than none in this small model, whose plain attention's [S, S] scores outweigh the rest: a
    checkpointed layer's recomputation beside the kept layers' values exceeds what a kept layer saves.)"""
    config = dataclasses.replace(preset("tiny"), hidden_size=256, intermediate_size=1024, num_layers=4,
                                 num_heads=4, num_kv_heads=4, head_dim=64)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (1, 1024)))
    plans = _check_some_layers_checkpointed(config, tokens, None, cast_in_layer)
    assert plans[0] > plans[None], plans
    assert plans[0] > plans[3], plans


@pytest.mark.gpu
def test_gpu_checkpointing_some_layers_with_the_mosaic_kernels():
    """The same on one GPU through the Mosaic kernels (bf16, D=128, GQA 4, 4k tokens), the 8B step's path, whose
    per-layer values there are linear in the tokens: the plan grows as fewer layers are checkpointed (none > two >
    all)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs a GPU")
    config = dataclasses.replace(preset("tiny"), hidden_size=1024, intermediate_size=3584, num_layers=4,
                                 num_heads=8, num_kv_heads=2, head_dim=128)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 256, (1, 4096)))
    attention = functools.partial(flash_attention, causal=True, backend="pallas_hopper")
    plans = _check_some_layers_checkpointed(config, tokens, attention, True)
    assert plans[0] > plans[2] > plans[None], plans


def _mosaic_calls(hlo_text: str, kernel: str) -> int:
    """The Mosaic GPU custom calls of `kernel` (the kernel's name in their op names) in optimized HLO text."""
    return sum('custom_call_target="mosaic_gpu' in line and f"/{kernel}/" in line for line in hlo_text.splitlines())


@pytest.mark.gpu
@pytest.mark.parametrize("fusion_on", [False, True], ids=["step_options", "dynamic_slice_fusion_on"])
@pytest.mark.parametrize("scheme", ["one_device", "ring", "ulysses"])
def test_gpu_save_attention_compiles_one_forward_per_dq_kernel(scheme, fusion_on):
    """The train step as XLA compiles it for these GPUs (1B shape, 2 layers, 8k tokens; nothing run), under
    "save-attention": every attention block has one forward and one kernel computing dQ (the dQ kernel of the
    two-kernel backward, or the one kernel of the heuristic's one-kernel form), so the optimized HLO holds as many
    Mosaic forward calls as dQ calls (in the layer loops, or unrolled: either way). With the step's own options
    (`jax_impl.parallel.step_compiler_options`) they are equal. Negative control: with XLA's dynamic-slice fusion
    on (jax 0.11.2's default), the forward whose out and lse the layer scan stacks is copied into the fusion and
    kept for its other users, on one device and in Ulysses (the ring saves its merge's out and lse, not a kernel's:
    equal either way). A failing control means this XLA no longer copies: `KERNEL_KNOBS` may go."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    sp = 1 if scheme == "one_device" else 2
    if len(gpus) < sp:
        pytest.skip(f"needs {sp} GPUs")
    config = dataclasses.replace(preset("llama3.2-1b"), num_layers=2)
    mesh = make_mesh(MeshShape(fsdp=1, sp=sp), gpus[:sp])
    options = step_compiler_options("gpu", True, "")
    if fusion_on:  # the kernel knobs' values turned over: the fusion back on
        kernel = {name for knob in KERNEL_KNOBS for name, _ in knob}
        options = tuple((name, not value if name in kernel else value) for name, value in options)
    spec = StepSpec(config=config, mesh=mesh, dtype="bf16", remat="save-attention", attention_backend="pallas",
                    ring_variant="ring", loss_chunk_tokens=2048, optimizer=OptimizerConfig(),
                    sp_scheme=("ring" if scheme == "one_device" else scheme, None), compiler_options=options)
    text = lowered_step(spec, 1, 8192).compile().as_text()
    forwards = _mosaic_calls(text, "twinflash_forward_hopper")
    dq = sum(_mosaic_calls(text, kernel) for kernel in ("twinflash_backward_dq_hopper",
                                                         "twinflash_backward_dkdv_dq_hopper"))
    assert dq > 0
    if fusion_on and scheme != "ring":
        assert forwards > dq, f"{forwards} forward calls, {dq} dQ calls: this XLA no longer copies the forward"
    else:
        assert forwards == dq, f"{forwards} forward calls, {dq} dQ calls"
