"""Frozen target LLMs (Qwen3, Qwen2, Llama) in Flax NNX."""
