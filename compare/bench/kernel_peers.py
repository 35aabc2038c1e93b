"""The optional peers of `twinflash bench kernels`' JAX part (`pip install -e ".[peers]"`): tokamax and
FlashAttention-3 (flash-attn3-jax, FA3's CUDA kernels behind an XLA FFI binding). `jax_peers()` imports them and
gives each one's attention function, or for a peer that does not import an error row's text naming the install."""

from __future__ import annotations

import sys

PEERS_INSTALL = 'pip install -e ".[peers]"'


def import_tokamax():
    """tokamax, importable without xprof: tokamax imports the xprof profiler (32 MB) at import time though its
    attention never calls it, so when xprof is absent its modules are stood in by empty ones whose attributes
    fail only if used."""
    import importlib.abc
    import importlib.util
    import types

    class _Absent(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Absent(f"{self.__name__}.{name}")

        def __call__(self, *args, **kwargs):
            raise ImportError(f"{self.__name__}: xprof is not installed (tokamax profiling only)")

    class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            if name == "xprof" or name.startswith("xprof."):
                return importlib.util.spec_from_loader(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Absent(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    if importlib.util.find_spec("xprof") is None:
        sys.meta_path.append(_StandIn())
    import tokamax

    return tokamax


def _tokamax():
    tokamax = import_tokamax()
    return lambda q, k, v, causal: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic")


def _fa3():
    from flash_attn3_jax import flash_mha  # wheels for CPython 3.11/3.12 on x86_64 Linux only (the extra's marker)

    return lambda q, k, v, causal: flash_mha(q, k, v, is_causal=causal)


def jax_peers() -> tuple[dict, dict]:
    """({name: attend(q, k, v, causal) -> out, on [B, S, H, D] with GQA native}, {name: error text}) for the peers
    "tokamax" and "fa3". An ImportError (not installed, or its CUDA library does not load) is "skipped: ..." with
    the install command; any other failure of the import (an installed peer broken against this jax) is
    "import: ...": both become error rows, and the part goes on."""
    impls, errors = {}, {}
    for name, load in (("tokamax", _tokamax), ("fa3", _fa3)):
        try:
            impls[name] = load()
        except ImportError as err:
            errors[name] = f"skipped: {err} (optional peer: {PEERS_INSTALL})"[:300]
        except Exception as err:
            errors[name] = f"import: {type(err).__name__}: {err}"[:300]
    return impls, errors
