"""Distributed Llama training for the JAX backend: the sequence-sharded next-token loss, AdamW with global grad-norm
clipping, the jitted train step and the training loop. Twin of `torch_impl/train.py`. Mesh, shardings and the data
split are `jax_impl/parallel.py`; checkpoints and weight export are `jax_impl/checkpointing.py`; the
`twinflash train` command that builds the batches and reports the steps is `compare/commands/train.py`.

Numerics both backends follow, so that their per-step losses agree (fp32):
  loss       sum of next-token cross-entropy over the valid target positions of the whole global batch, divided by
             their global count. Each device sums over its own tokens inside `jax.shard_map` (the sequence-sharded
             hidden states never leave their device), the sums are `psum`-ed, autodiff does the rest. The logits
             are made chunk by chunk of the device's rows (`loss_chunk_tokens` at a time, `lax.scan` over
             `jax.checkpoint`-ed chunks, so they are recomputed in the backward): neither the full [S, V] nor the
             local [S_local, V] logits ever exist at once.
  clipping   global L2 norm of all gradients; every gradient is multiplied by min(1, max_norm / (norm + 1e-6)),
             torch's clip_grad_norm_ formula (optax's clip_by_global_norm divides by the norm without the 1e-6).
  AdamW      torch.optim.AdamW semantics: p *= 1 - lr * wd (2-D parameters only) before the Adam update;
             m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t)
             + eps) with t = step + 1; lr = OptimizerConfig.learning_rate(step). The scalar coefficients are
             computed on the host in float64 each step, as torch does, and enter the jitted step as float32
             arguments (no recompilation when they change). Written out rather than optax so the arithmetic is
             torch's operation for operation.
  precision  fp32 master weights and optimizer state; with bf16 the loss casts the (sharded) parameters to bf16
             before use, so the gathers move bf16 and the gradients come back fp32 through the cast. A device's
             sums over its tokens accumulate in float32 as torch's do: the matmuls', and the RMSNorm weights' and
             the embedding's gradients (`jax_impl/model.py`; summed in bf16 they lost ~5x more than torch's,
             tests/test_train_precision.py). Unlike the torch twin (FSDP2 reduce_dtype=fp32), the cross-device
             sums of the weight gradients happen in bf16 and the optimizer gets their bf16-rounded value: XLA
             reduces a gradient where its matmul contracts over the sharded batch/sequence dims, in the dtype of
             the bf16 weight's cotangent (an fp32 sum needs a matmul whose backward sees the fp32 master, with the
             layer scan's gradient stacks kept bf16 for memory). On sp=2 a bf16 sum of two bf16 partial gradients
             is one rounding of their exact sum; emulated on the torch side it moved the loss by 0.024 % (mean over
             20 steps, 1B width cut to 2 layers, 256 tokens, CPU), a third of either backend's attention-kernel
             floor there (compare/results/bf16-drift-check-2026-11-23-cpu.json). fp32 runs are unaffected.
             With fp8 (bf16 only) the decoder layers' linears run `fp8_matmul` (`convert_to_fp8`, weights/fp8.py).

Weights for the compute: each parameter is cast to the compute dtype in its fp32 shard and constrained to be
replicated where it is used, so XLA all-gathers it over the mesh and reduce-scatters its gradient back into the
fp32 shard. (Leaving the weights sharded inside the layers instead lets XLA's sharding propagation pick the
weights' row sharding for activations in the backward, which it then undoes by replicating whole activations:
"involuntary full rematerialization".) With activation checkpointing (`weights_regathered_for_backward`, as the
torch twin's FSDP2) the scan over the decoder layers runs over the training state's own stacked fp32 shards, and
each checkpointed layer casts and gathers its own slice (`Llama`'s `layer_weight_dtype`, `gather_layer_weight`),
in the forward and again in the backward: one layer's gathered weights and their gradient are live at a time. The
scan's backward (`jax_impl.remat.checkpointed_scan`) returns the weights' gradients as a compute-dtype stack beside
the stacked saved activations, converted to fp32 once the loop is done (JAX's transpose of the scan would hold the
fp32 stack there). Temporaries per device of the Llama-3.1-8B step at 32k tokens on 2 devices (save-attention, CPU
plans), the structures this replaced being `LAYER_WEIGHTS`'s others: the whole model cast and gathered before the
first layer (every run before issue 19) kept it, and the gradients of all of it, on every device for the whole
step: 64.4 GiB (bf16); a compute-dtype copy of every layer's shards stacked for the scan, which returned stacked
compute-dtype gradients (issue 19's first fix): 36.2 GiB (bf16), 64.5 (fp32); the scan over the state's own stacks
with JAX's transpose: 35.0 GiB (bf16), 51.5 (fp32); with `checkpointed_scan`: 28.6 GiB (bf16). Without
checkpointing the whole model is gathered once, before the layers; the embedding, the final norm and the LM head
always are.

The step is one `jax.jit` over the global (sharded) arrays, compiled once per `StepSpec`; the training state it
donates and returns is {"model": {name: param}, "optimizer": {"exp_avg": {...}, "exp_avg_sq": {...}}}, each leaf
sharded like its parameter, the decoder layers' weights stacked over the layers under "layers.*.<suffix>"
(`jax_impl.model.stack_layers`; `unstack_layers` gives them by canonical name).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_impl import checkpointing
from jax_impl.attention import AttentionFn
from jax_impl.model import DTYPES, Llama, convert_to_fp8, is_stacked, unstack_layers
from jax_impl.parallel import (Option, load_parameters, make_mesh, mesh_shape, parameter_shardings,
                               sequence_parallel_fn, sharded_batch, sharded_packed_batch, state_shapes,
                               step_compiler_options)
from jax_impl.profiling import StepProfiler, region
from weights import ConvertedCheckpoint, LlamaConfig, RandomWeights, open_weights
from weights.parallel import (ACTIVATION_SHARDING, MESH_AXES, checkpointed_layers, scheme_layout,
                              weights_regathered_for_backward)
from weights.fp8 import fallback_line, fp8_linears
from weights.profiling import profiled_steps
from weights.schedule import OptimizerConfig
from weights.settings import TrainSettings
from weights.checkpoint_integrity import set_aside
from weights.training import (IGNORE_INDEX, adamw_coefficients, check_attention_backend, check_batches,
                              check_step_finite, checkpoint_due, checkpoint_to_resume, default_loss_chunk_tokens,
                              host_peak_rss_bytes, print_to_stderr, run_metadata, valid_target_count)

State = dict[str, dict]
StepCallback = Callable[..., None]


# --- loss ---------------------------------------------------------------------------------------------------------

def _chunk_cross_entropy_sum(hidden: jax.Array, head: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 cross-entropy sum of rows hidden [T, hidden] against targets [T] (IGNORE_INDEX rows count 0); the
    logits are the model's (`Llama.logits`: compute-dtype matmul, float32 result)."""
    logits = jnp.einsum("th,vh->tv", hidden, head).astype(jnp.float32)
    valid = targets != IGNORE_INDEX
    picked = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(valid, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0))


