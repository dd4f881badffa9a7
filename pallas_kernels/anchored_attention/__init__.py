"""DFlash anchored block attention, context part: ``context_attention(...) -> (out, lse)``.

Modules: ``mask`` (the mask object), ``api`` (dispatch), ``reference`` (dense), ``xla``
(anchor-chunked), ``pallas_triton`` (the kernels), ``tiles`` (which tiles the kernels visit).
"""

from pallas_kernels.anchored_attention.api import IMPLS, Partition, context_attention, resolve_impl
from pallas_kernels.anchored_attention.common import MASKED
from pallas_kernels.anchored_attention.mask import AnchoredMask, block_visible, context_visible

__all__ = [
    "IMPLS",
    "MASKED",
    "Partition",
    "AnchoredMask",
    "block_visible",
    "context_attention",
    "context_visible",
    "resolve_impl",
]
