"""The bridge both backends stand on, framework-neutral (numpy + safetensors): the Llama config and presets,
the converted checkpoint format, its readers and writer, RoPE frequencies, token layouts across devices, FLOP counts."""

from weights.checkpoint import (ConvertedCheckpoint, RandomWeights, convert_hf_checkpoint, export_hf_checkpoint,
                                open_weights, parameter_shapes, write_converted_checkpoint)
from weights.config import PRESETS, LlamaConfig, RopeScaling, preset
from weights.errors import CheckpointError
from weights.rope import rope_inverse_frequencies

__all__ = [
    "PRESETS", "CheckpointError", "ConvertedCheckpoint", "LlamaConfig", "RandomWeights", "RopeScaling",
    "convert_hf_checkpoint", "export_hf_checkpoint", "open_weights", "parameter_shapes", "preset",
    "rope_inverse_frequencies", "write_converted_checkpoint",
]
