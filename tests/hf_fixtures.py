"""Tiny Hugging Face Llama checkpoints made offline with transformers, one per configuration the bridge must handle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16, "rope_theta": 10000.0}

# name -> transformers.LlamaConfig keyword arguments. Small enough to run in milliseconds, big enough that a wrong
# rotary layout or a swapped projection moves the logits far past the tolerances.
VARIANTS: dict[str, dict] = {
    "gqa_llama3": dict(num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_SCALING),
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 rope_parameters=LLAMA3_SCALING),
    "head_dim_24": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}


def make_hf_checkpoint(directory: Path, variant: str, *, dtype=torch.float32, max_shard_size: str | None = None,
                       seed: int = 0) -> transformers.LlamaForCausalLM:
    """Saves a randomly initialised HF Llama of `variant` to `directory` and returns it (eager attention, eval)."""
    kwargs = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, rms_norm_eps=1e-5,
                  max_position_embeddings=512, tie_word_embeddings=False)
    kwargs.update(VARIANTS[variant])
    config = transformers.LlamaConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # HF initialises norms to exactly 1; random ones catch a norm weight applied wrongly
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    save = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **save)
    return model


def rewrite_config_as_transformers4(directory: Path) -> None:
    """Rewrites config.json in the 4.x spelling (top-level rope_theta / rope_scaling, torch_dtype)."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    path.write_text(json.dumps(config, indent=2))


def make_ring_hf_checkpoint(directory: Path, vocab_size: int = 97) -> None:
    """A random HF Llama our kernels take (head_dim 32: they take 32-256), with GQA (4 query heads over 2 KV heads),
    initialised wide enough (std 0.1) that attention is far from uniform, so a wrong mask shows. `vocab_size` 256 or
    more for what trains on byte-token text (`twinflash compare`'s checks)."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=192,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
