"""What both backends' training share, framework-neutral (numpy): next-token targets and the index of a position
without one, the checks of a run's batches against the mesh, the default loss chunk, AdamW's per-step host
scalars, what to do with a step whose loss or grad norm is not finite, when a checkpoint is due, the run
metadata a training checkpoint records, which checkpoint a resume reads (the integrity of the files is
weights/checkpoint_integrity.py) and the refusal to resume an incompatible one, and the export of trained weights.
Read by torch_impl/train.py and jax_impl/train.py (twins), their checkpointing.py and compare/commands/train.py;
`weights.settings.TrainSettings` is the `settings` argument here.

The backends keep what their frameworks force apart: the loss and optimizer arithmetic on device, the checkpoint
files (torch.distributed.checkpoint, orbax) and how trained weights are gathered to the host.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from weights.checkpoint import (ConvertedCheckpoint, RandomWeights, export_hf_checkpoint, kept_hf_files,
                                write_converted_checkpoint)
from weights.checkpoint_integrity import backends_in, newest_valid
from weights.config import LlamaConfig
from weights.errors import BadInputError, CheckpointError
from weights.layout import check_split
from weights.parallel import RING_LAYOUT, MeshShape
from weights.schedule import OptimizerConfig

TRAIN_FORMAT = "twinflash-train/1"  # the "format" of a training checkpoint's metadata, both backends
IGNORE_INDEX = -100  # target of a position with no next token (torch's cross_entropy default ignore_index)
LOGITS_CHUNK_ELEMENTS = 1 << 28  # default loss chunk: 256 Mi float32 logits (1 GiB) per chunk
# The attention backends of each framework's kernels (`backend=` of torch_impl.kernels.flash_attention and
# jax_impl.kernels.flash_attention, which read their lists here), ours first: the default, then one per kernel
# family (portable, hopper), then the plain-math reference and the vendors' kernels.
ATTENTION_BACKENDS = {"torch": ("triton", "triton_portable", "triton_hopper", "reference", "sdpa_cudnn",
                                "sdpa_flash", "flash_attn"),
                      "jax": ("pallas", "pallas_portable", "pallas_hopper", "reference", "cudnn")}

BACKENDS = tuple(ATTENTION_BACKENDS)  # the frameworks, in the order every result lists them: torch, jax


# --- the data ---------------------------------------------------------------------------------------------------

def next_token_targets(tokens: np.ndarray, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """targets[:, t] = tokens[:, t + 1]; the last position, which has no next token, is IGNORE_INDEX, and with
    packed documents (`segment_ids`, `weights/documents.py`) so is each document's last token: the loss never
    predicts the next document's first token."""
    targets = np.concatenate([tokens[:, 1:], np.full((tokens.shape[0], 1), IGNORE_INDEX, tokens.dtype)], axis=1)
    if segment_ids is not None:
        targets[:, :-1][segment_ids[:, 1:] != segment_ids[:, :-1]] = IGNORE_INDEX
    return targets


def valid_target_count(batch: int, seq_len: int, segment_ids: np.ndarray | None = None) -> int:
    """Positions of a [batch, seq_len] batch that have a target: every position but each sequence's last, or with
    packed documents each document's last."""
    if segment_ids is None:
        return batch * (seq_len - 1)
    return int(np.count_nonzero(next_token_targets(np.zeros_like(segment_ids), segment_ids) != IGNORE_INDEX))


def check_batch_shape(batch: int, seq_len: int, shape: MeshShape) -> None:
    """Refuses a batch the fsdp axis cannot split or a sequence the ring layout cannot split over sp."""
    if batch < 1 or batch % shape.fsdp:
        raise BadInputError(f"batch size {batch} must be a positive multiple of fsdp={shape.fsdp} "
                            "(each fsdp rank takes whole sequences)")
    if seq_len < 2:
        raise BadInputError(f"sequence length must be >= 2 (a next-token target needs two tokens), got {seq_len}")
    check_split(seq_len, shape.sp, RING_LAYOUT)


def check_batches(settings, batches: np.ndarray, segment_ids: np.ndarray | None = None) -> None:
    """Refuses `batches` unless they are [steps, batch, seq_len] of `settings`, splittable over its mesh, and their
    `segment_ids` unless given exactly when the run packs documents (`settings.pack`), in the batches' shape."""
    check_batch_shape(settings.batch, settings.seq_len, settings.mesh)
    if batches.shape[1:] != (settings.batch, settings.seq_len):
        raise ValueError(f"batches must be [steps, {settings.batch}, {settings.seq_len}], got {list(batches.shape)}")
    if (segment_ids is not None) != settings.pack:
        raise ValueError("segment_ids must be given exactly when settings.pack is set (packed documents)")
    if segment_ids is not None and segment_ids.shape != batches.shape:
        raise ValueError(f"segment_ids must have the batches' shape {list(batches.shape)}, got "
                         f"{list(segment_ids.shape)}")


