"""The attention kernels of the JAX backend, one folder per kernel family, laid out as `torch_impl/kernels/`:
  flash_attention.py  the public entry: `flash_attention(...)`, the backend strings, the dispatch to a family or
                      cuDNN, the check of `config=`, the custom VJP;
  portable/           the portable family (Pallas's Triton lowering: any CUDA GPU, and interpreted on CPU):
                      forward.py, backward.py, config.py (`PortableConfig`, the block-size heuristic);
  hopper/             the Hopper family (Pallas Mosaic GPU kernels for sm90, and its GPU interpreter on CPU):
                      forward.py, backward.py, config.py (`HopperConfig`, heuristics, shared-memory accounting);
  tiles.py            what more than one kernel module uses (index arithmetic, masks, block ranges, the Mosaic
                      warpgroup plumbing and launch).
"""
