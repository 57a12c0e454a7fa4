"""Triton kernels for CUDA devices: optional, imported only where triton is present."""
