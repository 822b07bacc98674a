"""`BlockdiagCPCallback`: the setup checks at `on_train_begin`, the token metrics of the logs
(`TokenMeter`, fed once per optimizer step by `BlockdiagCPTrainerMixin.get_batch_samples`) and
what the steps ran (kernel, exchange, layout; fed by `BlockdiagCPTrainerMixin.training_step`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import TrainerCallback

from ...step.state import StepChoices
from .setup import check_model_setup, checkpointing_kwargs


@dataclass
class TokenMeter:
    """Tokens since the last log: real tokens per rank, pack slots over all ranks, packs with labels but no
    target token (`CPConfig.no_target_packs`), and the window's start time."""

    world_size: int
    real_tokens: list[int] = field(default_factory=list)
    pack_tokens: int = 0
    packs_without_targets: int = 0
    window_start: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.real_tokens = [0] * self.world_size
        self.pack_tokens = 0
        self.packs_without_targets = 0
        self.window_start = time.perf_counter()

    def add(self, real_tokens_per_rank: list[int], pack_tokens: int) -> None:
        if len(real_tokens_per_rank) != self.world_size:
            self.world_size = len(real_tokens_per_rank)
            self.reset()
        self.real_tokens = [a + b for a, b in zip(self.real_tokens, real_tokens_per_rank)]
        self.pack_tokens += pack_tokens

    def pop(self) -> dict[str, float]:
        """The window's metrics (empty if nothing was recorded), then start a new window."""
        if self.pack_tokens == 0:
            return {}
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        real = sum(self.real_tokens)
        mean = real / len(self.real_tokens)
        metrics: dict[str, float] = {
            "cp_tokens_per_second": real / elapsed,
            "cp_packing_efficiency": real / self.pack_tokens,
            "cp_rank_imbalance": max(self.real_tokens) / mean if mean else 1.0,
            "cp_packs_without_targets": self.packs_without_targets,
        }
        for rank, tokens in enumerate(self.real_tokens):
            metrics[f"cp_real_tokens_rank{rank}"] = tokens
        self.reset()
        return metrics


class BlockdiagCPCallback(TrainerCallback):
    """Setup checks at `on_train_begin` and token metrics for the logs of a block-diagonal CP run.

    Checks (each raises ValueError naming the setting and what is expected): the model uses
    `attn_implementation="blockdiag_cp"`, the world size is divisible by `cp_size`,
    `config.use_cache` is False, and activation checkpointing (if on) is non-reentrant.
    Metrics (added to every training log by `BlockdiagCPTrainerMixin`, over the window since
    the previous log): `cp_tokens_per_second` (real tokens of all ranks per second),
    `cp_packing_efficiency` (real tokens / pack tokens), `cp_real_tokens_rank{r}` and
    `cp_rank_imbalance` (max / mean of the per-rank real tokens), `cp_packs_without_targets` (packs
    with labels but no target token: they train nothing; `CPConfig.no_target_packs`); and, in the first log after a
    step ran a choice not logged before, `cp_attn_kernel`, `cp_kv_exchange` and `cp_layout` (what
    `auto` chose; several kernels joined by "+").
    """

    def __init__(self, cp_size: int = 1):
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size <= 0:
            raise ValueError(f"cp_size must be a positive integer; got {cp_size!r}")
        self.cp_size = cp_size
        self.meter = TokenMeter(world_size=1)
        self._choices_seen: set[StepChoices] = set()
        self._choices_due: dict[str, str] = {}

    def check_setup(self, model, world_size: int, activation_checkpointing_kwargs: dict | None = None) -> None:
        """Raise ValueError for a setup that would train wrongly or hang under block-diagonal CP."""
        check_model_setup(model, world_size, self.cp_size, activation_checkpointing_kwargs)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check_setup(model, args.world_size, checkpointing_kwargs(args))
        self.meter = TokenMeter(world_size=args.world_size)

    def record(self, real_tokens_per_rank: list[int], pack_tokens: int) -> None:
        """Account one optimizer step (all ranks' numbers, identical on every rank)."""
        self.meter.add(real_tokens_per_rank, pack_tokens)

    def record_packs_without_targets(self, packs: int) -> None:
        """Account the packs of one optimizer step that had labels but no target token (over every rank, each once)."""
        self.meter.packs_without_targets += packs

    def note_choices(self, choices: StepChoices) -> None:
        """Remember what a step ran; a choice not seen before goes into the next log."""
        if choices not in self._choices_seen:
            self._choices_seen.add(choices)
            self._choices_due.update(choices.as_logs())

    def pop_metrics(self) -> dict[str, float | str]:
        """The token metrics of the window since the last log, and the step choices not logged yet."""
        metrics: dict[str, float | str] = self.meter.pop()
        metrics.update(self._choices_due)
        self._choices_due = {}
        return metrics