def cross_entropy_sum(hidden: jax.Array, head: jax.Array, targets: jax.Array, chunk_tokens: int) -> jax.Array:
    """float32 sum of next-token cross-entropy over the rows of hidden [B, S, hidden] (one device's) whose target
    [B, S] is not IGNORE_INDEX, `chunk_tokens` rows at a time, each chunk's logits recomputed in the backward."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    chunk = jax.checkpoint(_chunk_cross_entropy_sum)
    full = hidden.shape[0] // chunk_tokens * chunk_tokens
    # zeros_like keeps the targets' varying-over-mesh-axes type, which the scan's carry must have inside shard_map.
    total = jnp.zeros_like(targets[0], jnp.float32)
    if full:
        chunks = (hidden[:full].reshape(-1, chunk_tokens, hidden.shape[-1]), targets[:full].reshape(-1, chunk_tokens))
        total, _ = jax.lax.scan(lambda acc, xs: (acc + chunk(xs[0], head, xs[1]), None), total, chunks)
    if full < hidden.shape[0]:
        total = total + chunk(hidden[full:], head, targets[full:])
    return total


def sharded_cross_entropy_sum(hidden: jax.Array, head: jax.Array, targets: jax.Array, mesh: Mesh,
                              chunk_tokens: int) -> jax.Array:
    """`cross_entropy_sum` of GLOBAL hidden [B, S, hidden] / targets [B, S] sharded (fsdp, sp): every device
    reduces its own rows against the whole (gathered) LM head, then the sums are added over the mesh."""
    rows = PartitionSpec(*ACTIVATION_SHARDING["hidden"])
    local_sum = jax.shard_map(
        lambda h, w, t: jax.lax.psum(cross_entropy_sum(h, w, t, chunk_tokens), MESH_AXES),
        mesh=mesh, in_specs=(rows, PartitionSpec(), PartitionSpec(*ACTIVATION_SHARDING["tokens"])),
        out_specs=PartitionSpec())
    return local_sum(hidden, head, targets)


LAYER_WEIGHTS = {
    "in-layer": "each checkpointed layer casts its slice of the state's stacked fp32 shards and gathers it",
    "stacked-copy": "the stacked fp32 shards are cast to the compute dtype before the layers (a stacked copy, and "
                    "stacked compute-dtype gradients), each checkpointed layer gathers its slice",
    "whole-model": "the whole model is cast and gathered before the first layer",
}


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything static about a train step (hashable: the jit cache key, one compilation per spec)."""

    config: LlamaConfig
    mesh: Mesh
    dtype: str
    remat: str  # a weights.parallel.REMAT_MODES key
    attention_backend: str
    ring_variant: str
    loss_chunk_tokens: int
    optimizer: OptimizerConfig
    fp8: bool = False  # the decoder layers' linears in FP8 (`convert_to_fp8`, weights/fp8.py's recipe)
    # a LAYER_WEIGHTS key: where a checkpointed step makes the layers' compute weights (the other keys are the
    # structures issue 19 replaced: tests/test_train_memory.py's negative controls)
    layer_weights: str = "in-layer"
    # a step whose loss or grad norm is not finite returns the state it was given (--skip-non-finite-steps)
    skip_non_finite: bool = False
    sp_scheme: tuple[str, int | None] = ("ring", None)  # (--sp-scheme, --ulysses-degree) of sequence_parallel_fn
    # XLA options the step is compiled with (`jax_impl.parallel.step_compiler_options`): (name, value) pairs
    compiler_options: tuple[Option, ...] = ()
    # a hashable callable that wraps the model's attention function (`fn -> fn`): the harness's hook for its
    # negative controls (compare/harness/perturb.py); None in training
    attention_wrapper: Callable[[AttentionFn], AttentionFn] | None = None
    # packed documents (`TrainSettings.pack`): the step given segment ids, the attention in `scheme_layout`'s layout
    # (the ring's PACKED_RING_LAYOUT; RING_LAYOUT for Ulysses and hybrid)
    pack: bool = False
    checkpointed_layers: int | None = None  # how many layers `remat` applies to (None: all; --checkpointed-layers)


