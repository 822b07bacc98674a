"""The only places that read upstream internals: one module per upstream (`torch`, `transformers`,
`trl`, `liger`), each a few functions over an attribute or function that has no public equivalent, checked
by `tests/unit/test_compat.py` against the versions `pyproject.toml` states. The bottom layer: it
imports nothing else of the library, and every layer but `planning` may import it."""
