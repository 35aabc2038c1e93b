"""The attention kernels of the PyTorch backend, one folder per kernel family, laid out as `jax_impl/kernels/`:
  flash_attention.py  the public entry: `flash_attention(...)`, the backend strings, the dispatch to a family or a
                      vendor's kernel, the check of `config=`;
  portable/           the portable family (Triton `tl` kernels: any CUDA GPU and the CPU interpreter):
                      forward.py, backward.py, config.py (`PortableConfig`, autotune spaces);
  hopper/             the Hopper family (Gluon sm_90 kernels): forward.py, backward.py, backward_ws.py (its
                      warp-specialised form), config.py (`HopperConfig`, `HopperBackwardConfig`);
  tiles.py            what more than one kernel module uses (tile helpers, the interpreter switch, the delta kernel).
"""
