"""The packs and model configs of the multi-GPU benchmark (`benchmarks/multigpu.py`), shared with
the scaling model (`bench scaling`), which rebuilds the benchmark's packs to predict its rows.

- `HIST_CSV`: a histogram of 13.4M real document lengths (`data/README.md`).
- `E2E_CONFIGS`: the Llama-architecture configs of the end-to-end part, by name.
- `attention_setups`: the packs of the attention and overlap parts, "magi" (MagiAttention's
  setup: real lengths capped at a quarter of the pack) and "ringflash" (ring-flash-attn's varlen
  benchmark: its four per-rank packs, scaled by G).
- `e2e_pack_lengths`: the end-to-end part's pack of S tokens.
"""

from __future__ import annotations

from pathlib import Path

from .common import histogram_lengths
from .model_hybrid import CONFIG_1B

HIST_CSV = Path(__file__).with_name("data") / "doc_length_distribution.csv"

CONFIG_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 21, rope_theta=500000.0, tie_word_embeddings=False,
)
CONFIG_TINY = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=1 << 16, tie_word_embeddings=False,
)
E2E_CONFIGS = {"1.2b": CONFIG_1B, "8b": CONFIG_8B, "tiny": CONFIG_TINY}

# ring-flash-attn benchmark/benchmark_varlen_kvpacked_func.py: per-rank cu_seqlens, scaled by G for the global pack.
RINGFLASH_CU = ([0, 8192], [0, 256, 7648, 8192], [0, 4096, 8192], [0, 3104, 6304, 7904, 8064, 8192])
SETUP_NAMES = ("magi", "ringflash")


def attention_setups(
    world_size: int, names=SETUP_NAMES, tokens_per_rank: int = 8192, magi_packs: int = 3, tiny: bool = False
) -> list[dict]:
    """Every pack of the named setups for `world_size` ranks: setup, pack name, document lengths
    (summing to tokens_per_rank x world_size) and the attention shape (heads, kv_heads, head_dim)."""
    tpr = 256 if tiny else tokens_per_rank
    setups = []
    for name in names:
        if name == "magi":
            heads, kv, dim = (4, 2, 16) if tiny else (64, 8, 128)
            for seed in range(magi_packs):
                lengths = histogram_lengths(HIST_CSV, tpr * world_size, seed=seed, cap_fraction=0.25)
                setups.append(dict(setup="magi", pack=f"hist{seed}", lengths=lengths, heads=heads, kv_heads=kv, head_dim=dim))
        elif name == "ringflash":
            heads, kv, dim = (4, 2, 16) if tiny else (32, 8, 128)
            for i, cu in enumerate(RINGFLASH_CU):
                base = [b - a for a, b in zip(cu, cu[1:])]
                lengths = [max(1, round(n * tpr / 8192)) * world_size for n in base]
                lengths[-1] += tpr * world_size - sum(lengths)
                setups.append(dict(setup="ringflash", pack=f"cu{i}", lengths=[n for n in lengths if n > 0],
                                   heads=heads, kv_heads=kv, head_dim=dim))
        else:
            raise ValueError(f"unknown attention setup {name!r}; known: {', '.join(SETUP_NAMES)}")
    return setups


def e2e_pack_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Document lengths of the end-to-end part's pack of `tokens` tokens (real lengths, capped at a quarter)."""
    return histogram_lengths(HIST_CSV, tokens, seed=seed, cap_fraction=0.25)
