"""Parallelism written as data, shared by both backends: the 2-D device mesh (`fsdp` x `sp`), how each parameter
is sharded over it, and how activations are laid out.

`PARAMETER_SHARDING` maps a canonical parameter name pattern to one mesh axis name (or None) per tensor dim; the
torch backend turns it into FSDP2 placements (`Shard(dim)` over the `fsdp` sub-mesh), the JAX backend into
`PartitionSpec`s. `ACTIVATION_SHARDING` does the same for the data: tokens [batch, seq] are split over `fsdp` on
the batch dim and over `sp` on the sequence dim (in the ring layout's order, see weights/layout.py).
"""

from __future__ import annotations

import dataclasses
import fnmatch

from weights.errors import CheckpointError

MESH_AXES = ("fsdp", "sp")

PARAMETER_SHARDING: dict[str, tuple[str | None, ...]] = {
    "tok_embeddings.weight": ("fsdp", None),
    "layers.*.attention_norm.weight": (None,),
    "layers.*.attention.w[qkv].weight": ("fsdp", None),
    "layers.*.attention.wo.weight": ("fsdp", None),
    "layers.*.ffn_norm.weight": (None,),
    "layers.*.feed_forward.w[13].weight": ("fsdp", None),
    "layers.*.feed_forward.w2.weight": ("fsdp", None),
    "norm.weight": (None,),
    "output.weight": ("fsdp", None),
}

ACTIVATION_SHARDING: dict[str, tuple[str | None, ...]] = {
    "tokens": ("fsdp", "sp"),            # [batch, seq]
    "hidden": ("fsdp", "sp", None),      # [batch, seq, hidden]
}


def parameter_sharding(name: str) -> tuple[str | None, ...]:
    """The mesh axis of each dim of canonical parameter `name`."""
    for pattern, spec in PARAMETER_SHARDING.items():
        if fnmatch.fnmatchcase(name, pattern):
            return spec
    raise KeyError(f"no sharding rule for parameter {name}")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    fsdp: int = 1
    sp: int = 1

    @property
    def size(self) -> int:
        return self.fsdp * self.sp

    def axes(self) -> dict[str, int]:
        return {"fsdp": self.fsdp, "sp": self.sp}

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """'fsdp=2,sp=2' (either may be omitted, meaning 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in MESH_AXES or not value.isdigit() or int(value) < 1 or name in sizes:
                raise CheckpointError(f"bad mesh {text!r}: expected e.g. 'fsdp=2,sp=2' with axes {MESH_AXES} "
                                      "each at most once and sizes >= 1")
            sizes[name] = int(value)
        return cls(**sizes)

    def check_devices(self, available: int) -> None:
        if self.size != available:
            raise CheckpointError(f"mesh fsdp={self.fsdp} x sp={self.sp} needs {self.size} devices, "
                                  f"but {available} are available")

    def __str__(self) -> str:
        return f"fsdp={self.fsdp},sp={self.sp}"
