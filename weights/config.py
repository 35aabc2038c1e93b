"""The Llama model configuration shared by both backends, its named presets, HF `config.json` I/O, and the
canonical parameter names and shapes a config implies (`parameter_shapes`).

`LlamaConfig` is the single definition of a model's shape: the torch and JAX models, the checkpoint
converter and the FLOP counts all read it and nothing else. It reads Hugging Face `config.json` in both
spellings of RoPE settings: transformers 5.x writes `rope_parameters` (theta inside it), older files write
`rope_theta` and `rope_scaling` at the top level. It writes the 5.x spelling.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from weights.errors import BadInputError, CheckpointError

HF_LLAMA_ARCHITECTURE = "LlamaForCausalLM"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's `llama3` frequency rescaling (the only RoPE scaling type Llama checkpoints use)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    max_position_embeddings: int

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, field)) < 1:
                raise CheckpointError(f"config: {field} must be a positive integer, got {getattr(self, field)!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config: num_heads={self.num_heads} is not a multiple of "
                                  f"num_kv_heads={self.num_kv_heads}")

    @property
    def num_params(self) -> int:
        """Parameter count, embeddings included (an untied LM head counts separately)."""
        total = 0
        for shape in parameter_shapes(self).values():
            n = 1
            for dim in shape:
                n *= dim
            total += n
        return total

    def check_token_ids(self, tokens) -> None:
        """Refuses token ids outside [0, vocab_size) (an integer numpy array of any shape)."""
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise BadInputError(f"token ids must lie in [0, {self.vocab_size}); got min {int(tokens.min())}, "
                                f"max {int(tokens.max())}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        data = dict(data)
        scaling = data.pop("rope_scaling", None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise CheckpointError(f"config: unknown fields {sorted(unknown)}")
        missing = names - set(data) - {"rope_scaling"}
        if missing:
            raise CheckpointError(f"config: missing fields {sorted(missing)}")
        return cls(rope_scaling=RopeScaling(**scaling) if scaling else None, **data)

    # --- Hugging Face config.json -------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Reads a transformers LlamaConfig dict, 4.x (`rope_theta`/`rope_scaling`) or 5.x (`rope_parameters`)."""
        if hf.get("model_type") != "llama" and HF_LLAMA_ARCHITECTURE not in (hf.get("architectures") or []):
            raise CheckpointError(f"not a Llama config: model_type={hf.get('model_type')!r}, "
                                  f"architectures={hf.get('architectures')!r}")
        try:
            rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
            rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                )
            elif rope_type == "default":
                scaling = None
            else:
                raise CheckpointError(f"config: unsupported RoPE type {rope_type!r} (supported: default, llama3)")
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            return cls(
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            )
        except KeyError as missing:
            raise CheckpointError(f"config.json: missing key {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise CheckpointError(f"config.json: bad value ({bad})") from None

    def to_hf_dict(self, dtype: str = "float32") -> dict[str, Any]:
        """A transformers 5.x `config.json` dict describing this model."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {"rope_type": "llama3", "rope_theta": self.rope_theta, **dataclasses.asdict(self.rope_scaling)}
        return {
            "architectures": [HF_LLAMA_ARCHITECTURE],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "dtype": dtype,
        }


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise CheckpointError(f"corrupt JSON in {path}: {bad}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"corrupt JSON in {path}: expected an object")
    return data


_LLAMA3_ROPE_1B_3B = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
_LLAMA3_ROPE_8B = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)

PRESETS: dict[str, LlamaConfig] = {
    # Runs the CPU test suite in seconds. GQA (4 query heads over 2 KV heads) and llama3 RoPE scaling whose
    # original context (64) is short enough that all three frequency bands (kept, smoothed, divided by
    # `factor`) occur at head_dim 32. Vocabulary 256: one token per byte, for the byte-level training data.
    "tiny": LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                 original_max_position_embeddings=64),
                        tie_word_embeddings=False, max_position_embeddings=1 << 20),
    "llama2-7b": LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                             num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                             rope_scaling=None, tie_word_embeddings=False, max_position_embeddings=4096),
    "llama3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                               num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE_1B_3B, tie_word_embeddings=True,
                               max_position_embeddings=131072),
    "llama3.2-3b": LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
                               num_heads=24, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE_1B_3B, tie_word_embeddings=True,
                               max_position_embeddings=131072),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                               num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE_8B, tie_word_embeddings=False,
                               max_position_embeddings=131072),
}


def preset(name: str) -> LlamaConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise BadInputError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})") from None


def parameter_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor name of a model with this config, in model order, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (c.hidden_size,)
        shapes[p + "attention.wq.weight"] = (c.num_heads * c.head_dim, c.hidden_size)
        shapes[p + "attention.wk.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[p + "attention.wv.weight"] = (c.num_kv_heads * c.head_dim, c.hidden_size)
        shapes[p + "attention.wo.weight"] = (c.hidden_size, c.num_heads * c.head_dim)
        shapes[p + "ffn_norm.weight"] = (c.hidden_size,)
        shapes[p + "feed_forward.w1.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "feed_forward.w3.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "feed_forward.w2.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.hidden_size)
    return shapes
