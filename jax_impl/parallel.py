"""Parallelism for the JAX backend: the 2-D device mesh (`fsdp` x `sp`), the `NamedSharding` of every parameter and
activation built from the shared tables in `weights/parallel.py`, the ring attention wrapped in `jax.shard_map` as
the model's attention function, and a global batch placed on the mesh. Twin of `torch_impl/parallel.py`
(DeviceMesh, FSDP2 `fully_shard`, the ring's sub-group there).

How the pieces fit:
  mesh        `make_mesh` builds the (fsdp, sp) mesh, names from `weights.parallel.MESH_AXES`, Auto axis types,
              device (f, s) the one `MeshShape.rank_grid` places there in the process-by-process order (the
              torch twin's ranks): the sp ring inside a node by default.
  data        tokens [batch, seq] split over `fsdp` on the batch and over `sp` on the sequence, whose order is the
              ring layout's (`ACTIVATION_SHARDING["tokens"]`, `RING_LAYOUT`, `weights.layout.layout_order`): the
              global arrays are reordered on the host, then each device receives its contiguous slice.
  attention   `ring_attention` inside `jax.shard_map` over both axes, the ring going around `sp`; its in/out specs
              pin every layer's activations to the (fsdp, sp) layout. The Ulysses and hybrid schemes
              (`sequence_parallel_fn`, `jax_impl/ulysses.py`) run over the same devices with `sp` split in two.
  parameters  `PartitionSpec(*entry)` of the table `weights.parallel.PARAMETER_SHARDING` (the decoder layers'
              weights, stacked in the training state, split the same way behind their layer dim); under `jax.jit`
              XLA's partitioner gathers each weight where a matmul needs it and reduce-scatters its gradient back
              (the FSDP pattern); `load_parameters` places a checkpoint's or preset's weights so, each device
              reading its own slice (the training state's layout: the decoder layers' weights stacked,
              `state_shapes`).

The table splits every parameter, the 1-D norm weights included, on dim 0 over both mesh axes together, i.e.
the parameters, their gradients and the AdamW state are split over every device rather than replicated over
`sp`, exactly as the torch twin's FSDP2 over the flattened mesh (the table's docstring says why).

Per-layer activation checkpointing is the model's `remat` option (`jax_impl/model.py`, a scan of checkpointed
layers).

Overlap of communication with compute (`step_compiler_options`, issue 20): on GPUs the train step is compiled
with XLA's latency-hiding scheduler, which issues each collective as early as its operands allow and waits for it
as late as its users allow, so that the kernels that do not depend on it run meanwhile: the ring's K/V hop
(`ppermute`) beside the attention of the block in hand, the weight gathers and gradient reduce-scatters beside
the layers' matmuls; the async collectives' stream gets the highest priority, so a collective's kernel starts
when it is issued rather than behind queued compute; the gathers and reduce-scatters inside the layer loop are
pipelined (the next layer's weights gathered during this one, this layer's gradient reduced during the next: the
twin's FSDP2 prefetch). XLA's option names change between versions (an unknown one is refused): each knob lists its
spellings, newest first, the step takes the first this XLA accepts, a knob it has none of is left out with one
warning line (`accepted_compiler_options`), and knobs the user set in XLA_FLAGS are left to the user.

Kernels XLA must not copy (`KERNEL_KNOBS`, on GPUs whatever the overlap): XLA's GPU dynamic-slice fusion (on by
default in jax 0.11's XLA) fuses a kernel whose result a dynamic-update-slice writes into a stack with that write,
and when the result has other users it keeps the original call for them: under "save-attention" the layer scan
stacks the attention forward's out and lse for the backward while the layer goes on with out, so the Mosaic
forward ran twice per layer on one device and in Ulysses (2× the ring's forward kernel time, 8 % of JAX Ulysses'
8B step: compare/results/ulysses-second-forward-2026-11-28-h200x2/). The ring was spared (its saved out and lse
are its merge's, not a kernel's). The step is compiled with that fusion off.
"""

from __future__ import annotations

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_impl.attention import AttentionFn
from jax_impl.model import is_stacked, stack_layers
from jax_impl.ring_attention import ring_attention
from jax_impl.ulysses import scheme_axes, sequence_parallel_attention, sequence_parallel_mesh
from weights import ConvertedCheckpoint, LlamaConfig, RandomWeights, parameter_shapes
from weights.documents import document_offsets
from weights.errors import BadInputError
from weights.layout import layout_order
from weights.parallel import (ACTIVATION_SHARDING, MESH_AXES, PACKED_RING_LAYOUT, RING_LAYOUT, MeshShape,
                              parameter_sharding)
