"""The project's shared core, framework-neutral (numpy + safetensors), that both backends and the CLI stand on and that
imports neither: the run contract (`settings.py`: `TrainSettings`; `errors.py`: the bad-input errors and the exit
codes), the Llama config and presets, the converted checkpoint format, its readers and writer, RoPE frequencies,
token layouts across devices (`layout.py`), the attention shape rules and the ring's step table and traffic
(`attention.py`), the sequence-parallel schemes (`sequence_parallel.py`), the mesh and its sharding (`parallel.py`),
training data, schedule and resume rules, FLOP counts and the peak that MFU divides by (`flops.py`), and the one
atomic file writer (`atomic.py`)."""

from weights.checkpoint import (ConvertedCheckpoint, RandomWeights, convert_hf_checkpoint, export_hf_checkpoint,
                                is_hf_checkpoint, open_weights, write_converted_checkpoint)
from weights.config import PRESETS, LlamaConfig, RopeScaling, parameter_shapes, preset
from weights.errors import EXIT_BAD_INPUT, BadInputError, CheckpointError
from weights.rope import rope_inverse_frequencies

__all__ = [
    "EXIT_BAD_INPUT", "PRESETS", "BadInputError", "CheckpointError", "ConvertedCheckpoint", "LlamaConfig",
    "RandomWeights", "RopeScaling", "convert_hf_checkpoint", "export_hf_checkpoint", "is_hf_checkpoint", "open_weights",
    "parameter_shapes", "preset", "rope_inverse_frequencies", "write_converted_checkpoint",
]
