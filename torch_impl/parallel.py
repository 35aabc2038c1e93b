"""Parallelism for the PyTorch backend: the 2-D DeviceMesh (`fsdp` x `sp`), FSDP2 `fully_shard` of the model with
placements from the shared table in `weights/parallel.py`, per-layer activation checkpointing, the ring attention
over the `sp` sub-group as the model's attention function, and each rank's slice of a global batch. Twin of
`jax_impl/parallel.py` (NamedSharding and `jax.shard_map` there).

How the pieces fit:
  mesh        `make_mesh` builds DeviceMesh (fsdp, sp), names from `weights.parallel.MESH_AXES`, device (f, s) the
              rank `MeshShape.rank_grid` gives: f * sp + s (the sp ring inside a node), or s * fsdp + f with
              `--mesh sp=B,fsdp=A`.
  data        tokens [batch, seq] split over `fsdp` on the batch and over `sp` on the sequence in the ring layout
              (`weights.parallel.ACTIVATION_SHARDING["tokens"]`, `RING_LAYOUT`, `weights.layout.rank_positions`).
  attention   `ring_attention` over `mesh["sp"].get_group()`, the ranks holding the same sequences' tokens; the
              Ulysses and hybrid schemes (`sequence_parallel_fn`, `torch_impl/ulysses.py`) over the same ranks.
  parameters  FSDP2 `fully_shard` on every TransformerBlock and on the root, over the mesh axes the table
              `weights.parallel.PARAMETER_SHARDING` splits every parameter over, flattened into one 1-D mesh
              (`parameter_mesh`); `shard_placement_fn` gives each parameter `Shard(d)` on the dim the table splits.

The table splits every parameter (the 1-D norm weights too) over the flattened (fsdp, sp) mesh, i.e. over all
ranks, not replicated over `sp`; its docstring says why, and the JAX twin does the same. FSDP2 over a 1-D mesh of
all ranks in (f, s) order is exactly that split: device (f, s) holds chunk f * sp + s, as JAX's ("fsdp", "sp")
partition. Every
rank's local gradient is SUMMED over all ranks (the ranks of an sp group hold different tokens of the same
sequences, those of an fsdp group different sequences), so FSDP's reduction is set to a plain sum
(`set_force_sum_reduction_for_comms`, divide factor 1) and the loss is normalised by the global token count
instead (`torch_impl/train.py`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torch_impl.attention import AttentionFn
from torch_impl.ring_attention import ring_attention
from torch_impl.ulysses import sequence_parallel_attention, sequence_parallel_groups
from weights import ConvertedCheckpoint, RandomWeights, rope_inverse_frequencies
from weights.documents import document_offsets
from weights.layout import rank_positions
from weights.parallel import (MESH_AXES, PACKED_RING_LAYOUT, RING_LAYOUT, CheckpointedLayers, MeshShape,
                              parameter_shard_axes, sharded_dim, weights_regathered_for_backward)
from weights.training import check_batch_shape, next_token_targets


def make_mesh(shape: MeshShape, device_type: str) -> DeviceMesh:
    """The (fsdp, sp) mesh over all ranks of the initialised process group, whose size must equal the mesh's, each
    device at the rank `shape.rank_grid()` gives (torchrun numbers the ranks node by node)."""
    shape.check_devices(dist.get_world_size())
    return DeviceMesh(device_type, torch.from_numpy(shape.rank_grid()), mesh_dim_names=MESH_AXES)


def mesh_shape(mesh: DeviceMesh) -> MeshShape:
    return MeshShape(fsdp=mesh.size(MESH_AXES.index("fsdp")), sp=mesh.size(MESH_AXES.index("sp")))


def parameter_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh FSDP shards the parameters over: the table's shard axes flattened, which must be all of the
    mesh's (FSDP2 here has no replicated axis: gradients are summed over every rank, module docstring)."""
    axes = parameter_shard_axes()
    if axes != MESH_AXES:
        raise ValueError(f"PARAMETER_SHARDING splits parameters over {axes}; this backend shards over all of "
                         f"{MESH_AXES}")
    return DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=("_".join(axes),))


