"""Testing kit for users: dense references, hypothesis strategies, block-mask assertions."""
