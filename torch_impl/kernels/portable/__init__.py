"""The portable kernel family of the PyTorch backend: Triton `tl` kernels (`torch_impl/kernels/__init__.py`)."""
