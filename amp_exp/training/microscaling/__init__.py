"""Block-scaled formats (MXFP8, MXFP4, NVFP4), emulated with torchao's casts."""
