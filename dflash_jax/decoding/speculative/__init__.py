"""Batched DFlash speculative decoding in JAX: the drafter proposes a block, the target verifies it.

Split by concern (as gemma splits its sampler):

  state.py       DecodeState: caches, sequences, lengths and per-row step logs on the device
  step.py        the jitted prefill, draft and draft + verify step
  acceptance.py  the acceptance rule (greedy, speculative sampling) and the draft-vocabulary mapping
  driver.py      SpeculativeDecoder: the Python loop over steps, batching, per-prompt results
"""

from dflash_jax.decoding.speculative.driver import SpecOutput, SpeculativeDecoder, speculative_generate

__all__ = ["SpecOutput", "SpeculativeDecoder", "speculative_generate"]
