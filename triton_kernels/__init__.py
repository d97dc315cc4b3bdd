"""Kernels: paged gather/scatter between engine pages and contiguous chunks (installed as radixkv.kernels)."""
