"""The FP8 training recipe both backends follow (`twinflash train --fp8`): its constants, which of the model's
matmuls run in FP8, and the checks of a run that asks for it. The torch backend runs it through torchao's
`Float8Linear` (torch_impl/model.py), the JAX backend through its own scaled `dot_general` (jax_impl/model.py); this
module is what the two must agree on.

The recipe, torchao's dynamic per-tensor ("tensorwise") scaling with float8_e4m3fn for every operand:
  which      the decoder layers' linear matmuls (attention wq/wk/wv/wo, SwiGLU w1/w3/w2), forward and both
             backward matmuls; the embedding, the LM head, the norms and the attention (our kernels, the ring)
             stay in the compute dtype (bf16). A linear whose dims FP8 GEMMs cannot take stays bf16 (`fp8_linears`).
  scale      every step, per tensor: scale = float32(448 / max(amax, 1e-12)), amax the largest |value| of the bf16
             tensor; no rounding of the scale to a power of two. A weight is scaled whole (as gathered); an
             activation or output gradient per device, over that device's tokens (a torch rank's own tensor; JAX
             splits its global arrays into the devices' blocks for this).
  quantise   q = float8_e4m3fn(clamp(float32(x) * scale, -448, 448)) (saturating).
  matmul     out = bf16(dot(q_a, q_b) accumulated in float32 * (1 / scale_a * 1 / scale_b)); on GPUs the forward
             GEMM uses cuBLASLt's fast FP8 accumulation and the two backward GEMMs the full one (torchao's default
             Float8GemmConfig per GEMM; JAX: precision DEFAULT / HIGHEST). JAX rounds the factor
             1 / scale_a * 1 / scale_b to bf16 (2^-9 relative at most) so that XLA folds it into the GEMM.
  backward   dX = q(dY) . q(W), dW = q(dY)^T . q(X), each operand quantised as above with its own scale; the
             results in bf16 (each device's weight gradient is then summed over the devices in float32; JAX rounds
             that sum to bf16 once, as in its bf16 runs: jax_impl/train.py).
Master weights and optimizer state stay float32, as without --fp8.

One deliberate difference from torchao's named "tensorwise" recipe: torchao's default casts the output gradient to
float8_e5m2; this project's recipe (issue 17) keeps e4m3 for gradients too, which per-tensor scaling makes safe (the
scale moves each gradient's largest value to 448). `GRADIENT_DTYPE` is the one place to change that, in both backends.
"""

from __future__ import annotations

from weights.config import LlamaConfig
from weights.errors import BadInputError

FP8_DTYPE = "float8_e4m3fn"  # activations and weights
GRADIENT_DTYPE = "float8_e4m3fn"  # output gradients (module docstring)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_EPS = 1e-12  # torchao's floor under amax: an all-zero tensor gets a finite scale
GEMM_MULTIPLE = 16  # FP8 GEMMs (cuBLAS, torch._scaled_mm) need every matmul dim but the rows to be a multiple of 16
INSTALL_TORCHAO = 'pip install -e ".[fp8]"'


def _layer_linears(config: LlamaConfig) -> dict[str, tuple[int, int]]:
    """The decoder layer's linears by their name inside a layer, each with its (in, out) features."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"attention.wq": (c.hidden_size, q_dim), "attention.wk": (c.hidden_size, kv_dim),
            "attention.wv": (c.hidden_size, kv_dim), "attention.wo": (q_dim, c.hidden_size),
            "feed_forward.w1": (c.hidden_size, c.intermediate_size),
            "feed_forward.w3": (c.hidden_size, c.intermediate_size),
            "feed_forward.w2": (c.intermediate_size, c.hidden_size)}


def fp8_linears(config: LlamaConfig) -> tuple[frozenset[str], tuple[str, ...]]:
    """(the decoder-layer linears, by name inside a layer such as "attention.wq", that run in FP8; those that
    fall back to bf16 because a feature dim is not a multiple of GEMM_MULTIPLE). The same in every layer."""
    fits = {name: all(d % GEMM_MULTIPLE == 0 for d in dims) for name, dims in _layer_linears(config).items()}
    return frozenset(n for n, ok in fits.items() if ok), tuple(n for n, ok in fits.items() if not ok)


def fallback_line(config: LlamaConfig) -> str | None:
    """The one line a run prints when some linears stay bf16, or None when all run in FP8."""
    _, fallback = fp8_linears(config)
    if not fallback:
        return None
    dims = _layer_linears(config)
    return ("--fp8: " + ", ".join(f"{name} ({dims[name][0]}->{dims[name][1]})" for name in fallback)
            + f" stay bf16 in every layer (FP8 GEMMs need dims that are multiples of {GEMM_MULTIPLE})")


def is_fp8_linear(module_name: str, linears: frozenset[str]) -> bool:
    """Whether the module at `module_name` in the model ("layers.<i>.attention.wq" or, for JAX's stacked layers,
    "layers.attention.wq") is one of the decoder-layer `linears`."""
    parts = module_name.split(".")
    return parts[0] == "layers" and ".".join(parts[-2:]) in linears


def check_fp8_settings(fp8: bool, dtype: str, tokens_per_device: int) -> None:
    """Refuses --fp8 without bf16 compute, or with a device's tokens per step (the rows of the forward matmul and
    the inner dim of the weight-gradient matmul) not a multiple of GEMM_MULTIPLE."""
    if not fp8:
        return
    if dtype != "bf16":
        raise BadInputError(f"--fp8 needs --dtype bf16 (got {dtype}): the FP8 matmuls replace bf16 ones")
    if tokens_per_device % GEMM_MULTIPLE:
        raise BadInputError(f"--fp8 needs each device's tokens per step (batch x seq-len / devices = "
                            f"{tokens_per_device}) to be a multiple of {GEMM_MULTIPLE} (FP8 GEMMs)")
