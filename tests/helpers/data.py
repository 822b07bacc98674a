"""Random document lengths for the sampler and data-distribution tests."""

from __future__ import annotations

import torch


def random_lengths(n: int, max_len: int, seed: int) -> list[int]:
    return torch.randint(1, max_len + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
