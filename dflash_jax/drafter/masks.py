"""The anchored block mask of DFlash attention (see ``pallas_kernels.anchored_attention.mask``,
where the object and its ASCII examples live, so that kernels need nothing but jax).

Example: T=8, two documents ``seg = 1 1 1 1 2 2 2 2``, anchors ``(2, 6)``, S=2, bidirectional::

                     context p       own block
                  0 1 2 3 4 5 6 7     s0 s1
    block 0  s0   x x . . . . . .     x  x
             s1   x x . . . . . .     x  x
    block 1  s0   . . . . x x . .     x  x
             s1   . . . . x x . .     x  x
"""

from pallas_kernels.anchored_attention.mask import AnchoredMask, block_visible, context_visible

__all__ = ["AnchoredMask", "block_visible", "context_visible"]
