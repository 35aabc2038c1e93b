"""Parallelism written as data, shared by both backends: the 2-D device mesh (`fsdp` x `sp`), how each parameter
is sharded over it, and how activations are laid out. Read by torch_impl/parallel.py and jax_impl/parallel.py,
which derive every placement from these tables.

`PARAMETER_SHARDING` maps a canonical parameter name pattern to one entry per tensor dim: None (the dim is whole
on every device) or a tuple of mesh axes the dim is split over together, the first axis outermost (device (f, s)
of an ("fsdp", "sp") split holds chunk f * sp + s of the dim). This is what both backends do:
  every parameter, the 1-D norm weights included, is split on dim 0 over the FLATTENED (fsdp, sp) mesh, i.e. over
  all devices, never replicated over `sp`. Sequence parallelism is for long contexts, where the batch is small and
  the mesh mostly `sp` (fsdp=1, sp=4 for one long sequence on 4 GPUs); replicating over `sp` (HSDP) would keep a
  full copy of the fp32 weights, gradients and AdamW state on every device (16 bytes per parameter: 128 GB for an
  8B model, nearly all of an H200's 141 GB), while splitting over all devices costs the same gather bytes per
  device and divides that state by the device count. The norms are split too because FSDP2, the torch backend's
  sharding, has no replicated placement; the JAX backend splits them the same way, so that every parameter's
  bytes live in the same place in both (their few bytes cost nothing, and the math is the same either way).
The torch backend turns an entry into FSDP2's `Shard(dim)` over the flattened mesh (`parameter_shard_axes`: one
set of axes for every parameter, as FSDP2 shards a module's parameters over one mesh), the JAX backend into
`PartitionSpec(*entry)`.

`ACTIVATION_SHARDING` gives one mesh axis name (or None) per dim of the data: tokens [batch, seq] are split over
`fsdp` on the batch dim and over `sp` on the sequence dim, in the order of the ring layout `RING_LAYOUT` (see
weights/layout.py; `PACKED_RING_LAYOUT` for packed documents, `ring_layout`; per scheme `scheme_layout`); the
tokens' global positions [seq] are split over `sp` the same way.
"""

from __future__ import annotations

import dataclasses
import fnmatch

import numpy as np

from weights.sequence_parallel import scheme_degrees, sequence_parallel_bytes_sent
from weights.config import LlamaConfig
from weights.errors import BadInputError

MESH_AXES = ("fsdp", "sp")
RING_LAYOUT = "zigzag"  # the sequence's order across `sp` in training: balanced causal work on every ring device
PACKED_RING_LAYOUT = "zigzag_stripes"  # the same, packed documents: balanced for any document lengths


def ring_layout(pack: bool) -> str:
    """The ring layout of a training run, with packed documents (`TrainSettings.pack`) or without."""
    return PACKED_RING_LAYOUT if pack else RING_LAYOUT


def scheme_layout(scheme: str, pack: bool) -> str:
    """The layout the `sp` devices hold the training sequence in for `scheme` (`weights.sequence_parallel`), the one
    definition both backends' training, packed batches and attention read: the ring's `ring_layout(pack)`;
    RING_LAYOUT (zigzag) for the Ulysses and hybrid schemes, packed or not. Ulysses is balanced by heads whatever
    the documents (each device computes every token of its H / U heads); the hybrid's ring over R runs zigzag,
    because a group's zigzag_stripes over P are not the stripes of a ring over R (`check_gathered_layout`)."""
    return ring_layout(pack) if scheme == "ring" else RING_LAYOUT

PARAMETER_SHARDING: dict[str, tuple[tuple[str, ...] | None, ...]] = {
    "tok_embeddings.weight": (("fsdp", "sp"), None),
    "layers.*.attention_norm.weight": (("fsdp", "sp"),),
    "layers.*.attention.w[qkv].weight": (("fsdp", "sp"), None),
    "layers.*.attention.wo.weight": (("fsdp", "sp"), None),
    "layers.*.ffn_norm.weight": (("fsdp", "sp"),),
    "layers.*.feed_forward.w[13].weight": (("fsdp", "sp"), None),
    "layers.*.feed_forward.w2.weight": (("fsdp", "sp"), None),
    "norm.weight": (("fsdp", "sp"),),
    "output.weight": (("fsdp", "sp"), None),
}

