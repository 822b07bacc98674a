"""The only places that read upstream internals: one module per upstream (`torch`, `transformers`,
`trl`, `liger`), each a few functions over an attribute or function that has no public equivalent
(`trl` also lists the private methods the TRL trainers override or call and the attributes they
read), checked by `tests/unit/test_compat.py` and `tests/unit/test_trl_compat.py` against the
versions `pyproject.toml` states. The bottom layer: it imports nothing else of the library, and
every layer but `planning` may import it."""