def check_attention_backend(settings) -> None:
    """Refuses an attention backend that `settings.backend` does not have."""
    choices = ATTENTION_BACKENDS[settings.backend]
    if settings.attention_backend not in choices:
        raise BadInputError(f"--attention-backend for {settings.backend} must be one of {', '.join(choices)}, "
                            f"got {settings.attention_backend!r}")


# --- the step ---------------------------------------------------------------------------------------------------

LOGITS_CHUNK_ROWS_MULTIPLE = 256  # a GEMM tile's rows: the default chunk is a whole number of them


def default_loss_chunk_tokens(vocab_size: int) -> int:
    """Positions per loss chunk when the settings name none: at most `LOGITS_CHUNK_ELEMENTS` logits, in whole
    multiples of 256 rows where that many fit (at vocab 128256: 2048 rather than 2092 rows, which left every
    chunk's LM-head GEMMs a ragged last tile and every power-of-two length a remainder chunk of its own)."""
    rows = max(1, LOGITS_CHUNK_ELEMENTS // vocab_size)
    return rows // LOGITS_CHUNK_ROWS_MULTIPLE * LOGITS_CHUNK_ROWS_MULTIPLE or rows


def adamw_coefficients(config: OptimizerConfig, step: int) -> dict[str, float]:
    """The host-side scalars of AdamW step `step` (0-based), in float64 as torch.optim.AdamW computes them:
    the learning rate, the weight-decay factor 1 - lr * wd, the step size lr / (1 - b1^t) and sqrt(1 - b2^t),
    t = step + 1."""
    lr = config.learning_rate(step)
    t = step + 1
    return {"lr": lr, "decay": 1 - lr * config.weight_decay, "step_size": lr / (1 - config.beta1 ** t),
            "bias_correction2_sqrt": (1 - config.beta2 ** t) ** 0.5}


def host_peak_rss_bytes() -> int:
    """This process's peak resident host memory (what a step reports where no device counts its own)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def checkpoint_due(settings, done: int, stop: int) -> bool:
    """Whether to save after `done` optimizer steps of a run ending at `stop`: every `ckpt_every` steps and at
    the end, when the run has a checkpoint directory."""
    if settings.ckpt_dir is None:
        return False
    return done == stop or (settings.ckpt_every is not None and done % settings.ckpt_every == 0)


# --- resuming ---------------------------------------------------------------------------------------------------

def run_metadata(settings, config: LlamaConfig) -> dict[str, Any]:
    """What a checkpoint of this run records about it (all but the step), in JSON-normalised form."""
    meta = {
        "format": TRAIN_FORMAT,
        "backend": settings.backend,
        "model": config.to_dict(),
        "mesh": settings.mesh.axes(),
        "data": {"kind": settings.data, "seed": settings.seed, "batch": settings.batch,
                 "seq_len": settings.seq_len, "steps": settings.steps,
                 **({"pack": True} if settings.pack else {})},  # absent unpacked: older checkpoints still resume
    }
    return json.loads(json.dumps(meta))


def _differences(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """'field: saved -> current' for every leaf that differs between two JSON values."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [d for key in sorted(set(saved) | set(current))
                for d in _differences(saved.get(key), current.get(key), f"{prefix}{key}.")]
    return [] if saved == current else [f"{prefix.rstrip('.')} {saved} -> {current}"]


def check_compatible(path: Path, saved: dict[str, Any], meta: dict[str, Any]) -> None:
    """Refuses to resume this run (`meta` from `run_metadata`) from checkpoint `path`, whose metadata is `saved`,
    when another backend, model config, mesh or data stream made it."""
    if saved.get("format") != TRAIN_FORMAT or saved.get("backend") != meta["backend"]:
        raise CheckpointError(f"cannot resume from {path}: it is a {saved.get('backend')} checkpoint "
                              f"({saved.get('format')}), this run is a {meta['backend']} run ({TRAIN_FORMAT})")
    for key, what, flags in (("model", "model config", "--model"), ("mesh", "mesh", "--mesh"),
                             ("data", "data stream", "--data/--seed/--batch/--seq-len/--steps")):
        changed = _differences(saved.get(key), meta[key])
        if changed:
            raise CheckpointError(f"cannot resume from {path}: it was saved with another {what} "
                                  f"({'; '.join(changed[:3])}); rerun with its {flags} or a new --ckpt-dir")


class Resume(NamedTuple):
    """Where a run starts: the checkpoint it continues from (None: a fresh start), the step it continues at, and
    the newer checkpoints passed over as incomplete or corrupt (the backend sets them aside before saving)."""

    path: Path | None
    step: int
    passed_over: tuple[Path, ...] = ()


