"""Training checkpoints of the PyTorch backend (torch.distributed.checkpoint) and export of trained weights to the
converted format and to Hugging Face. Twin of `jax_impl/checkpointing.py` (orbax-checkpoint there).

Layout: CKPT_DIR/step-XXXXXXXX/ (XXXXXXXX = optimizer steps completed) holds
  DCP files      the sharded tensors: {"model": the parameters by canonical name, "optimizer": {"exp_avg": ...,
                 "exp_avg_sq": ...}}, each rank writing its own shards (fp32 master weights and AdamW state).
  meta.json      {"format", "backend", "step", "data_position" (index of the next batch), "model" (LlamaConfig),
                 "mesh", "data" (what fixes the batch stream: kind, seed, batch, seq_len, steps)}; readable
                 without torch.distributed, so a resume is checked before any process starts. There is no RNG
                 state: nothing in training draws random numbers (no dropout; the data order is fixed up front).

  twinflash-manifest.json  the size and SHA-256 of every file above (`weights.checkpoint_integrity`), written
                 last: a resume verifies it and passes over an incomplete or corrupt checkpoint.

Atomicity: a checkpoint is written into CKPT_DIR/.step-XXXXXXXX.partial, meta.json then the manifest last, and
renamed into place by rank 0 after every rank's shards are written; only directories named step-* count, so a crash
mid-save never leaves the latest checkpoint unreadable. Older checkpoints beyond the last `keep` are renamed to
.*.deleting before removal (a crash there leaves no half-deleted step-* directory).

The metadata's contents, the refusal to resume a checkpoint of another model config, mesh or data stream, and the
writing of exported weights are the twins' shared `weights/training.py`; this module owns the files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from weights import ConvertedCheckpoint, RandomWeights
from weights.checkpoint_integrity import write_manifest
from weights.config import read_json
from weights.training import export_trained_tensors

META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step-(\d{8})")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def completed_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The complete checkpoints in `ckpt_dir`, oldest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    found = [p for p in Path(ckpt_dir).iterdir()
             if _STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = completed_checkpoints(ckpt_dir)
    return found[-1] if found else None


def read_metadata(path: Path) -> dict[str, Any]:
    """The meta.json of checkpoint directory `path` (what `latest_checkpoint` returns)."""
    return read_json(Path(path) / META_FILE)


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        handle.write(json.dumps(data, indent=2) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: Path, step: int, llama: nn.Module, optimizer_state: dict, meta: dict[str, Any], *,
                    keep: int) -> Path:
    """Collective: writes CKPT_DIR/step-XXXXXXXX atomically (module docstring) and keeps the last `keep`."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dir_name(step)
    partial = ckpt_dir / f".{final.name}.partial"
    if _is_rank0():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".step-*"):  # left by a crash during an earlier save or removal
            shutil.rmtree(stale)
    dist.barrier()
    dcp.save({"model": llama.state_dict(), "optimizer": optimizer_state}, checkpoint_id=partial)
    if _is_rank0():
        recorded = {**meta, "step": step, "data_position": step}
        _write_json_durably(partial / META_FILE, recorded)
        write_manifest(partial, recorded)
        os.replace(partial, final)
        _fsync_directory(ckpt_dir)
        for old in completed_checkpoints(ckpt_dir)[:-keep]:
            doomed = ckpt_dir / f".{old.name}.deleting"
            os.replace(old, doomed)
            shutil.rmtree(doomed)
    dist.barrier()
    return final


def load_checkpoint(path: Path, llama: nn.Module, optimizer_state: dict) -> None:
    """Collective: loads the parameters and optimizer state of checkpoint `path` in place (each rank reading its
    shards)."""
    dcp.load({"model": llama.state_dict(), "optimizer": optimizer_state}, checkpoint_id=Path(path))


def export_trained_weights(llama: nn.Module, converted: Path, hf: Path,
                           source: ConvertedCheckpoint | RandomWeights) -> None:
    """Collective: gathers the float32 master weights one tensor at a time; rank 0 writes them as a converted
    checkpoint into `converted` and as a Hugging Face checkpoint into `hf`. The HF files that a converted source
    kept (tokenizer, generation config) come along; its config.json does not, since it may declare another dtype."""
    tensors = {}
    for name, value in llama.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if _is_rank0():
            tensors[name] = full.detach().to(torch.float32).cpu().numpy()
        del full
    if _is_rank0():
        export_trained_tensors(tensors, llama.config, converted, hf, source)
    dist.barrier()
