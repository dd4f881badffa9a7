"""What speculative decoding carries from one step to the next, per batch row, on the device.

Every array has a fixed shape per compile (output buffer, caches and logs are preallocated at
``prompt bucket + max_new_tokens + block size``); the rows advance at their own pace through
per-row lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class DecodeState:
    seq: jax.Array  # [B, L] int32 prompt + generated tokens
    start: jax.Array  # [B] index of the last emitted token (not yet in the target cache)
    max_len: jax.Array  # [B] prompt length + max_new_tokens
    done: jax.Array  # [B] bool
    target_cache: object  # target KVCache, lengths == start
    drafter_cache: object  # DrafterCache, lengths == start - pending_count
    pending_features: jax.Array  # [B, S, K*D] target features not yet in the drafter cache
    pending_count: jax.Array  # [B] how many of them are real
    steps: jax.Array  # [B] verify steps done
    log_produced: jax.Array  # [B, M] per step: tokens emitted (accepted + bonus, after the cuts)
    log_accepted: jax.Array  # [B, M] per step: drafts accepted
    log_drafted: jax.Array  # [B, M] per step: drafts the target checked


def take_rows(x, idx):
    """x [B, L, ...], idx [B] -> x[b, idx[b]]."""
    return x[jnp.arange(x.shape[0]), idx.astype(jnp.int32)]
