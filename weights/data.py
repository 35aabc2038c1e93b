"""Training data both backends read: a byte-level tokenizer over real text every machine has offline (the Python
standard library's own source files), packed into fixed-length sequences, and the batch order — all built once
with numpy so the torch and JAX runs see the same token ids in the same order. Packed as documents
(`packed_text_batches`, `twinflash train --pack`), each window also carries the segment ids of the files it holds
(`weights/documents.py`): the same tokens, with their boundaries.

A random-token mode serves pure throughput runs on models whose vocabulary is not byte-sized.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from weights.config import LlamaConfig
from weights.errors import BadInputError
from weights.settings import TrainSettings

BYTE_VOCAB = 256


def encode_bytes(text: str) -> np.ndarray:
    """UTF-8 bytes as token ids (uint8 widened to int64): the whole tokenizer."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def decode_bytes(tokens: np.ndarray) -> str:
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


def stdlib_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, document ids) of the standard library's .py files, in sorted path order, concatenated up to
    `max_bytes` (the last file cut there): int64 each, the document id of a token its file's index."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise BadInputError(f"no Python source files found under {root}")
    documents = np.repeat(np.arange(len(chunks)), [len(chunk) for chunk in chunks])
    return np.concatenate(chunks).astype(np.int64), documents


def _text_windows(steps: int, batch: int, seq_len: int, vocab_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, document ids) [steps, batch, seq_len]: consecutive windows of the stdlib corpus, shuffled once
    by `seed`; a window's document ids start at 0."""
    if vocab_size < BYTE_VOCAB:
        raise BadInputError(f"text data needs a vocabulary of at least {BYTE_VOCAB} (byte tokens); the model has "
                            f"{vocab_size}: use random tokens instead")
    windows_needed = steps * batch
    corpus, documents = stdlib_corpus(windows_needed * seq_len * 2)
    windows = len(corpus) // seq_len
    if windows < windows_needed:
        raise BadInputError(f"the stdlib corpus holds {windows} windows of {seq_len} tokens; "
                            f"{steps} steps x batch {batch} need {windows_needed}")
    order = np.random.default_rng(seed).permutation(windows)[:windows_needed]
    tokens = corpus[: windows * seq_len].reshape(windows, seq_len)[order]
    ids = documents[: windows * seq_len].reshape(windows, seq_len)[order]
    return tokens.reshape(steps, batch, seq_len), (ids - ids[:, :1]).reshape(steps, batch, seq_len)


def text_batches(steps: int, batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """int64 [steps, batch, seq_len]: consecutive packed windows of the stdlib corpus, windows shuffled once by
    `seed`. Needs a vocabulary of at least 256 (one id per byte)."""
    return _text_windows(steps, batch, seq_len, vocab_size, seed)[0]


def packed_text_batches(steps: int, batch: int, seq_len: int, vocab_size: int, seed: int = 0
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int64, segment ids int32) [steps, batch, seq_len]: `text_batches`' windows with the files they
    hold as documents (a file cut by a window's edge is a document of its own in each window)."""
    tokens, ids = _text_windows(steps, batch, seq_len, vocab_size, seed)
    return tokens, ids.astype(np.int32)


def random_batches(steps: int, batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """int64 [steps, batch, seq_len] of uniform random token ids (throughput runs)."""
    return np.random.default_rng(seed).integers(0, vocab_size, (steps, batch, seq_len), dtype=np.int64)


def training_batches(settings: TrainSettings, config: LlamaConfig) -> np.ndarray:
    """int64 [steps, batch, seq_len]: the global batches of a training run, the same for both backends."""
    make = text_batches if settings.data == "text" else random_batches
    return make(settings.steps, settings.batch, settings.seq_len, config.vocab_size, settings.seed)


def training_segment_ids(settings: TrainSettings, config: LlamaConfig) -> np.ndarray | None:
    """int32 [steps, batch, seq_len]: the documents of `training_batches`' tokens when the run packs them
    (`settings.pack`), else None."""
    if not settings.pack:
        return None
    return packed_text_batches(settings.steps, settings.batch, settings.seq_len, config.vocab_size,
                               settings.seed)[1]
