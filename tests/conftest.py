"""Test-wide set-up: emulated devices for JAX, Triton's interpreter without CUDA, and the `gpu` marker's skip.

JAX reads XLA_FLAGS once, when it first initialises its backend, so the 4 emulated host devices that the ring and
mesh tests need are requested here, before any test module imports jax. Likewise TRITON_INTERPRET is chosen here,
before anything imports triton, the way the `twinflash` CLI chooses it; the workers the tests start inherit both.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402

from compare.cli import interpret_triton_without_cuda  # noqa: E402

interpret_triton_without_cuda()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
