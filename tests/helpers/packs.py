"""Packed batches for the parity tests: named document layouts, for any CP size (defined in
`helpers.reference`, next to the reference that runs them)."""

from helpers.reference import LAYOUTS, layout_lengths, make_pack  # noqa: F401 (re-exported)
