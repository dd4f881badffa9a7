"""The anchored block mask of DFlash attention, for the drafter: ``AnchoredMask`` lives in
``pallas_kernels.anchored_attention.mask`` (with its rules and ASCII examples), so that the kernels
need nothing but jax; the drafter imports it from here.
"""

from pallas_kernels.anchored_attention.mask import AnchoredMask, block_visible, context_visible

__all__ = ["AnchoredMask", "block_visible", "context_visible"]
