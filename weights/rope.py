"""Rotary-embedding inverse frequencies, including Llama-3.1's `llama3` rescaling.

One definition for both backends: computed here in float64 with numpy and handed to each model as float32,
so torch and JAX rotate by the same angles. Follows transformers' `_compute_llama3_parameters`: wavelengths
shorter than original_max / high_freq_factor are kept, longer than original_max / low_freq_factor are divided
by `factor`, and the band between is interpolated smoothly.
"""

import numpy as np

from weights.config import LlamaConfig


def rope_inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """float32 [head_dim // 2]: angle per position for each rotated pair (HF rotate-half pairing)."""
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is not None:
        original = scaling.original_max_position_embeddings
        low_freq_wavelen = original / scaling.low_freq_factor
        high_freq_wavelen = original / scaling.high_freq_factor
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(in_band, smoothed, scaled)
    return inv_freq.astype(np.float32)
