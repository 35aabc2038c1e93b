"""The Hopper kernel family of the JAX backend: Pallas Mosaic GPU kernels (`jax_impl/kernels/__init__.py`)."""
