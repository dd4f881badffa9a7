"""Chat data -> tokenised, loss-masked, packed batches."""
