"""`CPConfig`: the choices of a block-diagonal CP step, as one frozen object passed per call.

Users name kernels and exchanges in many spellings (`flash_attn`, `FA2`, `all-gather` ...);
a `CPConfig` holds only the canonical names, which come from the records (kernels:
`kernels.attention.registry`; exchanges: `planning.exchange_registry`, registered by `comm.exchanges`).
`make_cp_blockdiag_batch_and_ctx(..., config=CPConfig(...))` uses the given object; without
one it uses the process default, which `configure_cp` sets (also importable as
`configure_cp_varlen`, its first name). Nothing else configures a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .comm import exchanges as _exchanges  # noqa: F401  (registers the exchange records)
from .kernels import canonical_kernel_name, canonical_mixer_backend, get_kernel, kernel_names
from .planning import DEFAULT_TOLERANCE, KernelCost, canonical_exchange_name, exchange_records, get_exchange, layout_strategies
from .planning.mixer_plan import MIXER_TRANSPORTS


def normalize_backend(name: str) -> str:
    """Canonical kernel name (or "auto") for any accepted spelling of `attn_backend`."""
    return canonical_kernel_name(name)


def normalize_exchange(name: str) -> str:
    """Canonical exchange name (or "auto") for any accepted spelling of `kv_exchange`."""
    return canonical_exchange_name(name)


OVERLAP_SPLITS = ("queries", "keys")  # CPConfig.overlap besides False (True means "queries")
NO_TARGET_POLICIES = ("warn", "raise")  # CPConfig.no_target_packs
HEAD_TILES = ("auto", "compiled", "eager")  # CPConfig.head_tiles (logprobs.tiles)


@dataclass(frozen=True)
class CPConfig:
    """What a CP step runs with.

    attn_backend: local kernel, `auto` or a kernel name (any accepted spelling).
    kv_exchange: a registered exchange (`allgather`, `halo`, `a2a` and the head-parallel `heads`
      ship; any accepted spelling) or `auto`: per step the cheapest exact K/V exchange (halo, else
      a2a, else allgather; `planning.choose_exchange`; never `heads`). On a CP group over several nodes, from LOCAL_WORLD_SIZE,
      `auto` skips the exchanges that need a single node (halo, a2a) unless
      `allow_cross_node_a2a`.
    layout: layout strategy of packs sharded by the step (`contiguous`, `balanced`, or one
      registered with `planning.register_layout_strategy`); `balance_tolerance` is the
      balanced layout's target max/mean predicted cost - 1; `kernel_cost` the cost model it
      balances (None: the configured kernel's calibrated `KernelRecord.cost` when the kernel is
      named, else `planning.DEFAULT_KERNEL_COST`; `planning.PAIR_COUNT` balances allowed pairs).
    overlap: attend over what the rank holds while the K/V exchange is in flight, the rest after it;
      in backward, the reverse collective runs under the first part's backward (`planning.overlap`).
      `"queries"` (or True): the queries whose keys are all on their rank first, each query whole
      in one part, for every kernel; `"keys"`: every query over its rank's keys first, then over the
      other ranks' keys, merged by log-sum-exp (kernels that `returns_lse`: fa4, dense; layers with
      a sliding window attend in order). False: in order. Exact in every mode; the K/V exchanges
      (`allgather`, `halo`, `a2a`: records with `begin`) can overlap, `heads` cannot and is refused.
    mixer_backend: the kernels of recurrent token mixers (hybrid models' gated delta rule and short
      convolution; `kernels.mixers.registry`): `auto` (fla where it was verified, else torch), `torch`
      or `fla` (refused where not verified).
    mixer_transport: how those mixers cross the CP group: `heads` (head-parallel all-to-all; needs
      the heads divisible by G), `states` (state passing, any G) or `auto` (per step and layer, the
      cheaper by `planning.mixer_plan.MixerCost`, bytes at the group backend's rate).
    no_target_packs: what a pack with labels but no target token (every label -100 after the shift:
      masking gone wrong, or only one-token documents) does; it would train nothing (loss 0, zero
      gradients). `warn` (default): a WARNING on the CP group's first rank with the count so far, at
      the 1st, 2nd, 4th, 8th ... such pack of the process; `raise`: a ValueError on every rank of
      the group (the Trainers check every rank's packs before the step, so every rank raises).
    head_tiles: how the chunked log-prob head (`logprobs`: DPO, reward, RL) runs each tile's softmax
      math: `eager` (default: op by op), `auto` (through torch.compile on CUDA where it and Triton
      are available, else eagerly) or `compiled` (any device). The same numbers up to reduction
      order (`logprobs.tiles`); the compiled tiles are verified on CPU only.
    Spellings are normalised on construction; an unknown one raises ValueError listing the
    accepted names.
    """

    attn_backend: str = "auto"
    kv_exchange: str = "allgather"
    layout: str = "contiguous"
    balance_tolerance: float = DEFAULT_TOLERANCE
    allow_cross_node_a2a: bool = False
    kernel_cost: KernelCost | None = None
    overlap: bool | str = False
    mixer_backend: str = "auto"
    mixer_transport: str = "auto"
    no_target_packs: str = "warn"
    head_tiles: str = "eager"

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "attn_backend", normalize_backend(self.attn_backend))
        set_(self, "mixer_backend", canonical_mixer_backend(self.mixer_backend))
        if self.mixer_transport not in ("auto", *MIXER_TRANSPORTS):
            raise ValueError(
                f"mixer_transport={self.mixer_transport!r} is not supported; accepted values: auto, {', '.join(MIXER_TRANSPORTS)}"
            )
        set_(self, "kv_exchange", normalize_exchange(self.kv_exchange))
        if self.layout not in layout_strategies():
            raise ValueError(f"layout={self.layout!r} is not supported; accepted values: {', '.join(layout_strategies())}")
        tol = self.balance_tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
            raise ValueError(f"balance_tolerance must be a positive number; got {tol!r}")
        if not isinstance(self.allow_cross_node_a2a, bool):
            raise TypeError(f"allow_cross_node_a2a must be True or False; got {self.allow_cross_node_a2a!r}")
        if self.overlap is True:
            set_(self, "overlap", "queries")
        if self.overlap is not False and self.overlap not in OVERLAP_SPLITS:
            raise ValueError(f"overlap must be False, True, 'queries' or 'keys'; got {self.overlap!r}")
        if self.overlap and self.kv_exchange != "auto" and get_exchange(self.kv_exchange).begin is None:
            able = [r.name for r in exchange_records() if r.begin is not None]
            raise ValueError(
                f"overlap={self.overlap!r} needs a kv_exchange that can overlap attention ({', '.join(able)} or auto); "
                f"got kv_exchange={self.kv_exchange!r}"
            )
        if self.overlap == "keys" and self.attn_backend != "auto" and not get_kernel(self.attn_backend).returns_lse:
            able = [name for name in kernel_names() if get_kernel(name).returns_lse]
            raise ValueError(
                f"overlap='keys' merges partial softmaxes by their log-sum-exp, which attn_backend={self.attn_backend!r} "
                f"does not return (verified: {', '.join(able)} or auto); use overlap='queries' with it"
            )
        if self.no_target_packs not in NO_TARGET_POLICIES:
            raise ValueError(f"no_target_packs={self.no_target_packs!r} is not supported; accepted values: "
                             f"{', '.join(NO_TARGET_POLICIES)}")
        if self.head_tiles not in HEAD_TILES:
            raise ValueError(f"head_tiles={self.head_tiles!r} is not supported; accepted values: {', '.join(HEAD_TILES)}")
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
    kernel_cost: KernelCost | None = None,
    overlap: bool | str = False,
    mixer_backend: str = "auto",
    mixer_transport: str = "auto",
    no_target_packs: str = "warn",
    head_tiles: str = "eager",
) -> CPConfig:
    """Set the process default `CPConfig` (used by every step and `shard_batch` called without
    `config=`) and return it; its fields are CPConfig's.

    A convenience for scripts; libraries and tests should pass a `CPConfig` per call.
    Calling it with no arguments restores the defaults.
    """
    global _DEFAULT
    _DEFAULT = CPConfig(attn_backend, kv_exchange, layout, balance_tolerance, allow_cross_node_a2a, kernel_cost, overlap,
                        mixer_backend, mixer_transport, no_target_packs, head_tiles)
    return _DEFAULT


configure_cp_varlen = configure_cp  # its first name (it sets more than the varlen kernel)
