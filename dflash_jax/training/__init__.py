"""Training internals: anchors, loss, the jitted step, checkpoints, metrics."""