def _refuse_other_backends(ckpt_dir: Path, backend: str) -> None:
    others = {name: dirs for name, dirs in backends_in(ckpt_dir).items() if name != backend}
    for other, dirs in others.items():
        raise CheckpointError(f"{ckpt_dir} holds {other} training checkpoints ({dirs[-1]}), this run is a "
                              f"{backend} run; choose another --ckpt-dir or --backend {other}")


def print_to_stderr(line: str) -> None:
    """One line to the process's current stderr, flushed (the trainings' warnings; looked up per call, so a
    redirected or captured stderr gets it)."""
    print(line, file=sys.stderr, flush=True)


def checkpoint_to_resume(settings, meta: dict[str, Any], completed_checkpoints: Callable[[Path], list[Path]],
                         read_metadata: Callable[[Path], dict[str, Any]],
                         warn: Callable[[str], None] | None = None, checksums: bool = True) -> Resume:
    """Where this run starts, given the backend's `completed_checkpoints(ckpt_dir)` (oldest first) and
    `read_metadata(path)`. Refuses a checkpoint directory holding the other backend's checkpoints, one holding
    checkpoints without `settings.resume`, `settings.resume` without a checkpoint, no valid checkpoint, and a
    checkpoint `check_compatible` refuses. A newest checkpoint that is incomplete or corrupt
    (`weights.checkpoint_integrity`; `checksums=False` compares sizes only) is passed over for the newest valid one,
    with one line to `warn`."""
    ckpt_dir = settings.ckpt_dir
    if ckpt_dir is None:
        return Resume(None, 0)
    _refuse_other_backends(ckpt_dir, meta["backend"])
    found = completed_checkpoints(ckpt_dir)
    if not found:
        if settings.resume:
            raise CheckpointError(f"--resume: no {meta['backend']} training checkpoint in {ckpt_dir}")
        return Resume(None, 0)
    if not settings.resume:
        raise CheckpointError(f"{ckpt_dir} holds checkpoints (latest {found[-1].name}); pass --resume to "
                              "continue from it or choose an empty --ckpt-dir")
    path, passed_over = newest_valid(found, checksums=checksums)
    if path is None:
        newest, problem = passed_over[0]
        raise CheckpointError(f"no valid checkpoint to resume from in {ckpt_dir}: the newest, {newest.name}, is "
                              f"{problem}" + (", and so are the older ones" if len(passed_over) > 1 else ""))
    if passed_over and warn is not None:
        newest, problem = passed_over[0]
        warn(f"twinflash: warning: checkpoint {newest} is {problem}; resuming from the newest valid one, "
             f"{path.name}" + (f" (passing over {len(passed_over)} checkpoints)" if len(passed_over) > 1 else ""))
    saved = read_metadata(path)
    check_compatible(path, saved, meta)
    return Resume(path, int(saved["data_position"]), tuple(p for p, _ in passed_over))


# --- non-finite steps -------------------------------------------------------------------------------------------

class NonFiniteStepError(BadInputError):
    """A training step whose loss or grad norm is not finite (NaN or inf weights, data, or a learning rate too
    high): the run stops with one line, its last checkpoint the last good step."""


def check_step_finite(settings, step: int, loss: float, grad_norm: float, last_checkpoint: Path | None
                      ) -> str | None:
    """None for a step with a finite loss and grad norm. Otherwise, with `settings.skip_non_finite_steps` (the
    backend then did not apply its update), the one-line warning to print; without it, raises
    NonFiniteStepError naming the step and the last checkpoint."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return None
    what = f"step {step}: non-finite loss {loss} / grad norm {grad_norm}"
    if settings.skip_non_finite_steps:
        return f"twinflash: warning: {what}; update skipped (--skip-non-finite-steps)"
    kept = f"last checkpoint: {last_checkpoint}" if last_checkpoint is not None else "no checkpoint saved"
    raise NonFiniteStepError(f"{what}; training stopped, the step not saved ({kept}); "
                             "rerun with --skip-non-finite-steps to skip such steps")


# --- export -----------------------------------------------------------------------------------------------------

def export_trained_tensors(tensors: Mapping[str, np.ndarray], config: LlamaConfig, converted: Path, hf: Path,
                           source: ConvertedCheckpoint | RandomWeights) -> None:
    """float32 trained weights by canonical name -> a converted checkpoint in `converted` and a Hugging Face one
    in `hf`, carrying the HF files a converted `source` kept (`weights.checkpoint.kept_hf_files`)."""
    write_converted_checkpoint(tensors, config, converted, kept_hf_files(source))
    export_hf_checkpoint(converted, hf)
