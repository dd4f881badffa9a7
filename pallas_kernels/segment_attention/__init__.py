"""The target's causal attention over packed rows (several documents a row, segment ids, GQA) as
a Pallas forward kernel: ``segment_attention(q, k, v, q_index, q_segment, kv_segment) -> out``.

Modules: ``api`` (entry point, ``auto`` choice), ``reference`` (dense), ``pallas_triton`` (the
kernel, its tiles and budget), ``tile_tables`` (which key tiles each query tile visits),
``validated`` (what GPU checks validated), ``lowering`` (CUDA lowering on a CPU host). The XLA path
the kernel is checked against is the target's own (``dflash_jax/target/attention.py``).
"""

from pallas_kernels.segment_attention.api import IMPLS, choose_impl, resolve_impl, segment_attention
from pallas_kernels.segment_attention.reference import segment_attention_reference

__all__ = ["IMPLS", "choose_impl", "resolve_impl", "segment_attention", "segment_attention_reference"]
