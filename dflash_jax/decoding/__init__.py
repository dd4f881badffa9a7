"""Decoding: plain and speculative generation, the evaluation harness and the regeneration of
training replies by the target itself.

  sampling.py      SamplingConfig and the filtered distributions both decoders draw from
  prompts.py       prompt encoding, the stop ids, padding and length-sorted batching
  generate.py      plain batched KV-cache generation (greedy or sampled)
  speculative/     DFlash speculative decoding: state, jitted step, acceptance rule, driver
  evaluation.py    the harness behind ``python -m dflash_jax.eval``: prompts, turn-by-turn decoding,
                   metrics, report
  benchmarks.py    MT-Bench and HumanEval, read from the PyPI wheels that ship them
  regeneration.py  the target's own replies (``python -m dflash_jax.regenerate``, the regen cache)

The command lines (``dflash_jax.eval``, ``dflash_jax.regenerate``) sit on top; nothing here imports them.
"""
