"""`twinflash run`: one forward pass of either backend on given or random tokens, with loss, perplexity, wall time
and peak memory. Each backend is imported only when asked for, so a machine with one of them still runs it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np

from compare.args import SEED_MAX, integer
from weights import PRESETS, BadInputError, LlamaConfig, open_weights
from weights.atomic import atomic_file, check_new_file
from weights.training import BACKENDS, host_peak_rss_bytes

HELP = "one forward pass: loss, perplexity, wall time, peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS, default="torch")
    parser.add_argument("--model", default="tiny", help=f"converted checkpoint dir or preset ({', '.join(PRESETS)})")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokens", type=Path, help="int .npy of shape [batch, seq_len]")
    source.add_argument("--seq-len", type=integer(2), default=128, help="random tokens: sequence length")
    parser.add_argument("--batch", type=integer(1), default=1, help="random tokens: batch size")
    parser.add_argument("--seed", type=integer(0, SEED_MAX), default=0,
                        help="random tokens and preset weights seed")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dump-logits", type=Path, help="write float32 [batch, seq_len, vocab] logits to this new "
                        ".npy file (its directory must exist)")


@dataclasses.dataclass
class ForwardResult:
    backend: str
    device: str
    loss: float
    wall_s: float  # the second of two identical passes: steady state, without compilation
    first_call_s: float  # the first pass, including JIT compilation (Triton kernels, XLA)
    peak_memory_bytes: int
    peak_memory_kind: str
    logits: np.ndarray

    @property
    def perplexity(self) -> float:
        # exp overflows a float above ~709: inf there; a NaN loss stays NaN (no ordering holds for it)
        return math.inf if self.loss > 700 else math.exp(self.loss)


def _timed_twice(step):
    """(result, first-call seconds, second-call seconds) of a synchronising `step()`."""
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    result = step()
    return result, first, time.perf_counter() - start


def read_tokens(path: Path, config: LlamaConfig) -> np.ndarray:
    try:
        tokens = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise BadInputError(f"missing token file {path}") from None
    except (ValueError, OSError) as bad:
        raise BadInputError(f"cannot read {path} as a .npy array: {bad}") from None
    if not np.issubdtype(tokens.dtype, np.integer):
        raise BadInputError(f"{path}: token ids must be integers, got dtype {tokens.dtype}")
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise BadInputError(f"{path}: tokens must have shape [batch >= 1, seq_len >= 2], got {list(tokens.shape)}")
    config.check_token_ids(tokens)
    return tokens.astype(np.int64)


def random_tokens(config: LlamaConfig, batch: int, seq_len: int, seed: int) -> np.ndarray:
    if batch < 1 or seq_len < 2:
        raise BadInputError(f"need --batch >= 1 and --seq-len >= 2, got {batch} and {seq_len}")
    return np.random.default_rng(seed).integers(0, config.vocab_size, (batch, seq_len), dtype=np.int64)


def forward_torch(model: str, tokens: np.ndarray, dtype: str, seed: int) -> ForwardResult:
    import torch

    from torch_impl.model import load_model, next_token_loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    llama = load_model(model, dtype=dtype, device=device, seed=seed)
    ids = torch.from_numpy(tokens).to(device)

    @torch.no_grad()
    def step():
        logits = llama(ids)
        return logits, float(next_token_loss(logits, ids))  # float() synchronises the device

    (logits, loss), first, wall = _timed_twice(step)
    if device == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(), "GPU allocated"
    else:
        peak, kind = host_peak_rss_bytes(), "host RSS"
    return ForwardResult("torch", device, loss, wall, first, peak, kind, logits.cpu().numpy())


def forward_jax(model: str, tokens: np.ndarray, dtype: str, seed: int) -> ForwardResult:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_impl.model import load_model, next_token_loss

    llama = load_model(model, dtype=dtype, seed=seed)

    @nnx.jit
    def forward(module, ids):
        logits = module(ids)
        return logits, next_token_loss(logits, ids)

    ids = jnp.asarray(tokens)
    (logits, loss), first, wall = _timed_twice(lambda: jax.block_until_ready(forward(llama, ids)))
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats and "peak_bytes_in_use" in stats:
        peak, kind = int(stats["peak_bytes_in_use"]), "GPU peak in use"
    else:
        peak, kind = host_peak_rss_bytes(), "host RSS"
    return ForwardResult("jax", device.platform, float(loss), wall, first, peak, kind, np.asarray(logits))


def run_forward(backend: str, model: str, tokens: np.ndarray, dtype: str, seed: int) -> ForwardResult:
    if backend == "torch":
        return forward_torch(model, tokens, dtype, seed)
    if backend == "jax":
        return forward_jax(model, tokens, dtype, seed)
    raise BadInputError(f"unknown backend {backend!r} (choices: {', '.join(BACKENDS)})")


def prepare_tokens(model: str, seed: int, tokens_path: Path | None, batch: int, seq_len: int) -> np.ndarray:
    config = open_weights(model, seed).config
    if tokens_path is not None:
        return read_tokens(tokens_path, config)
    return random_tokens(config, batch, seq_len, seed)


def _save_npy_new(path: Path, array) -> None:
    """Writes a .npy file that must not exist yet, atomically (a crash leaves no partial file)."""
    check_new_file(path, "--dump-logits")  # again: the forward pass took a while
    with atomic_file(path, "wb") as handle:
        np.save(handle, array)


def run_command(args: argparse.Namespace) -> None:
    if args.dump_logits is not None:
        check_new_file(args.dump_logits, "--dump-logits")
    tokens = prepare_tokens(args.model, args.seed, args.tokens, args.batch, args.seq_len)
    result = run_forward(args.backend, args.model, tokens, args.dtype, args.seed)
    batch, seq_len = tokens.shape
    print(f"backend     {result.backend} ({result.device}), model {args.model}, dtype {args.dtype}")
    print(f"tokens      batch {batch} x seq_len {seq_len}")
    print(f"loss        {result.loss:.6f} (next-token cross-entropy)")
    print(f"perplexity  {result.perplexity:.4f}")
    print(f"wall time   {result.wall_s * 1e3:.2f} ms (steady state; first call incl. compilation "
          f"{result.first_call_s * 1e3:.2f} ms)")
    print(f"peak memory {result.peak_memory_bytes / 2**20:.1f} MiB ({result.peak_memory_kind})")
    if args.dump_logits is not None:
        _save_npy_new(args.dump_logits, result.logits.astype("float32"))
        print(f"logits      float32 {list(result.logits.shape)} -> {args.dump_logits}")
