"""Lowering the kernel for CUDA on a host without a GPU: the drafter kernel's helper
(``anchored_attention/lowering.py``), which emits Triton custom calls without compiling them."""

from pallas_kernels.anchored_attention.lowering import DEFAULT_DEVICE_KIND, TRITON_CALL, lower_for_cuda

__all__ = ["DEFAULT_DEVICE_KIND", "TRITON_CALL", "lower_for_cuda"]
