"""Backend and exchange names, their synonyms, and the process-wide CP configuration.

Users name kernels and exchanges in many spellings (`flash_attn`, `FA2`, `all-gather` ...);
everything inside the library sees only the canonical names below.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTN_BACKENDS = ("auto", "dense", "flex", "varlen", "flash", "te")
KV_EXCHANGES = ("auto", "allgather", "halo", "a2a")

_BACKEND_SYNONYMS = {
    "auto": "auto",
    "dense": "dense",
    "sdpa": "dense",
    "flex": "flex",
    "flexattention": "flex",
    "flex_attention": "flex",
    "varlen": "varlen",
    "torch_varlen": "varlen",
    "varlen_attn": "varlen",
    "flash": "flash",
    "flash_attn": "flash",
    "flashattention": "flash",
    "flash_attention": "flash",
    "fa2": "flash",
    "te": "te",
    "transformer_engine": "te",
    "transformerengine": "te",
}

_EXCHANGE_SYNONYMS = {
    "auto": "auto",
    "allgather": "allgather",
    "all_gather": "allgather",
    "halo": "halo",
    "left_halo": "halo",
    "a2a": "a2a",
    "alltoall": "a2a",
    "all_to_all": "a2a",
    "all_to_all_v": "a2a",
    "alltoallv": "a2a",
}


def _canonical(value: str, synonyms: dict[str, str], field: str, accepted: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a string, one of {', '.join(accepted)}; got {type(value).__name__}")
    key = value.strip().lower().replace("-", "_")
    if key not in synonyms:
        raise ValueError(
            f"{field}={value!r} is not supported; accepted values: {', '.join(accepted)} "
            f"(synonyms: {', '.join(sorted(synonyms))}; case and '-'/'_' insensitive)"
        )
    return synonyms[key]


def normalize_backend(name: str) -> str:
    """Canonical kernel name for any accepted spelling of `attn_backend`."""
    return _canonical(name, _BACKEND_SYNONYMS, "attn_backend", ATTN_BACKENDS)


def normalize_exchange(name: str) -> str:
    """Canonical exchange name for any accepted spelling of `kv_exchange`."""
    return _canonical(name, _EXCHANGE_SYNONYMS, "kv_exchange", KV_EXCHANGES)


@dataclass(frozen=True)
class CPConfig:
    """Process-wide choices for block-diagonal CP steps (see `configure_cp_varlen`)."""

    attn_backend: str = "auto"
    kv_exchange: str = "allgather"
    # `auto` picks a needed-only exchange (halo / a2a) on a group that spans several nodes only
    # when this is True (all-to-all across nodes is often slower per byte than a ring all-gather).
    allow_cross_node_a2a: bool = False


_CONFIG = CPConfig()


def configure_cp_varlen(
    attn_backend: str = "auto", kv_exchange: str = "allgather", allow_cross_node_a2a: bool = False
) -> CPConfig:
    """Set the local kernel and the K/V exchange used by every following CP step.

    `kv_exchange="auto"` picks per step the cheapest exact exchange (halo, else a2a, else
    allgather); on a CP group over several nodes (from LOCAL_WORLD_SIZE) it keeps allgather
    unless `allow_cross_node_a2a=True`. Raises ValueError listing the accepted names for an
    unknown spelling. Returns the configuration now in force.
    """
    global _CONFIG
    if not isinstance(allow_cross_node_a2a, bool):
        raise TypeError(f"allow_cross_node_a2a must be True or False; got {allow_cross_node_a2a!r}")
    _CONFIG = CPConfig(
        attn_backend=normalize_backend(attn_backend),
        kv_exchange=normalize_exchange(kv_exchange),
        allow_cross_node_a2a=allow_cross_node_a2a,
    )
    return _CONFIG


def current_config() -> CPConfig:
    return _CONFIG