def parameter_placement(name: str) -> Shard:
    """FSDP2 placement of canonical parameter `name`: `Shard(d)` on the dim `PARAMETER_SHARDING` splits."""
    return Shard(sharded_dim(name))


def ring_attention_fn(mesh: DeviceMesh, *, backend: str = "triton", variant: str = "ring",
                      compile_merge: bool = False, layout: str = RING_LAYOUT) -> AttentionFn:
    """The model's attention function on this rank's q/k/v [B_local, S_local, H, D] in the ring layout's order:
    `ring_attention` around the `sp` sub-group, without its per-call cross-rank argument check (a host round trip
    per layer): every rank's q/k/v have the same shapes and dtype by construction (`local_batch` splits a global
    batch that is the same on every rank evenly). `compile_merge`: the ring's merge under torch.compile. Packed
    documents: `layout` PACKED_RING_LAYOUT, the model passing the segment ids of `local_packed_batch`."""
    return functools.partial(ring_attention, group=mesh["sp"].get_group(), causal=True, layout=layout,
                             variant=variant, backend=backend, check_ranks=False, compile_merge=compile_merge)


def sequence_parallel_fn(mesh: DeviceMesh, scheme: str = "ring", ulysses_degree: int | None = None, *,
                         backend: str = "triton", variant: str = "ring", compile_merge: bool = False,
                         layout: str = RING_LAYOUT) -> AttentionFn:
    """The model's attention function in `scheme` (`weights.sequence_parallel`) over the `sp` sub-group, on the same
    local q/k/v as `ring_attention_fn` (which the ring scheme is), in `layout` (`weights.parallel.scheme_layout`;
    the Ulysses degrees above 1 refuse zigzag_stripes): `sequence_parallel_attention` over the groups of
    `sequence_parallel_groups` (a collective of the sp ranks, which the hybrid's subgroups need; call it before a
    meta-device context), without the ring's per-call argument check (as `ring_attention_fn`). Packed documents: the
    model passes the segment ids of `local_packed_batch` in the same layout."""
    groups = sequence_parallel_groups(scheme, ulysses_degree, mesh["sp"].get_group())
    if groups.degrees.ulysses == 1:
        return ring_attention_fn(mesh, backend=backend, variant=variant, compile_merge=compile_merge, layout=layout)
    return functools.partial(sequence_parallel_attention, groups=groups, causal=True, layout=layout,
                             variant=variant, backend=backend, check_ranks=False, compile_merge=compile_merge)


