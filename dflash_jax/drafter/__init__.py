"""The DFlash drafter: config, model, attention."""
