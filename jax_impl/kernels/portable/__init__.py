"""The portable kernel family of the JAX backend: Pallas Triton-lowering kernels (`jax_impl/kernels/__init__.py`)."""