from weights.sequence_parallel import scheme_degrees
from weights.training import check_batch_shape, next_token_targets


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """The (fsdp, sp) mesh over `devices` (default: all of jax's devices, of every process, whose count must equal
    the mesh size), ordered process by process (node by node) and placed by `shape.rank_grid()`."""
    devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
    shape.check_devices(len(devices))
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return Mesh(grid[shape.rank_grid()], MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def mesh_shape(mesh: Mesh) -> MeshShape:
    return MeshShape(fsdp=mesh.shape["fsdp"], sp=mesh.shape["sp"])


def parameter_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The PartitionSpec of parameter `name`: its entry of the shared table, for a stacked decoder-layer weight
    ("layers.*.<suffix>", `jax_impl.model.stack_layers`) behind its whole layer dim; a split dim must divide
    evenly."""
    spec = parameter_sharding(name)
    if is_stacked(name):
        spec = (None, *spec)
    if len(spec) != len(shape):
        raise ValueError(f"sharding rule for {name} has {len(spec)} dims, the tensor has shape {list(shape)}")
    for dim, axes in enumerate(spec):
        devices = 1 if axes is None else int(np.prod([mesh.shape[a] for a in axes]))
        if shape[dim] % devices:
            raise BadInputError(f"parameter {name} has {shape[dim]} rows on dim {dim}, which do not split "
                                f"evenly over the mesh's {devices} devices")
    return PartitionSpec(*spec)


def parameter_shardings(mesh: Mesh, shapes: dict[str, tuple[int, ...]]) -> dict[str, NamedSharding]:
    """Canonical parameter name -> NamedSharding, for every name in `shapes`."""
    return {name: NamedSharding(mesh, parameter_spec(name, shape, mesh)) for name, shape in shapes.items()}


def activation_sharding(mesh: Mesh, kind: str) -> NamedSharding:
    """NamedSharding of an activation kind of `weights.parallel.ACTIVATION_SHARDING` ("tokens", "positions",
    "hidden")."""
    return NamedSharding(mesh, PartitionSpec(*ACTIVATION_SHARDING[kind]))


def put_sharded(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed on the mesh as one global array, each device receiving only its own slice."""
    return jax.make_array_from_callback(array.shape, sharding, array.__getitem__)


def on_host(array: jax.Array) -> np.ndarray:
    """The whole of a global array on the host, also when other processes of a run spanning nodes hold some of it
    (then a collective every process must call)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def state_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter in the training state's layout (the decoder layers' weights stacked)."""
    return stack_layers(parameter_shapes(config), stack=lambda shapes: (len(shapes), *shapes[0]))


def load_parameters(source: ConvertedCheckpoint | RandomWeights, mesh: Mesh,
                    host_arrays: dict | None = None) -> dict[str, jax.Array]:
    """float32 parameters in the training state's layout from a converted checkpoint or random preset weights.
    Each device receives its own slice: a stacked layer weight is read as each device's rows of every layer
    (`tensor_slice`), any other one tensor at a time on the host (random weights are drawn once per tensor).
    `host_arrays`: a dict the caller keeps between loads of this same source (compare's JAX worker, whose jobs all
    load the run's weights), which keeps each host array as read (the whole model in host memory), so that a later
    load only copies them to the devices."""
    layer_names = stack_layers({name: name for name in source.names()}, stack=list)  # stack -> its layers' names
    shapes = state_shapes(source.config)
    shardings = parameter_shardings(mesh, shapes)

    def kept(key: tuple, read) -> np.ndarray:
        """`read()`, or the array `host_arrays` kept under `key` (without the dict, nothing outlives its load)."""
        if host_arrays is None:
            return read()
        if key not in host_arrays:
            host_arrays[key] = read()
        return host_arrays[key]

    def stacked_rows(name: str, index: tuple[slice, ...]) -> np.ndarray:
        layers = layer_names[name][index[0]]
        first = source.tensor_slice(layers[0], index[1:])
        stacked = np.empty((len(layers), *first.shape), first.dtype)  # filled in place: no stacking copy
        stacked[0] = first
        for i, layer in enumerate(layers[1:], start=1):
            stacked[i] = source.tensor_slice(layer, index[1:])
        return stacked

    def rows(name: str, index: tuple[slice, ...]) -> np.ndarray:
        return kept((name, tuple((s.start, s.stop, s.step) for s in index)), lambda: stacked_rows(name, index))

    def load(name: str) -> jax.Array:
        if is_stacked(name):
            array = jax.make_array_from_callback(shapes[name], shardings[name], functools.partial(rows, name))
        else:
            array = put_sharded(kept((name, None), lambda: source.tensor(name)), shardings[name])
        # the host moves the checkpoint's own dtype (half of float32's bytes for bf16); the devices widen it
        return array.astype(jnp.float32)

    return {name: load(name) for name in shapes}


def ring_attention_fn(mesh: Mesh, *, backend: str = "pallas", variant: str = "ring",
                      layout: str = RING_LAYOUT) -> AttentionFn:
    """The model's attention function on GLOBAL q/k/v [B, S, H, D] whose sequence is in `layout`'s order:
    `ring_attention` in `jax.shard_map`, batch over `fsdp`, sequence around `sp`; its `segment_ids` [B, S] (packed
    documents, `sharded_packed_batch`) are split like the tokens."""
    tokens = ACTIVATION_SHARDING["hidden"][:2]
    spec = PartitionSpec(*tokens, None, None)
    attention = functools.partial(ring_attention, axis_name="sp", causal=True, layout=layout, variant=variant,
                                  backend=backend)
    plain = jax.shard_map(attention, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
    with_documents = jax.shard_map(lambda q, k, v, ids: attention(q, k, v, segment_ids=ids), mesh=mesh,
                                   in_specs=(spec, spec, spec, PartitionSpec(*tokens)), out_specs=spec)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        return plain(q, k, v) if segment_ids is None else with_documents(q, k, v, segment_ids)
    return attend


def sequence_parallel_fn(mesh: Mesh, scheme: str = "ring", ulysses_degree: int | None = None, *,
                         backend: str = "pallas", variant: str = "ring", layout: str = RING_LAYOUT) -> AttentionFn:
    """The model's attention function in `scheme` (`weights.sequence_parallel`) over the `sp` axis, on the same
    global q/k/v as `ring_attention_fn` (which the ring scheme is), whose sequence is in `layout`'s order
    (`weights.parallel.scheme_layout`; the Ulysses degrees above 1 refuse zigzag_stripes: `sharded_batch` and
    `sharded_packed_batch` place it so); its `segment_ids` [B, S] (packed documents) split like the tokens:
    `sequence_parallel_attention` in `jax.shard_map` over `sequence_parallel_mesh`, whose two axes hold the
    sequence's parts where `sp` holds them (no transfer)."""
    degrees = scheme_degrees(scheme, mesh.shape["sp"], ulysses_degree)
    if degrees.ulysses == 1:
        return ring_attention_fn(mesh, backend=backend, variant=variant, layout=layout)
    ring_axis, ulysses_axis = scheme_axes("sp")
    tokens = (ACTIVATION_SHARDING["hidden"][0], (ring_axis, ulysses_axis))
    spec, scheme_mesh = PartitionSpec(*tokens, None, None), sequence_parallel_mesh(mesh, degrees)
    attention = functools.partial(sequence_parallel_attention, ulysses_axis=ulysses_axis, ring_axis=ring_axis,
                                  causal=True, layout=layout, variant=variant, backend=backend)
    plain = jax.shard_map(attention, mesh=scheme_mesh, in_specs=(spec, spec, spec), out_specs=spec)
    with_documents = jax.shard_map(lambda q, k, v, ids: attention(q, k, v, segment_ids=ids), mesh=scheme_mesh,
                                   in_specs=(spec, spec, spec, PartitionSpec(*tokens)), out_specs=spec)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        return plain(q, k, v) if segment_ids is None else with_documents(q, k, v, segment_ids)
    return attend


def sharded_batch(tokens: np.ndarray, mesh: Mesh) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, targets, positions) of a global int64 batch [batch, seq] as int32 global arrays on the mesh, split
    as `ACTIVATION_SHARDING["tokens"]` says (batch over fsdp, sequence over sp in the ring layout's order).
    Targets are built on the full sequence before the reordering; positions [seq] are each token's global
    position (for RoPE), split over sp like the sequence."""
    shape = mesh_shape(mesh)
    check_batch_shape(tokens.shape[0], tokens.shape[1], shape)
    order = layout_order(tokens.shape[1], shape.sp, RING_LAYOUT)
    sharding = activation_sharding(mesh, "tokens")

    def place(x: np.ndarray) -> jax.Array:
        return put_sharded(x[:, order].astype(np.int32), sharding)

    sequence = activation_sharding(mesh, "positions")
    return place(tokens), place(next_token_targets(tokens)), put_sharded(order.astype(np.int32), sequence)


def sharded_packed_batch(tokens: np.ndarray, segment_ids: np.ndarray, mesh: Mesh, layout: str = PACKED_RING_LAYOUT
                         ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`sharded_batch` of packed documents (`segment_ids` [batch, seq], `weights/documents.py`) in `layout`'s order
    (the attention's, `weights.parallel.scheme_layout`): (tokens, targets, positions, segment ids), int32 global
    arrays split like the tokens. No target crosses a document's end; positions [batch, seq] are each token's offset
    in its document (RoPE restarts per document)."""
    shape = mesh_shape(mesh)
    check_batch_shape(tokens.shape[0], tokens.shape[1], shape)
    order = layout_order(tokens.shape[1], shape.sp, layout)
    sharding = activation_sharding(mesh, "tokens")
    return tuple(put_sharded(x[:, order].astype(np.int32), sharding)
                 for x in (tokens, next_token_targets(tokens, segment_ids), document_offsets(segment_ids),
                           segment_ids))


Option = tuple[str, bool | str]  # an XLA compile option and its value
# A knob: its spellings, the newest XLA's first (XLA renames options between versions: jax 0.11's XLA made the
# collective pipeliners' booleans modes); the step takes the first spelling this XLA accepts.
Knob = tuple[Option, ...]
PIPELINE_ON = "COLLECTIVE_PIPELINING_MODE_ON"  # every structurally eligible collective of its kind pipelined

OVERLAP_KNOBS: tuple[Knob, ...] = (  # module docstring
    (("xla_gpu_enable_latency_hiding_scheduler", True),),
    (("xla_gpu_enable_highest_priority_async_stream", True),),
    (("xla_gpu_pipeline_all_gather", PIPELINE_ON), ("xla_gpu_enable_pipelined_all_gather", True)),
    (("xla_gpu_pipeline_reduce_scatter", PIPELINE_ON), ("xla_gpu_enable_pipelined_reduce_scatter", True)),
    (("xla_gpu_pipeline_all_reduce", PIPELINE_ON), ("xla_gpu_enable_pipelined_all_reduce", True)),
)

KERNEL_KNOBS: tuple[Knob, ...] = (  # module docstring
    (("xla_gpu_enable_dynamic_slice_fusion", False),),
)


@functools.lru_cache(maxsize=8)
def accepted_compiler_options(knobs: tuple[Knob, ...]) -> tuple[Option, ...]:
    """For each of `knobs` the first spelling this process's XLA accepts (a tiny function compiled with every
    knob's first spelling, then with each spelling alone if that fails); a knob with none is left out, named in
    one warning line. Cached: one probe per process and knob set."""
    def accepted(options: tuple[Option, ...]) -> bool:
        try:
            jax.jit(lambda x: x + 1).lower(jnp.zeros(1)).compile(dict(options))
        except Exception:  # XLA refuses an unknown option or value (its exception type differs between versions)
            return False
        return True

    firsts = tuple(knob[0] for knob in knobs)
    if accepted(firsts):
        return firsts
    chosen = [next((option for option in knob if accepted((option,))), None) for knob in knobs]
    refused = [knob[0][0] for knob, option in zip(knobs, chosen) if option is None]
    if refused:
        print(f"twinflash: warning: this XLA ({jax.__version__}) has no option {', '.join(refused)} (nor an older "
              "spelling); the train step is compiled without it", file=sys.stderr, flush=True)
    return tuple(option for option in chosen if option is not None)


def step_compiler_options(platform: str, overlap: bool, user_flags: str) -> tuple[Option, ...]:
    """The XLA options of the train step (module docstring) on `platform` ("gpu", "cpu", ...): on GPUs
    `KERNEL_KNOBS`, and `OVERLAP_KNOBS` when `overlap`, each in the first spelling this XLA accepts, less the knobs
    with a spelling named in `user_flags` (the user's XLA_FLAGS, which then decide) and those this XLA lacks; none
    elsewhere."""
    if platform != "gpu":
        return ()
    users = set(re.findall(r"--(\w+)", user_flags))
    wanted = tuple(knob for knob in (*KERNEL_KNOBS, *(OVERLAP_KNOBS if overlap else ()))
                   if not any(name in users for name, _ in knob))
    return accepted_compiler_options(wanted) if wanted else ()
