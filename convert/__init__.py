"""HF <-> JAX weight conversion: targets in, drafters in and out (one ``KeyRule`` mapping,
``hf_mapping``), the speculators layout, SmolLM2 from GGUF."""
