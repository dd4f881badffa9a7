"""HF <-> JAX weight conversion: targets in, drafters in and out."""
