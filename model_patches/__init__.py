"""Per-family patches for models that need more than the attention interface (see README)."""
