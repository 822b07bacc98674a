"""Packed batches for the parity tests: named document layouts, for any CP size. One copy, in
`hf_blockdiag_cp.bench.reference`; re-exported here."""

from hf_blockdiag_cp.bench.reference import LAYOUTS, layout_lengths, make_pack  # noqa: F401 (re-exported)
