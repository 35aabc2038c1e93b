"""The Hopper kernel family of the PyTorch backend: Gluon sm_90 kernels (`torch_impl/kernels/__init__.py`)."""
