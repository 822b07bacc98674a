"""What every planned layout must satisfy, shared by the balanced-layout and kernel-cost tests."""

from __future__ import annotations

import torch


def check_valid(layout, cp_size: int, seq_len: int) -> None:
    """A permutation of the padded pack (a multiple of 2·G, at least `seq_len`), L rows per rank in
    increasing pack order, and padding slots exactly where the pack has no token."""
    slots = layout.slot_positions
    s_pad = layout.padded_seq_len
    assert s_pad % (2 * cp_size) == 0 and s_pad >= seq_len
    assert slots.shape == (cp_size, s_pad // cp_size)
    assert torch.equal(torch.sort(slots.reshape(-1)).values, torch.arange(s_pad)), "not a permutation"
    assert bool((slots[:, 1:] > slots[:, :-1]).all()), "rows of a rank are not in increasing pack order"
    tok = layout.token_indices
    assert torch.equal(tok == -1, slots >= seq_len)
