"""Glue to Transformers, accelerate and the Trainer."""