# Per-layer activation checkpointing (torch_impl/remat.py, jax_impl/remat.py): what a decoder layer keeps for
# its backward. It changes what the ring moves (`step_comm_bytes`), so it is part of how a step is laid out.
# "save-attention" exists because at long context the attention forward is the costliest part of a layer to redo
# (quadratic in the sequence; on a ring it repeats the K/V transfers), while what it keeps is linear: out
# [S, H * D] in the compute dtype and lse [H, S] in float32 per layer, about one more copy of the layer input.
REMAT_MODES: dict[str, str] = {
    "off": "keep every activation, recompute nothing",
    "full": "keep each layer's input; the backward reruns the whole layer, attention included",
    "save-attention": "keep each layer's input and its attention's output and log-sum-exp; the backward reruns "
                      "the layer except the attention",
}

ACTIVATION_SHARDING: dict[str, tuple[str | None, ...]] = {
    "tokens": ("fsdp", "sp"),            # [batch, seq]
    "positions": ("sp",),                # [seq]: each token's global position, split like the sequence
    "hidden": ("fsdp", "sp", None),      # [batch, seq, hidden]
}


def parameter_sharding(name: str) -> tuple[tuple[str, ...] | None, ...]:
    """The table's entry of canonical parameter `name`: per dim, None or the mesh axes it is split over."""
    for pattern, spec in PARAMETER_SHARDING.items():
        if fnmatch.fnmatchcase(name, pattern):
            return spec
    raise KeyError(f"no sharding rule for parameter {name}")


def sharded_dim(name: str) -> int:
    """The one dim of parameter `name` that the table splits (every entry splits exactly one dim)."""
    spec = parameter_sharding(name)
    split = [dim for dim, axes in enumerate(spec) if axes is not None]
    if len(split) != 1:
        raise ValueError(f"sharding rule of {name} splits dims {split}; the backends need exactly one split dim")
    return split[0]


