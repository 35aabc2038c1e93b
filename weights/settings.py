"""The run contract: `TrainSettings`, the one description of a training run that `twinflash train` builds from
its arguments, both backends' `run_training` receive (torch_impl/train.py, jax_impl/train.py) and
weights/training.py checks. Framework-neutral, so that the backends and the CLI all import it from here; it travels
between processes as JSON (`to_json` / `from_json`: the torchrun workers and the JAX child read it so).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from weights.errors import BadInputError
from weights.parallel import MeshShape
from weights.schedule import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """One training run, as both backends' `run_training` read it.

    model          preset name or converted checkpoint directory (presets: random weights from `seed`)
    seq_len, batch tokens per sequence and sequences per step (global; split over fsdp x sp)
    steps          length of the run (and of the learning-rate schedule)
    mesh           (fsdp, sp) sizes; their product is the device count
    dtype          "fp32" or "bf16" compute (fp32 master weights and optimizer state either way)
    fp8            the decoder layers' linear matmuls in FP8 (needs bf16; the recipe: weights/fp8.py)
    data, seed     "text" (stdlib source, byte tokens) or "random" tokens; `seed` orders the data and makes
                   preset weights
    pack           text only: the files as documents (`weights.data.packed_text_batches`): attention, the loss
                   and RoPE positions stay inside each, the ring in `weights.parallel.PACKED_RING_LAYOUT`
    activation_checkpointing, checkpointed_layers  per-layer checkpointing ("off", "full", "save-attention")
                   and how many of the layers it applies to (None: all; `weights.parallel.checkpointed_layers`)
    attention_backend, ring_variant   kernel of each ring step ("triton"/"pallas" or "reference") and ring
                   algorithm ("ring" or "allgather")
    sp_scheme, ulysses_degree  the sequence-parallel scheme over sp ("ring", "ulysses" or "hybrid") and the hybrid's
                   Ulysses degree (weights/sequence_parallel.py)
    loss_chunk_tokens  positions per logits chunk of the loss (None: 256 Mi logits per chunk)
    ckpt_dir, ckpt_every, keep, resume  checkpoints: every N steps and at the end of the run, the last K kept,
                   --resume continues from the latest one
    stop_at        end this run after that many steps of `steps` (a job's time slot; --resume continues)
    out            directory of train.jsonl
    export_dir     the final weights go to `export_paths`: EXPORT/converted (twinflash format) and EXPORT/hf
    plan_memory    (JAX) print XLA's per-device memory plan of the step instead of training
    eager          torch on GPUs: no torch.compile and no fused AdamW kernel (the step as the equivalence tests
                   run it on CPU)
    skip_non_finite_steps  a step with a non-finite loss or grad norm is skipped (its update not applied)
                   instead of stopping the run
    profile        trace the last steps and write their time breakdown to OUT/profile.json (weights/profiling.py)
    xla_overlap    JAX on GPUs: the train step compiled with XLA's options for overlapping communication with
                   compute (`jax_impl.parallel.step_compiler_options`); False: XLA's defaults for overlap
    """

    backend: str
    model: str
    seq_len: int
    steps: int
    mesh: MeshShape
    batch: int
    dtype: str = "fp32"
    fp8: bool = False
    data: str = "text"
    seed: int = 0
    pack: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()
    activation_checkpointing: str = "off"  # a weights.parallel.REMAT_MODES key
    checkpointed_layers: int | None = None
    attention_backend: str = "triton"
    ring_variant: str = "ring"
    sp_scheme: str = "ring"
    ulysses_degree: int | None = None
    loss_chunk_tokens: int | None = None
    ckpt_dir: Path | None = None
    ckpt_every: int | None = None
    keep: int = 3
    resume: bool = False
    stop_at: int | None = None
    out: Path | None = None
    export_dir: Path | None = None
    plan_memory: bool = False
    eager: bool = False
    profile: bool = False
    skip_non_finite_steps: bool = False
    xla_overlap: bool = True

    def __post_init__(self):
        if self.pack and self.data != "text":
            raise BadInputError("--pack packs the text corpus's files as documents: it needs --data text")

    @property
    def export_paths(self) -> tuple[Path, Path] | None:
        """(converted directory, HF directory) of the final weights, or None without `export_dir`."""
        return None if self.export_dir is None else (self.export_dir / "converted", self.export_dir / "hf")

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["mesh"] = str(self.mesh)
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in fields.items()})

    @classmethod
    def from_json(cls, text: str) -> TrainSettings:
        fields = json.loads(text)
        fields["mesh"] = MeshShape.parse(fields["mesh"])
        fields["optimizer"] = OptimizerConfig(**fields["optimizer"])
        for name in ("ckpt_dir", "out", "export_dir"):
            fields[name] = None if fields[name] is None else Path(fields[name])
        return cls(**fields)
