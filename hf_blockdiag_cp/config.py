"""`CPConfig`: the choices of a block-diagonal CP step, as one frozen object passed per call.

Users name kernels and exchanges in many spellings (`flash_attn`, `FA2`, `all-gather` ...);
a `CPConfig` holds only the canonical names (kernel spellings come from the kernel records,
`kernels.registry`). `make_cp_blockdiag_batch_and_ctx(..., config=CPConfig(...))` uses the
given object; without one it uses the process default, which `configure_cp` (seed name
`configure_cp_varlen`) sets as a convenience.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .kernels import canonical_kernel_name
from .planning import DEFAULT_TOLERANCE, EXCHANGE_KINDS, KernelCost, layout_strategies

KV_EXCHANGES = ("auto", *EXCHANGE_KINDS)
DEFAULT_KV_CHUNKS = 1  # measured at G = 2: more groups were slower at every measured size (docs/performance.md)

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


def normalize_backend(name: str) -> str:
    """Canonical kernel name (or "auto") for any accepted spelling of `attn_backend`."""
    return canonical_kernel_name(name)


def normalize_exchange(name: str) -> str:
    """Canonical exchange name for any accepted spelling of `kv_exchange`."""
    if not isinstance(name, str):
        raise TypeError(f"kv_exchange must be a string, one of {', '.join(KV_EXCHANGES)}; got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    if key not in _EXCHANGE_SYNONYMS:
        raise ValueError(
            f"kv_exchange={name!r} is not supported; accepted values: {', '.join(KV_EXCHANGES)} "
            f"(synonyms: {', '.join(sorted(_EXCHANGE_SYNONYMS))}; case and '-'/'_' insensitive)"
        )
    return _EXCHANGE_SYNONYMS[key]


@dataclass(frozen=True)
class CPConfig:
    """What a CP step runs with.

    attn_backend: local kernel, `auto` or a kernel name (any accepted spelling).
    kv_exchange: `allgather`, `halo`, `a2a`, or `auto` (per step the cheapest exact one:
      halo, else a2a, else allgather; on a CP group over several nodes, from
      LOCAL_WORLD_SIZE, it keeps allgather unless `allow_cross_node_a2a`).
    layout: layout strategy of packs sharded by the step (`contiguous`, `balanced`, or one
      registered with `planning.register_layout_strategy`); `balance_tolerance` is the
      balanced layout's target max/mean predicted cost - 1; `kernel_cost` the cost model it
      balances (None: the configured kernel's calibrated `KernelRecord.cost` when the kernel is
      named, else `planning.DEFAULT_KERNEL_COST`; `planning.PAIR_COUNT` balances allowed pairs).
    kv_chunks: KV-head groups each layer's exchange is pipelined in on a CP group of 2 or
      more ranks: the next group's collective runs while the kernel works on the current one,
      forward and backward (`planning.head_groups`; 1 = one exchange, then one kernel call).
      Results are the same for any value; the default is measured (docs/performance.md).
    Spellings are normalised on construction; an unknown one raises ValueError listing the
    accepted names.
    """

    attn_backend: str = "auto"
    kv_exchange: str = "allgather"
    layout: str = "contiguous"
    balance_tolerance: float = DEFAULT_TOLERANCE
    allow_cross_node_a2a: bool = False
    kv_chunks: int = DEFAULT_KV_CHUNKS
    kernel_cost: KernelCost | None = None

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "attn_backend", normalize_backend(self.attn_backend))
        set_(self, "kv_exchange", normalize_exchange(self.kv_exchange))
        if self.layout not in layout_strategies():
            raise ValueError(f"layout={self.layout!r} is not supported; accepted values: {', '.join(layout_strategies())}")
        tol = self.balance_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
            raise ValueError(f"balance_tolerance must be a positive number; got {tol!r}")
        if not isinstance(self.allow_cross_node_a2a, bool):
            raise TypeError(f"allow_cross_node_a2a must be True or False; got {self.allow_cross_node_a2a!r}")
        if isinstance(self.kv_chunks, bool) or not isinstance(self.kv_chunks, int) or self.kv_chunks < 1:
            raise ValueError(f"kv_chunks must be a positive integer (1 = no pipelining); got {self.kv_chunks!r}")
        if self.kernel_cost is not None and not isinstance(self.kernel_cost, KernelCost):
            raise TypeError(f"kernel_cost must be a planning.KernelCost or None; got {type(self.kernel_cost).__name__}")

    def replace(self, **changes) -> "CPConfig":
        """A copy with some fields changed (normalised again)."""
        return dataclasses.replace(self, **changes)


_DEFAULT = CPConfig()


def default_config() -> CPConfig:
    """The process default (what a step uses when no config is passed)."""
    return _DEFAULT


def configure_cp(
    attn_backend: str = "auto",
    kv_exchange: str = "allgather",
    allow_cross_node_a2a: bool = False,
    *,
    layout: str = "contiguous",
    balance_tolerance: float = DEFAULT_TOLERANCE,
    kv_chunks: int = DEFAULT_KV_CHUNKS,
) -> CPConfig:
    """Set the process default `CPConfig` (used by every step built without `config=`) and return it.

    A convenience for scripts; libraries and tests should pass a `CPConfig` per call.
    Calling it with no arguments restores the defaults.
    """
    global _DEFAULT
    _DEFAULT = CPConfig(attn_backend, kv_exchange, layout, balance_tolerance, allow_cross_node_a2a, kv_chunks)
    return _DEFAULT


configure_cp_varlen = configure_cp  # the seed's name (it sets more than the varlen kernel)