def parameter_shard_axes() -> tuple[str, ...]:
    """The mesh axes every parameter is split over; the table must use one set of axes for all of them."""
    found = {axes for spec in PARAMETER_SHARDING.values() for axes in spec if axes is not None}
    if len(found) != 1 or not set(next(iter(found))) <= set(MESH_AXES):
        raise ValueError(f"PARAMETER_SHARDING splits parameters over {sorted(found)}; the backends need one tuple "
                         f"of axes from {MESH_AXES} for every parameter")
    return found.pop()


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """(fsdp, sp) sizes, and which axis's neighbours are adjacent ranks. Ranks are numbered node by node, so the
    inner axis stays inside a node when its size divides the devices per node: `inner="sp"` (the default,
    `--mesh fsdp=A,sp=B`) keeps the ring, which moves K/V every layer, on the fast links inside a node (NVLink)
    and sends FSDP's once-per-layer gathers over the network between nodes; `--mesh sp=B,fsdp=A` (the axes
    written outermost first) asks for the other placement. The placement never changes the math."""

    fsdp: int = 1
    sp: int = 1
    inner: str = "sp"

    @property
    def size(self) -> int:
        return self.fsdp * self.sp

    def axes(self) -> dict[str, int]:
        return {"fsdp": self.fsdp, "sp": self.sp}

    def rank_grid(self) -> np.ndarray:
        """int [fsdp, sp]: the rank (position in the node-by-node device order) of mesh device (f, s)."""
        if self.inner == "sp":
            return np.arange(self.size).reshape(self.fsdp, self.sp)
        return np.arange(self.size).reshape(self.sp, self.fsdp).T

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """'fsdp=2,sp=2' (either may be omitted, meaning 1); 'sp=2,fsdp=2' puts fsdp inside a node (the class
        docstring)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.isdigit() or int(value) < 1 or name in sizes:
                raise BadInputError(f"bad mesh {text!r}: expected e.g. 'fsdp=2,sp=2' with axes {MESH_AXES} "
                                    "each at most once and sizes >= 1")
            sizes[name] = int(value)
        return cls(**sizes, inner="fsdp" if list(sizes) == ["sp", "fsdp"] else "sp")

    def check_devices(self, available: int) -> None:
        if self.size != available:
            raise BadInputError(f"mesh fsdp={self.fsdp} x sp={self.sp} needs {self.size} devices, "
                                f"but {available} are available")

    def __str__(self) -> str:
        if self.inner == "fsdp":
            return f"sp={self.sp},fsdp={self.fsdp}"
        return f"fsdp={self.fsdp},sp={self.sp}"


def check_remat_mode(remat: str) -> None:
    if remat not in REMAT_MODES:
        raise ValueError(f"remat must be one of {', '.join(REMAT_MODES)}, got {remat!r}")


@dataclasses.dataclass(frozen=True)
class CheckpointedLayers:
    """Which decoder layers a step checkpoints: the layers in `groups` runs of `group_size` consecutive layers,
    the first `checkpointed_per_group` of each run checkpointed (torch_impl/model.py loops over the layers,
    jax_impl/remat.py scans over the runs: one scan body for every run, so the set must repeat)."""
    groups: int
    group_size: int
    checkpointed_per_group: int

    def checkpointed(self, layer: int) -> bool:
        return layer % self.group_size < self.checkpointed_per_group

    @property
    def count(self) -> int:
        return self.groups * self.checkpointed_per_group


def checkpointed_layers(remat: str, num_layers: int, count: int | None = None) -> CheckpointedLayers:
    """The layers checkpointed when a step asks for `count` of its `num_layers` (None: all of them; none with
    `remat` "off"), spread evenly: runs of num_layers / g layers, g = gcd(count, num_layers), whose first count / g
    are checkpointed (24 of 32: every fourth layer keeps its activations). Fewer checkpointed layers trade memory
    for the recomputation's time: each other layer keeps every activation, as with "off" (torchtitan's selective
    layer checkpointing, as a count). BadInputError for a count without checkpointing or outside [0, num_layers]."""
    check_remat_mode(remat)
    if count is not None and remat == "off":
        raise BadInputError("--checkpointed-layers needs --activation-checkpointing (full or save-attention)")
    if count is not None and not 0 <= count <= num_layers:
        raise BadInputError(f"--checkpointed-layers must be within 0..{num_layers} (the model's layers), got {count}")
    count = (0 if remat == "off" else num_layers) if count is None else count
    groups = int(np.gcd(count, num_layers))  # count 0: num_layers runs of one layer, none checkpointed
    return CheckpointedLayers(groups, num_layers // groups, count // groups)


def weights_regathered_for_backward(remat: str) -> bool:
    """Whether the torch backend's FSDP2 frees each decoder layer's gathered compute-dtype weights after the layer's
    forward and gathers them again for its backward (`reshard_after_forward`). Only with activation checkpointing,
    whose runs are the long, memory-bound ones. Without it they stay until the backward: one gather per step, as
    in the JAX step, where XLA keeps the whole compute-dtype model from the forward to the backward. Measured on
    4x H200 at S=32k, no checkpointing: +3.3 % tokens/s for the Llama-3.1-8B shape for +12.6 GiB per GPU, +4.5 %
    for Llama-3.2-1B for +1.7 GiB (compare/results/README.md)."""
    check_remat_mode(remat)
    return remat != "off"


def step_comm_bytes(config: LlamaConfig, *, seq_len: int, batch: int, mesh: MeshShape, compute_bytes: int,
                    train: bool, remat: str, parameter_gathers: int, gradient_bytes: int,
                    ring_variant: str = "ring", sp_scheme: str = "ring",
                    ulysses_degree: int | None = None) -> dict[str, float]:
    """Bytes one device sends in one step (forward, or forward + backward when `train`), counted from the shapes:
    {"attention": ..., "parameters": ..., "total": ...}. The achieved bandwidth of a benchmark is this over the
    measured communication time.

    attention   the sequence parallelism over sp, per layer `weights.sequence_parallel.sequence_parallel_bytes_sent`
                of `sp_scheme` (the ring: `weights.attention.ring_bytes_sent` of this device's K and V, Hkv heads in
                the compute dtype, in `ring_variant`); `remat` "full" (`REMAT_MODES`) repeats the forward's
                transfers, "save-attention" those of the Ulysses all-to-alls (the ring's forward it keeps).
    parameters  the parameters split over all devices (`PARAMETER_SHARDING`): each gather sends (D - 1) / D of
                them in the compute dtype, `parameter_gathers` times per step (the JAX step once, torch's
                FSDP2 once or, with `weights_regathered_for_backward`, again in the backward), and training
                reduce-scatters the gradients, (D - 1) / D of them in `gradient_bytes`."""
    devices = mesh.size
    check_remat_mode(remat)
    per_layer = sequence_parallel_bytes_sent(
        scheme_degrees(sp_scheme, mesh.sp, ulysses_degree), batch=batch // mesh.fsdp, local_tokens=seq_len // mesh.sp,
        heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.head_dim, compute_bytes=compute_bytes,
        variant=ring_variant, backward=train, exchange_forwards=1 + (train and remat != "off"),
        ring_forwards=1 + (train and remat == "full"))
    attention = config.num_layers * per_layer
    share = (devices - 1) / devices
    parameters = share * config.num_params * (parameter_gathers * compute_bytes + (gradient_bytes if train else 0))
    return {"attention": float(attention), "parameters": float(parameters), "total": float(attention + parameters)}