def next_token_loss(params: dict[str, jax.Array], tokens: jax.Array, targets: jax.Array, positions: jax.Array,
                    spec: StepSpec, with_logits: bool = False, segment_ids: jax.Array | None = None):
    """Mean next-token cross-entropy of the global batch (module docstring), from float32 master `params` in the
    training state's layout (the decoder layers' weights stacked); with `with_logits`, (loss, float32 logits
    [B, S, vocab] in the batch's layout order, outside autodiff) for checks on short sequences. `segment_ids`:
    packed documents (`spec.pack`), for the attention; the loss then averages over the targets the documents
    leave (`sharded_packed_batch` ends them at each document's last token)."""
    dtype = DTYPES[spec.dtype]
    replicated = NamedSharding(spec.mesh, PartitionSpec())

    def gather(weight: jax.Array) -> jax.Array:
        return jax.lax.with_sharding_constraint(weight, replicated)

    def compute(weight: jax.Array) -> jax.Array:
        return gather(weight.astype(dtype))

    structure = spec.layer_weights if weights_regathered_for_backward(spec.remat) else "whole-model"
    in_layer = {"layer_weight_dtype": dtype if structure == "in-layer" else None,
                "gather_layer_weight": None if structure == "whole-model" else gather}
    if structure == "whole-model":
        weights = {name: compute(p) for name, p in unstack_layers(params).items()}
    else:
        copy = structure == "stacked-copy"
        weights = {name: (p.astype(dtype) if copy else p) if is_stacked(name) else compute(p)
                   for name, p in params.items()}
    attention = sequence_parallel_fn(spec.mesh, *spec.sp_scheme, backend=spec.attention_backend,
                                     variant=spec.ring_variant, layout=scheme_layout(spec.sp_scheme[0], spec.pack))
    if spec.attention_wrapper is not None:
        attention = spec.attention_wrapper(attention)
    llama = Llama(spec.config, weights, attention, remat=spec.remat, **in_layer,
                  checkpointed=checkpointed_layers(spec.remat, spec.config.num_layers, spec.checkpointed_layers))
    if spec.fp8:
        devices = mesh_shape(spec.mesh)  # each device's activations scaled on their own, as torch's ranks do
        convert_to_fp8(llama, fp8_linears(spec.config)[0], token_blocks=(devices.fsdp, devices.sp))
    hidden = llama.hidden_states(tokens, positions, segment_ids)
    head = weights["tok_embeddings.weight" if spec.config.tie_word_embeddings else "output.weight"]
    valid_count = valid_target_count(*tokens.shape) if segment_ids is None else jnp.sum(targets != IGNORE_INDEX)
    with region("loss"):
        loss = sharded_cross_entropy_sum(hidden, head, targets, spec.mesh, spec.loss_chunk_tokens) / valid_count
    if not with_logits:
        return loss
    return loss, jax.lax.stop_gradient(llama.logits(hidden).astype(jnp.float32))


