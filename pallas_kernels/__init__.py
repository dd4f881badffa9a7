"""Pallas kernels and their XLA references (only jax needed)."""