def shard_model(model: nn.Module, llama: nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype,
                remat: str, checkpointed: CheckpointedLayers | None = None) -> None:
    """In place: per-layer activation checkpointing (the model's `remat`, a `weights.parallel.REMAT_MODES` key, on
    the layers `checkpointed` names: None, all) and FSDP2 over `parameter_mesh(mesh)` on every decoder layer of
    `llama` and on `model`, the root that contains it (the loss module, so that the LM head used by the loss is
    gathered by the root's hooks). fp32 parameters stay the master copy; with a bf16 compute dtype FSDP gathers
    them in bf16 and reduces gradients in fp32. Gradients are summed over all ranks.
    A layer's gathered weights stay from its forward to its backward unless checkpointing recomputes it
    (`weights_regathered_for_backward`: memory or one all-gather less per step), for every layer alike, as the JAX
    twin's scan of layers regathers them all."""
    llama.remat, llama.checkpointed = remat, checkpointed
    names = {param: name for name, param in llama.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = dict(mesh=parameter_mesh(mesh), mp_policy=policy,
                  shard_placement_fn=lambda param: parameter_placement(names[param]))
    for layer in llama.layers:
        fully_shard(layer, reshard_after_forward=weights_regathered_for_backward(remat), **kwargs)
    fully_shard(model, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def _local_rows(param: DTensor) -> slice:
    """The global dim-0 rows of `param` this rank holds (DTensor `Shard(0)`: torch.chunk's split)."""
    (placement,) = param.placements
    if placement != Shard(0):
        raise ValueError(f"expected a Shard(0) parameter, got {placement}")
    rows = param.shape[0]
    per_rank = math.ceil(rows / param.device_mesh.size())
    start = min(rows, per_rank * param.device_mesh.get_local_rank())
    return slice(start, min(rows, start + per_rank))


@torch.no_grad()
def load_local_shards(llama: nn.Module, source: ConvertedCheckpoint | RandomWeights, device: torch.device) -> None:
    """Fills the sharded parameters of a meta-initialised, `shard_model`-ed `llama` from `source`, each rank
    reading only its rows of each tensor (as float32), and rebuilds the RoPE buffer on `device`."""
    llama.to_empty(device=device)
    for name, param in llama.named_parameters():
        rows = _local_rows(param)
        local = param.to_local()
        array = source.tensor_slice(name, (rows,) + (slice(None),) * (param.ndim - 1))
        local.copy_(torch.from_numpy(array.astype("float32", copy=False)))
    llama.inv_freq = torch.from_numpy(rope_inverse_frequencies(llama.config)).to(device)


def _on_device(x: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(x))
    if device.type != "cuda":
        return host
    # from pinned memory the copy is queued like a kernel; from pageable memory it would wait for the device
    return host.pin_memory().to(device, non_blocking=True)


def _local_part(x: np.ndarray, mesh: DeviceMesh, layout: str, device: torch.device) -> torch.Tensor:
    """This rank's part of a global [batch, seq] array, split as `ACTIVATION_SHARDING["tokens"]` says (batch over
    fsdp, sequence over sp in `layout`), on `device`."""
    shape = mesh_shape(mesh)
    rows_per_rank = x.shape[0] // shape.fsdp
    rows = slice(mesh.get_local_rank("fsdp") * rows_per_rank, (mesh.get_local_rank("fsdp") + 1) * rows_per_rank)
    return _on_device(x[rows][:, rank_positions(x.shape[1], shape.sp, mesh.get_local_rank("sp"), layout)], device)


def local_batch(tokens: np.ndarray, mesh: DeviceMesh, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (tokens, targets, positions) of a global int64 batch [batch, seq], split as
    `ACTIVATION_SHARDING["tokens"]` says (batch over fsdp, sequence over sp in the ring layout). Targets are built
    on the full sequence before the split; positions are the local tokens' global positions, for RoPE."""
    shape = mesh_shape(mesh)
    check_batch_shape(tokens.shape[0], tokens.shape[1], shape)
    positions = rank_positions(tokens.shape[1], shape.sp, mesh.get_local_rank("sp"), RING_LAYOUT)
    return (_local_part(tokens, mesh, RING_LAYOUT, device),
            _local_part(next_token_targets(tokens), mesh, RING_LAYOUT, device),
            _on_device(positions, device))


def local_packed_batch(tokens: np.ndarray, segment_ids: np.ndarray, mesh: DeviceMesh, device: torch.device,
                       layout: str = PACKED_RING_LAYOUT
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`local_batch` of packed documents (`segment_ids` [batch, seq], `weights/documents.py`) in `layout` (the
    attention's, `weights.parallel.scheme_layout`): (tokens, targets, positions, segment ids). No target crosses a
    document's end; positions [batch, seq] are each token's offset in its document (RoPE restarts per document)."""
    check_batch_shape(tokens.shape[0], tokens.shape[1], mesh_shape(mesh))
    return tuple(_local_part(x, mesh, layout, device)
                 for x in (tokens, next_token_targets(tokens, segment_ids), document_offsets(segment_ids),
                           segment_ids.astype(np.int32)))