# --- optimizer ----------------------------------------------------------------------------------------------------

def clip_gradients(grads: dict[str, jax.Array], max_norm: float) -> tuple[dict[str, jax.Array], jax.Array]:
    """(grads scaled by min(1, max_norm / (norm + 1e-6)), the global L2 norm before clipping): torch's formula.
    The squares are summed tensor by tensor (a stacked layer weight's layer by layer) in the order of the sorted
    canonical names, the order of a per-name gradient dict out of JAX, so that the norm does not depend on the
    training state's layout."""
    squares = [jnp.sum(jnp.square(g.astype(jnp.float32))) for _, g in sorted(unstack_layers(grads).items())]
    norm = jnp.sqrt(sum(squares))
    scale = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return {name: g * scale for name, g in grads.items()}, norm


@functools.partial(jax.jit, static_argnums=(0, 1))
def _sharded_zeros(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> jax.Array:
    """float32 zeros made on the devices in `sharding`. One compilation per shape and sharding for the process: a
    compare launch builds many trainings of one model, and a function jitted anew per parameter and training
    compiled ~24 times each time."""
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, jnp.float32), sharding)


def init_optimizer_state(params: dict[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
    """float32 zeros `exp_avg` and `exp_avg_sq` per parameter, sharded like it (made on the devices)."""
    return {"exp_avg": {n: _sharded_zeros(p.shape, p.sharding) for n, p in params.items()},
            "exp_avg_sq": {n: _sharded_zeros(p.shape, p.sharding) for n, p in params.items()}}


def adamw_update(params: dict[str, jax.Array], grads: dict[str, jax.Array], state: dict[str, dict[str, jax.Array]],
                 coefficients: dict[str, jax.Array], config: OptimizerConfig
                 ) -> tuple[dict[str, jax.Array], dict[str, dict[str, jax.Array]]]:
    """One torch.optim.AdamW step (module docstring); weight decay on 2-D parameters only (per layer, for the stacked
    decoder-layer weights). `coefficients` are the step's host scalars (`weights.training.adamw_coefficients`,
    without "lr") as float32 arrays."""
    new_params, exp_avg, exp_avg_sq = {}, {}, {}
    for name, p in params.items():
        g = grads[name]
        if p.ndim - is_stacked(name) == 2:
            p = p * coefficients["decay"]
        m = state["exp_avg"][name] + (1 - config.beta1) * (g - state["exp_avg"][name])  # torch's lerp
        v = state["exp_avg_sq"][name] * config.beta2 + (1 - config.beta2) * g * g
        denom = jnp.sqrt(v) / coefficients["bias_correction2_sqrt"] + config.eps
        new_params[name] = p - coefficients["step_size"] * (m / denom)
        exp_avg[name], exp_avg_sq[name] = m, v
    return new_params, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


# --- the step -----------------------------------------------------------------------------------------------------

def _train_step(state: State, tokens: jax.Array, targets: jax.Array, positions: jax.Array,
                coefficients: dict[str, jax.Array], spec: StepSpec, segment_ids: jax.Array | None = None
                ) -> tuple[State, jax.Array, jax.Array]:
    """(new state, loss, grad norm before clipping) of one optimizer step on a global batch."""
    loss, grads = jax.value_and_grad(next_token_loss)(state["model"], tokens, targets, positions, spec,
                                                      segment_ids=segment_ids)
    with region("optimizer"):
        grads, grad_norm = clip_gradients(grads, spec.optimizer.grad_clip_norm)
        params, optimizer = adamw_update(state["model"], grads, state["optimizer"], coefficients, spec.optimizer)
    if spec.skip_non_finite:
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, optimizer = jax.tree.map(lambda new, old: jnp.where(finite, new, old), (params, optimizer),
                                         (state["model"], state["optimizer"]))
    shardings = parameter_shardings(spec.mesh, state_shapes(spec.config))
    keep = functools.partial(jax.tree.map, jax.lax.with_sharding_constraint)
    return {"model": keep(params, shardings),
            "optimizer": {k: keep(v, shardings) for k, v in optimizer.items()}}, loss, grad_norm


@functools.lru_cache(maxsize=4)
def _jitted_step(compiler_options: tuple[Option, ...]):
    """The step jitted with these XLA options (a jit takes its options once: one jit per option set); the training
    state is donated, its buffers reused for the new one."""
    return jax.jit(_train_step, static_argnames=("spec",), donate_argnames=("state",),
                   compiler_options=dict(compiler_options) or None)


class _TrainStep:
    """`train_step(state, tokens, targets, positions, coefficients, spec=spec)`: (new state, loss, grad norm before
    clipping) of one optimizer step on a global batch (and its `segment_ids` when `spec.pack`), jitted (one
    compilation per `StepSpec`) with the spec's XLA options; `train_step.lower(...)` as a jitted function's."""

    def __call__(self, state: State, tokens: jax.Array, targets: jax.Array, positions: jax.Array,
                 coefficients: dict[str, jax.Array], *, spec: StepSpec, segment_ids: jax.Array | None = None
                 ) -> tuple[State, jax.Array, jax.Array]:
        return _jitted_step(spec.compiler_options)(state, tokens, targets, positions, coefficients, spec=spec,
                                                   segment_ids=segment_ids)

    def lower(self, *args, spec: StepSpec, segment_ids: jax.Array | None = None):
        return _jitted_step(spec.compiler_options).lower(*args, spec=spec, segment_ids=segment_ids)


train_step = _TrainStep()


def step_scalars(coefficients: dict[str, float]) -> dict[str, jax.Array]:
    """The jitted step's float32 arguments from `weights.training.adamw_coefficients` (all but "lr")."""
    return {k: jnp.float32(v) for k, v in coefficients.items() if k != "lr"}


# --- the loop -----------------------------------------------------------------------------------------------------

def peak_memory_bytes(mesh: Mesh) -> list[int]:
    """Per device: peak bytes in use where the runtime reports it (GPU), else each process's peak host RSS. A
    process reads its own devices only; a run spanning processes gathers every process's numbers."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in local]
    mine = [int(p) for p in peaks] if all(p is not None for p in peaks) else [host_peak_rss_bytes()]
    if jax.process_count() == 1:
        return mine
    return [int(p) for p in np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int64))).flat]


def init_distributed(coordinator: str, process_count: int, process_index: int, timeout_s: float) -> None:
    """Joins a run spanning `process_count` processes (one per node; call it before anything else uses JAX):
    `jax.distributed.initialize` with the coordination service at `coordinator` (HOST:PORT, hosted by process 0),
    the rendezvous, the heartbeat that notices a dead process and the shutdown barrier each bounded by
    `timeout_s`; on CPU the processes' collectives run over gloo. Afterwards `jax.devices()` lists every
    process's devices. Twin of torch's `init_distributed` (the torchrun-launched process group)."""
    # gloo is jax 0.10's default already. The preemption service turns SIGTERM into a notice the process outlives;
    # here SIGTERM must end it (how the launch that started it stops it). Either option may be gone in a version.
    for option, value in (("jax_cpu_collectives_implementation", "gloo"), ("jax_enable_preemption_service", False)):
        try:
            jax.config.update(option, value)
        except AttributeError:
            pass
    seconds = max(1, int(timeout_s))
    timeouts = {"initialization_timeout": seconds, "heartbeat_timeout_seconds": seconds,
                "shutdown_timeout_seconds": seconds}
    accepted = inspect.signature(jax.distributed.initialize).parameters  # jax 0.10 and 0.11 take all three
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=process_count,
                               process_id=process_index, **{k: v for k, v in timeouts.items() if k in accepted})


def _resume_point(settings: TrainSettings, meta: dict) -> tuple[Path | None, int]:
    """(checkpoint to resume from or None, its step). Process 0 verifies the checkpoints' checksums (one pass over
    the files, not one per process), sets aside those it passes over, and the other processes resume from the step
    it found (the torch twin's rank 0 broadcasts the same)."""
    latest, start = None, 0
    if jax.process_index() == 0:
        latest, start, passed_over = checkpoint_to_resume(settings, meta, checkpointing.completed_checkpoints,
                                                          checkpointing.read_metadata, warn=print_to_stderr)
        set_aside(list(passed_over))  # before the manager lists the steps: the resumed run saves under their names
    if jax.process_count() > 1:
        start = int(multihost_utils.broadcast_one_to_all(np.int64(start)))
        if jax.process_index() != 0 and start:
            latest = settings.ckpt_dir.absolute() / checkpointing.step_dir_name(start)
        multihost_utils.sync_global_devices("twinflash resume point")  # process 0's renames are done
    return latest, start


@dataclasses.dataclass
class Training:
    """A model ready to train over a mesh: the step's static `spec`, the training `state` (fp32 parameters and
    AdamW state, sharded), the weights it was loaded from and the run metadata its checkpoints record."""

    mesh: Mesh
    spec: StepSpec
    state: State
    source: ConvertedCheckpoint | RandomWeights
    meta: dict


def build_training(settings: TrainSettings, devices: Sequence[jax.Device] | None = None,
                   host_arrays: dict | None = None) -> Training:
    """The sharded parameters and optimizer state of `settings` over `devices` (default: all of JAX's), loaded from
    `settings.model` (`host_arrays`: `load_parameters`'); no checkpoint read, nothing trained."""
    check_attention_backend(settings)
    mesh = make_mesh(settings.mesh, devices)
    source = open_weights(settings.model, settings.seed)
    params = load_parameters(source, mesh, host_arrays)
    state = {"model": params, "optimizer": init_optimizer_state(params)}
    return Training(mesh, step_spec(settings, source.config, mesh), state, source,
                    run_metadata(settings, source.config))


def step_spec(settings: TrainSettings, config: LlamaConfig, mesh: Mesh) -> StepSpec:
    """The jitted step's static description for `settings` on `mesh`."""
    return StepSpec(config=config, mesh=mesh, dtype=settings.dtype, remat=settings.activation_checkpointing,
                    attention_backend=settings.attention_backend, ring_variant=settings.ring_variant,
                    loss_chunk_tokens=settings.loss_chunk_tokens or default_loss_chunk_tokens(config.vocab_size),
                    optimizer=settings.optimizer, fp8=settings.fp8, skip_non_finite=settings.skip_non_finite_steps,
                    sp_scheme=(settings.sp_scheme, settings.ulysses_degree), pack=settings.pack,
                    checkpointed_layers=settings.checkpointed_layers,
                    compiler_options=step_compiler_options(mesh.devices.flat[0].platform, settings.xla_overlap,
                                                           os.environ.get("XLA_FLAGS", "")))




def run_training(settings: TrainSettings, batches: np.ndarray, on_step: StepCallback | None = None,
                 devices: Sequence[jax.Device] | None = None, on_profile: Callable[[dict], None] | None = None,
                 segment_ids: np.ndarray | None = None) -> State:
    """Trains `settings.model` on `batches` (int64 [steps, batch, seq_len], the global batches; with `settings.pack`
    on the packed documents of `segment_ids`, `weights.data.training_segment_ids`) in this process over
    `devices` (default: all of JAX's, whose count must match `settings.mesh`); see `weights.settings.TrainSettings`
    for the fields read here. Calls `on_step(step=, loss=, lr=, grad_norm=, seconds=,
    peak_memory_bytes=[per device])` after every step. Resumes from the latest checkpoint with `settings.resume`,
    saves every `settings.ckpt_every` steps and at the end of the run, exports the final weights to
    `settings.export_paths` when set. Returns the final training state. Bad input (mesh, batch shape, checkpoint)
    raises BadInputError before anything is computed or written. A step with a non-finite loss or grad norm stops
    the run unsaved (NonFiniteStepError), or with `settings.skip_non_finite_steps` leaves the state unchanged.
    With `settings.profile`, traces the last steps (`weights.profiling.profiled_steps`) and calls
    `on_profile(breakdown)` at the end (`jax_impl/profiling.py`)."""
    check_batches(settings, batches, segment_ids)
    run = build_training(settings, devices)
    mesh, spec, state, meta = run.mesh, run.spec, run.state, run.meta
    if settings.fp8 and jax.process_index() == 0 and fallback_line(spec.config) is not None:
        print_to_stderr(fallback_line(spec.config))
    latest, start = _resume_point(settings, meta)
    manager = None if settings.ckpt_dir is None else checkpointing.open_manager(settings.ckpt_dir, settings.keep)
    try:
        if latest is not None:
            state = checkpointing.load_checkpoint(manager, latest, state)
            print(f"resumed from {latest} (step {start})", flush=True)
        stop = settings.stop_at or batches.shape[0]
        profiler = StepProfiler(profiled_steps(start, stop) if settings.profile else range(0))
        for step in range(start, stop):
            began = time.perf_counter()
            profiler.begin(step)
            if segment_ids is None:
                (tokens, targets, positions), ids = sharded_batch(batches[step], mesh), None
            else:
                tokens, targets, positions, ids = sharded_packed_batch(batches[step], segment_ids[step], mesh,
                                                                       scheme_layout(settings.sp_scheme, True))
            coefficients = adamw_coefficients(settings.optimizer, step)
            state, loss, grad_norm = train_step(state, tokens, targets, positions, step_scalars(coefficients),
                                                spec=spec, segment_ids=ids)
            loss = float(loss)  # synchronises the devices: the step's time is complete
            profiler.end(step)
            seconds = time.perf_counter() - began
            grad_norm = float(grad_norm)
            peaks = peak_memory_bytes(mesh)  # in every process: collective in a run spanning processes
            if on_step is not None:
                on_step(step=step, loss=loss, lr=coefficients["lr"], grad_norm=grad_norm, seconds=seconds,
                        peak_memory_bytes=peaks)
            skipped = check_step_finite(settings, step, loss, grad_norm, latest)  # raises unless skipping
            if skipped is not None:
                print_to_stderr(skipped)
            if checkpoint_due(settings, step + 1, stop):
                checkpointing.save_checkpoint(manager, step + 1, state, meta)
                latest = settings.ckpt_dir / checkpointing.step_dir_name(step + 1)
        if settings.profile and on_profile is not None:  # the step compiled before: its HLO comes from the cache
            on_profile(profiler.breakdown(train_step.lower(state, tokens, targets, positions, step_scalars(
                coefficients), spec=spec, segment_ids=ids).compile().as_text()))
    finally:
        if manager is not None:
            checkpointing.close_manager(manager)  # waits for a save in flight; raises if it failed
    if settings.export_paths is not None:
        checkpointing.export_trained_weights(state["model"], spec.config, *settings.export_paths, run.source)
    return state
