"""`BlockdiagCPSFTTrainer`: TRL's `SFTTrainer` on packed data under exact block-diagonal CP.

TRL prepares the datasets as it always does: text and conversations are tokenized,
pre-tokenized data is used as given, `labels` are -100 where TRL masks them (completion-only
loss, assistant masks), and `SFTConfig(packing=True, max_length=N)` packs the documents with
TRL's `packing_strategy` into rows of at most N tokens. `BlockdiagCPTrainerMixin` then does
what it does for the Trainer (the same pack on the CP peers of a DP replica, one shard step per
micro-batch, the loss normalised over the optimizer step, sharded evaluate / predict); only its
`_packed_loader` is replaced, so that each of TRL's rows is one pack (`packs.py`).

TRL 1.16 refuses packing under accelerate's CP ("Packing is not compatible with context
parallelism (cp_size > 1)"), rightly: that CP knows one causal document per row. Here
accelerate's CP stays off (the mixin refuses a `parallelism_config` with CP) and the CP group is
the mixin's dp x cp mesh, so TRL's check never fires.

The loss is the token cross-entropy of `BlockdiagCPTrainer`, from the chunked log-prob head where the
model's own loss is the stock one (`trainer.head_loss`; no `[tokens, vocab]` logits, as TRL's fused LM
head), else the model's own: TRL's `compute_loss` (`loss_type="dft"`) is not used. TRL's metrics are logged as TRL logs them: `num_tokens` (the
real tokens trained on so far, each pack's once, not once per CP rank: the mixin's count of the
optimizer step), `mean_token_accuracy` and `entropy` (over the targets, label != -100, of every
rank's shard, combined over the CP group and the DP replicas when the trainer logs:
`metrics.TokenMetrics`), in training logs and as `eval_*` in `evaluate`'s metrics. In training the
head computes them per token next to the loss; otherwise they come from the model's logits: with
Liger's fused cross-entropy (`enable_fused_cross_entropy`) training builds none, so training logs
then hold `num_tokens` only. An MoE model's router auxiliary
loss is the whole pack's (`model_patches.router_aux_loss`), added as TRL adds it (`router_aux_loss_coef`
times it, over the accumulation steps) and logged as `aux_loss` in training logs.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from trl import SFTConfig, SFTTrainer

from ...compat.trl import DataCollatorForLanguageModeling, prepare_like_trl
from ...config import CPConfig
from ...step import STEP_KWARG
from ..trainer import BlockdiagCPTrainerMixin
from ..trainer.head_loss import HeadLossOutput
from ..trainer.setup import check_world, sum_over_world
from .metrics import TokenMetrics
from .packs import prepacked_dataloader
from .setup import warn_if_unverified_trl


def check_sft_config(args, cp_size: int, launched: bool = False) -> None:
    """Raise ValueError for an `SFTConfig` whose packs cannot run under block-diagonal CP (before any model work).
    With `launched`, the launched processes are checked against `cp_size` too, before the pack size (the
    order a user fixes them in)."""
    if not isinstance(args, SFTConfig):
        raise ValueError(
            f"args must be a trl.SFTConfig with packing=True and max_length set (the pack size); got {type(args).__name__}"
        )
    if not args.packing:
        raise ValueError(
            "SFTConfig.packing is False; expected True: every micro-batch is one of TRL's packs of max_length tokens"
        )
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size <= 0:
        raise ValueError(f"cp_size must be a positive integer; got {cp_size!r}")
    if launched:
        check_world(args, cp_size)
    length = args.max_length
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0 or length % (2 * cp_size):
        raise ValueError(
            f"SFTConfig.max_length is {length!r}; expected a positive multiple of 2*cp_size = {2 * cp_size}: it is "
            "the pack size, and every pack shards into 2*cp_size equal chunks"
        )
    if args.use_liger_kernel:
        raise ValueError(
            "SFTConfig.use_liger_kernel is True; expected False: TRL then computes its fused cross-entropy in "
            "compute_loss, which this trainer does not run (the model computes the loss). For Liger's fused "
            "cross-entropy call hf_blockdiag_cp.integrations.liger.enable_fused_cross_entropy(model) before "
            "building the trainer (examples/sft_trl.py --fused-ce)"
        )
    if args.loss_type != "nll":
        raise ValueError(
            f"SFTConfig.loss_type is {args.loss_type!r}; expected 'nll': under block-diagonal CP the model computes "
            "the token-weighted cross-entropy itself"
        )


class BlockdiagCPSFTTrainer(BlockdiagCPTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` whose packs train and evaluate sharded over a CP group, exactly per document.

    Arguments: those of `SFTTrainer` (no `data_collator`: TRL's own builds every pack), plus
      cp_size: ranks per CP group (1 = no CP); the world size must be a multiple.
      cp_config: the `CPConfig` of every CP step (default: the process default, `configure_cp`).
      cp_mesh: optional 1-D DeviceMesh or ProcessGroup of this rank's CP group (as in `BlockdiagCPTrainer`).
    `args` must be an `SFTConfig` with `packing=True`, `max_length` a multiple of 2*cp_size (the pack
    size), `per_device_train_batch_size=1` and `loss_type="nll"`. The model uses
    `attn_implementation="blockdiag_cp"`; DDP or FSDP2 over the dp x cp ranks as the Trainer sets them up.
    """

    head_stats = ("entropy", "is_top1")  # TRL's token metrics, per token from the chunked head

    def __init__(self, *args, cp_size: int = 1, cp_config: CPConfig | None = None, cp_mesh=None, **kwargs):
        warn_if_unverified_trl()
        sft_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_sft_config(sft_args, cp_size, launched=True)
        if kwargs.get("data_collator", args[2] if len(args) > 2 else None) is not None:
            raise ValueError(
                "data_collator must not be given to BlockdiagCPSFTTrainer: TRL's own collator reads its packs "
                "(position_ids per document), and the trainer pads and shards them"
            )
        self.token_metrics = TokenMetrics()
        super().__init__(*args, cp_size=cp_size, max_tokens=sft_args.max_length, cp_mesh=cp_mesh,
                         cp_config=cp_config, **kwargs)
        if not isinstance(self.data_collator, DataCollatorForLanguageModeling):
            raise ValueError(
                f"SFTTrainer chose {type(self.data_collator).__name__}; expected DataCollatorForLanguageModeling "
                "(text datasets): vision-language datasets are not supported by BlockdiagCPSFTTrainer"
            )
        self._router_aux_values: list[float] = []  # this rank's auxiliary loss per training micro-batch since the last log
        self.packing = replace(self.packing, pad_token_id=self.data_collator.pad_token_id)

    def _packed_loader(self, dataset, shuffle: bool, drop_last: bool):
        """TRL's prepared rows, one pack each, sharded for this rank (the mixin's hook for training and eval data)."""
        return prepacked_dataloader(dataset, self.data_collator, self.packing.max_tokens,
                                    **self._loader_options(shuffle, drop_last))

    def _prepared(self, dataset, name: str):
        """A dataset passed to `evaluate` / `predict`, prepared as TRL prepares eval data at construction
        (tokenized, labels masked, packed unless `eval_packing=False`); the datasets prepared then pass as they are."""
        own = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        if dataset is None or isinstance(dataset, str) or any(dataset is d for d in own):
            return dataset
        return prepare_like_trl(self, dataset, name)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sharded evaluation (the mixin's): `{prefix}_loss` is the token-weighted loss over every eval
        target; TRL's `log` adds `eval_num_tokens`, `eval_mean_token_accuracy` and `eval_entropy`."""
        if isinstance(eval_dataset, dict):  # prepare each part once, then evaluate it under its own prefix
            metrics: dict[str, float] = {}
            for name, part in eval_dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        was_training = self.model.training
        self.model.eval()  # TRL's `log` files metrics by the model's mode: the eval ones, as in the stock evaluation
        try:
            return super().evaluate(self._prepared(eval_dataset, metric_key_prefix), ignore_keys, metric_key_prefix)
        finally:
            self.model.train(was_training)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """Sharded prediction (the mixin's) on `test_dataset` prepared like eval data: logits of every pack."""
        return super().predict(self._prepared(test_dataset, metric_key_prefix), ignore_keys, metric_key_prefix)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The mixin's loss (the model's own under CP), and the step's sums for TRL's token metrics."""
        if STEP_KWARG not in inputs:  # not a CP step: the mixin's stock path (TRL's compute_loss)
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self._add_token_metrics("train" if self.model.training else "eval", outputs, inputs, fill=False)
        return (loss, outputs) if return_outputs else loss

    def _router_aux_scale(self) -> float:
        """The model's own loss without its router auxiliary loss: TRL adds its own term (`_with_router_aux`)."""
        return 0.0

    def _with_router_aux(self, loss, aux, num_items_in_batch):
        """TRL's MoE term: `router_aux_loss_coef` times the pack's auxiliary loss, averaged over the accumulation
        steps (TRL's per-micro-batch mean, which DDP averages over the ranks); recorded for the `aux_loss` log."""
        if aux is None or not self.aux_loss_enabled:
            return loss
        self._router_aux_values.append(float(aux.detach()))
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        return loss + self.router_aux_loss_coef * aux / steps

    def _eval_pack_done(self, outputs, local: dict, fill: bool) -> None:
        """The mixin's hook after each sharded eval pack: the sums of TRL's eval token metrics."""
        self._add_token_metrics("eval", outputs, local, fill)

    def _add_token_metrics(self, mode: str, outputs, local: dict, fill: bool) -> None:
        if isinstance(outputs, HeadLossOutput):  # the head's per-token statistics: no logits were built
            self.token_metrics.add_token_stats(mode, outputs.entropy, outputs.is_top1, local["shift_labels"], fill)
            return
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        self.token_metrics.add(mode, logits, local["shift_labels"], fill)

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """TRL's token metrics into the log, as TRL's `log` adds them: the mode's metrics since the last
        log (one all-reduce, on every rank) and `num_tokens`, the real tokens trained on so far."""
        mode = "train" if self.model.training else "eval"
        recorded = bool(self.token_metrics.rows[mode])
        metrics = self.token_metrics.pop(mode, self.cp_coordinates.world_size)
        if recorded:
            metrics["num_tokens"] = self.cp_tokens_trained
        if mode == "train" and self.aux_loss_enabled:  # TRL's mean over the micro-batches and ranks
            values, self._router_aux_values = self._router_aux_values, []
            total, count = sum_over_world(torch.tensor([sum(values), len(values)], dtype=torch.float64),
                                          self.cp_coordinates.world_size).tolist()
            if count:
                metrics["aux_loss"] = total / count
        logs.update({f"eval_{k}" if mode == "eval" else k: v for k, v in metrics.items()})
        super().log(logs, *args, **kwargs)
