"""Training checkpoints of the JAX backend (orbax-checkpoint) and export of trained weights to the converted format
and to Hugging Face. Twin of `torch_impl/checkpointing.py` (torch.distributed.checkpoint there).

Layout: an orbax `CheckpointManager` directory; CKPT_DIR/step_XXXXXXXX/ (XXXXXXXX = optimizer steps completed) holds
two items:
  state/         the sharded arrays {"model": the parameters, "optimizer": {"exp_avg": ..., "exp_avg_sq": ...}}
                 (fp32 master weights and AdamW state) in the training state's layout: by canonical name, the
                 decoder layers' weights stacked over the layers under "layers.*.<suffix>"
                 (`jax_impl.model.stack_layers`); each device's shards written by orbax.
  meta/          JSON {"format", "backend", "step", "data_position" (index of the next batch), "model"
                 (LlamaConfig), "mesh", "data" (what fixes the batch stream: kind, seed, batch, seq_len, steps),
                 "state_layout" (STATE_LAYOUT)}. There is no RNG state: nothing in training draws random numbers
                 (no dropout, data order fixed). Checkpoints without "state_layout" hold one array per layer
                 weight (before issue 19's stacked layers): a resume refuses them with one line.

A finalized step is sealed with twinflash-manifest.json (the size and SHA-256 of every file in it,
`weights.checkpoint_integrity`) once orbax has finished writing it: before the next save starts and when the
manager closes (`close_manager`); a resume verifies it and passes over an incomplete or corrupt checkpoint.

Atomicity is orbax's: a step is written into CKPT_DIR/step_XXXXXXXX.orbax-checkpoint-tmp/ and renamed into place
only when every item is complete; temporary directories are never listed as steps, so a crash mid-save leaves the
latest complete checkpoint the one a resume reads (the resumed run's manager removes the leftovers). Saving is
asynchronous: the device-to-host copy happens before `save` returns (so the next step may donate the arrays), the
writes overlap the following steps. `max_to_keep` removes older steps.

The metadata's contents, the refusal to resume a checkpoint of another model config, mesh or data stream, and the
writing of exported weights are the twins' shared `weights/training.py`; this module owns the files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_impl.model import unstack_layers
from jax_impl.parallel import on_host
from weights import CheckpointError, ConvertedCheckpoint, LlamaConfig, RandomWeights
from weights.checkpoint_integrity import read_manifest, write_manifest
from weights.training import export_trained_tensors

# step_XXXXXXXX directories; orbax's finder lists finalized steps only (never its temporary directories).
STEP_NAMES = ocp.path.step.standard_name_format(step_prefix="step", step_format_fixed_length=8)
STATE_LAYOUT = "layers-stacked"  # the meta's "state_layout": the decoder layers' weights stacked over the layers


def step_dir_name(step: int) -> str:
    return STEP_NAMES.build_name(step)


def open_manager(ckpt_dir: Path, keep: int) -> ocp.CheckpointManager:
    """The run's checkpoint manager (creates `ckpt_dir`, removes temporary directories a crash left behind); it
    keeps the last `keep` steps. Close it at the end with `close_manager`."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, step_name_format=STEP_NAMES, create=True,
                                           cleanup_tmp_directories=True)
    return ocp.CheckpointManager(Path(ckpt_dir).absolute(), options=options, item_names=("state", "meta"))


def completed_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints in `ckpt_dir`, oldest first."""
    ckpt_dir = Path(ckpt_dir).absolute()
    if not ckpt_dir.is_dir():
        return []
    return [ckpt_dir / step_dir_name(found.step) for found in sorted(STEP_NAMES.find_all(ckpt_dir),
                                                                      key=lambda found: found.step)]


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = completed_checkpoints(ckpt_dir)
    return found[-1] if found else None


def read_metadata(path: Path) -> dict[str, Any]:
    """The meta JSON of checkpoint directory `path` (what `latest_checkpoint` returns)."""
    try:
        return ocp.JsonCheckpointHandler().restore(Path(path).absolute() / "meta")
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as bad:
        raise CheckpointError(f"{path} is not a readable jax training checkpoint: {bad}") from None


def _seal_finished(manager: ocp.CheckpointManager) -> None:
    """Waits for a save in flight, then writes the manifest of every finalized step that lacks one (process 0: the
    one writer of a run spanning processes)."""
    manager.wait_until_finished()
    if jax.process_index() != 0:
        return
    for path in completed_checkpoints(Path(str(manager.directory))):
        if read_manifest(path) is None:
            write_manifest(path, read_metadata(path))


def close_manager(manager: ocp.CheckpointManager) -> None:
    """Seals the last save (waiting for it; raises if it failed) and closes `manager`."""
    try:
        _seal_finished(manager)
    finally:
        manager.close()


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: dict, meta: dict[str, Any]) -> None:
    """Starts saving `state` as step `step` (asynchronous; see the module docstring), after sealing the previous
    one (orbax waits for it before a new save anyway)."""
    _seal_finished(manager)
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({**meta, "step": step, "data_position": step, "state_layout": STATE_LAYOUT})),
        force=True)


def load_checkpoint(manager: ocp.CheckpointManager, path: Path, like: dict) -> dict:
    """The state read from checkpoint `path` with the shapes, dtypes and shardings of `like`; each device reads
    its own shards. A checkpoint of another state layout is refused (CheckpointError)."""
    meta = read_metadata(path)
    if meta.get("state_layout") != STATE_LAYOUT:
        raise CheckpointError(f"cannot resume from {path}: it stores one array per layer weight (a checkpoint of "
                              f"twinflash before the JAX training state stacked the layers); train it further with "
                              f"that version, or start again with a new --ckpt-dir")
    step = int(meta["step"])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]


def export_trained_weights(params: dict[str, jax.Array], config: LlamaConfig, converted: Path, hf: Path,
                           source: ConvertedCheckpoint | RandomWeights) -> None:
    """Writes the float32 master weights (gathered to the host) as a converted checkpoint into
    `converted` and as a Hugging Face checkpoint into `hf`. The HF files that a converted source kept (tokenizer,
    generation config) come along; its config.json does not, since it may declare another dtype."""
    tensors = unstack_layers({name: np.asarray(on_host(value), dtype=np.float32)
                              for name, value in params.items()})
    if jax.process_index() == 0:  # the one writer of a run spanning processes
        export_trained_tensors(tensors, config, converted, hf, source)
