"""`BlockdiagCPDPOTrainer`: TRL's `DPOTrainer` on packed pairs under exact block-diagonal CP.

TRL prepares the data as it always does (prompt extraction, EOS, tokenization of text and
conversations, dropping prompts that fill `max_length`); pre-tokenized `prompt_ids` /
`chosen_ids` / `rejected_ids` are used as given. Each pair's two sequences (truncated as TRL's
collator truncates them) go into one pack with other pairs, padding-free (`data.pairs`); the pack
is sharded over the CP group. The policy and the reference run on the same shard step; their
completion log-probs come per document from `logprobs.document_log_probs` (no `[tokens, vocab]`
logits), and TRL 1.16's losses and metrics are computed from those sums (`dpo_loss`), per pair. An MoE
policy's router auxiliary loss (on where TRL turns it on: `aux_loss_enabled`) is the whole pack's
(`model_patches.router_aux_loss`), added once per micro-batch as TRL adds it and logged as `aux_loss`.

The reference: `ref_model` (same architecture and vocabulary; run on `blockdiag_cp` like the policy), else
for a PEFT policy the policy with its adapters disabled (or its "ref" adapter), else the log-probs
precomputed before training (`precompute_ref_log_probs=True`, packed the same way).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device
from trl import DPOConfig, DPOTrainer

from ...compat.trl import overrides, use_adapter
from ...data.loader import micro_batch_packs
from ...data.pairs import PAIRS_KEY, PromptCompletionPairs
from ...logprobs import DocumentLogProbs, document_log_probs
from ...model_patches.router_aux_loss import router_aux_scope, scope_loss
from ...step import make_cp_blockdiag_batch_and_ctx
from ..trainer.setup import check_same_weights, world_group
from .dpo_loss import PairTerms, check_loss_types, micro_batch_losses, pair_losses
from .preference import PairMetrics, PreferenceCPMixin, check_batching, row_mean
from .setup import (
    is_peft, pack_size, pad_token_of, prepare_reference, require_pair_columns, warn_if_unverified_trl,
)

logger = logging.getLogger(__name__)

DPO_SUMS = ("pairs", "rewards_chosen", "rewards_rejected", "accuracies", "margins", "logps_chosen", "logps_rejected",
            "entropy", "targets", "logits_chosen", "targets_chosen", "logits_rejected", "targets_rejected",
            "top1_chosen", "aux_loss", "aux_batches")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class BlockdiagCPDPOTrainer(PreferenceCPMixin, DPOTrainer):
    """`trl.DPOTrainer` whose packed pairs train and evaluate sharded over a CP group, exactly per sequence.

    Arguments: those of `DPOTrainer` (as keywords; no `data_collator`), plus
      cp_size: ranks per CP group (1 = padding-free packing only); the world size must be a multiple.
      batching: "pairs" (default): `DPOConfig.per_device_train_batch_size` pairs per micro-batch of each CP
        group (a DP replica), in the stock Trainer's order, so a step holds per_device_train_batch_size *
        gradient_accumulation_steps * dp_size pairs, as TRL's does; each micro-batch in as few packs as
        max_tokens allows. "tokens": per_device_train_batch_size=1, one pack of as many pairs as fit per
        micro-batch (fuller packs, more throughput; the pairs per step vary with their lengths).
      max_tokens: the pack size, a multiple of 2*cp_size (default: 2 * DPOConfig.max_length, times
        per_device_train_batch_size with batching="pairs", rounded up to one); a pair (both sequences after
        truncation) must fit.
      cp_config, cp_mesh: as for `BlockdiagCPSFTTrainer`.
    Every `loss_type` of TRL 1.16 runs (docs/usage.md says how `sft` and `aot` see a pack).
    """

    def __init__(self, model, ref_model=None, args: DPOConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, cp_size: int = 1, batching: str = "pairs",
                 max_tokens: int | None = None, cp_config=None, cp_mesh=None, **kwargs):
        warn_if_unverified_trl()
        if not isinstance(args, DPOConfig):
            raise ValueError(f"args must be a trl.DPOConfig; got {type(args).__name__}")
        self.batching = check_batching(batching)
        check_loss_types(args)
        if args.use_liger_kernel:
            raise ValueError("DPOConfig.use_liger_kernel is True; expected False: Liger's kernels are not verified "
                             "under block-diagonal CP in the DPO trainer")
        if args.padding_free:  # packs hold no padding here; TRL's own flag would only warn and fall back
            logger.info("DPOConfig.padding_free=True is not needed: BlockdiagCPDPOTrainer's packs hold no padding; "
                        "the trainer runs on a copy of the config with padding_free=False (yours is unchanged)")
            args = copy.copy(args)
            args.padding_free = False
        self.pair_metrics = PairMetrics(DPO_SUMS)
        self._pending_reference: list[str] = []
        super().__init__(
            model=model, ref_model=ref_model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, cp_size=cp_size,
            max_tokens=pack_size(max_tokens, args.max_length, cp_size, self._default_pack_pairs(args), "DPOConfig"),
            pad_token_id=pad_token_of(processing_class), cp_config=cp_config, cp_mesh=cp_mesh, **kwargs)
        if self.ref_model is not None:
            prepare_reference(self.model, self.ref_model)
            check_same_weights({"ref_model": self.ref_model}, self.args.world_size)
        self._check_pairs()
        self._check_micro_batch_losses()
        for name in self._pending_reference:  # TRL asked for them during its __init__, before the CP setup
            self._store_reference(name)

    def _check_micro_batch_losses(self) -> None:
        """With batching="pairs", a loss type over the whole micro-batch (`micro_batch_losses`) needs every
        micro-batch in one pack: the train dataset's per_device_train_batch_size longest pairs must fit max_tokens."""
        losses = micro_batch_losses(self.args)
        if self.batching != "pairs" or not losses:
            return
        size = self.args.per_device_train_batch_size
        longest = sum(sorted(self._pair_lengths(self.train_dataset), reverse=True)[:size])
        if longest > self.packing.max_tokens:
            raise ValueError(
                f"DPOConfig.loss_type holds {losses}, computed over TRL's whole micro-batch, so each micro-batch must "
                f"run as one pack; the {size} longest pairs (per_device_train_batch_size) hold {longest} tokens, more "
                f"than max_tokens={self.packing.max_tokens}: raise max_tokens to at least {longest} (a multiple of "
                "2*cp_size) or lower per_device_train_batch_size"
            )

    # ---------------------------------------------------------------- data

    @overrides("DPOTrainer")
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        """TRL's preparation; a pre-tokenized dataset (prompt_ids, chosen_ids, rejected_ids) as given."""
        columns = require_pair_columns(dataset, dataset_name, ("prompt_ids", "chosen_ids", "rejected_ids"))
        if {"prompt_ids", "chosen_ids", "rejected_ids"} <= columns:
            return dataset
        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        return self._count_prepared(dataset_name, dataset, prepared)

    def _dropped_by(self) -> str:
        return (f"it drops a pair whose prompt alone fills DPOConfig.max_length={self.args.max_length} "
                f"(truncation_mode={self.args.truncation_mode!r} leaves no completion token)")

    def _pair_reader(self):
        return PromptCompletionPairs(self.args.max_length, self.args.truncation_mode)

    def _pair_limits(self) -> str:
        return f"each truncated to DPOConfig.max_length={self.args.max_length}"

    def _pair_collator_options(self) -> dict:
        return dict(labels=True, pair_columns=REF_COLUMNS, ld_alpha=self.ld_alpha)

    # ---------------------------------------------------------------- reference log-probs

    @overrides("DPOTrainer")
    def _precompute_ref_logps(self, dataset, name: str, batch_size: int):
        """The reference's log-probs as dataset columns, computed packed under CP (TRL's columns)."""
        if not hasattr(self, "cp_coordinates"):  # during DPOTrainer.__init__: after the CP setup
            self._pending_reference.append(name)
            return dataset
        return self._with_reference_columns(dataset)

    def _store_reference(self, name: str) -> None:
        if name == "train":
            self.train_dataset = self._with_reference_columns(self.train_dataset, train=True)
        elif isinstance(self.eval_dataset, dict):
            self.eval_dataset[name] = self._with_reference_columns(self.eval_dataset[name])
        else:
            self.eval_dataset = self._with_reference_columns(self.eval_dataset)

    def _with_reference_columns(self, dataset, train: bool = False):
        """`dataset` with the reference's summed completion log-probs per pair (TRL's columns), computed where the
        policy's live sums are next computed, in the same pack and place: the train pairs on the first epoch's
        micro-batches (`train=True`), others on `evaluate`'s packs. A packed sum changes with its pack at rounding
        level; computed alike, the policy's sums equal the stored ones bitwise while it is the reference (step 1),
        so TRL's ties stay ties. A pair the epoch meets twice keeps its first pack's sums; one it drops (and every
        pair of a non-train dataset) gets `evaluate`'s packs'."""
        if all(column in dataset.column_names for column in REF_COLUMNS):
            return dataset
        values = self._reference_sums(self._train_steps(self._train_loader())) if train else {}
        missing = [i for i in range(len(dataset)) if i not in values]  # the same on every rank (gathered values)
        if missing:
            part = dataset if len(missing) == len(dataset) else dataset.select(missing)
            loader = self._packed_loader(part, shuffle=False, drop_last=False)
            steps = ((index, ctx, local) for _, ctx, local, _, index in self._eval_steps(loader, self._reference()[0]))
            values.update({missing[i]: sums for i, sums in self._reference_sums(steps).items()})
        columns = [[values[i][k] for i in range(len(dataset))] for k in (0, 1)]
        for column, name in zip(columns, REF_COLUMNS):
            dataset = dataset.add_column(name, column)
        return dataset

    def _train_steps(self, loader):
        """Every real pack of the train `loader`'s first epoch as a forward-only CP step, sharded as training shards
        it, in the reference's eval mode, `no_grad` and the stock forward context: `(micro-batch index, train_ctx,
        local)`; filler packs skipped."""
        reference, _ = self._reference()
        was_training = reference.training
        reference.eval()
        try:
            with torch.no_grad(), self._eval_forward_context():
                for j, batch in enumerate(loader):
                    for pack in micro_batch_packs(self._local_batch(batch)):
                        if pack[PAIRS_KEY].filler:
                            continue
                        train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(
                            self.cp_mesh, None, send_to_device(pack, self.args.device),
                            padding_token_id=self.packing.pad_token_id, config=self.cp_config, model=reference)
                        yield j, train_ctx, local
        finally:
            reference.train(was_training)

    def _reference_sums(self, steps) -> dict[int, tuple[float, float]]:
        """{dataset row: (chosen, rejected) reference sums} over every rank's `(place, train_ctx, local)` steps (place
        None: a pack that only evens an eval round), each computed as `_pair_losses` computes the policy's (the same
        statistics); a row met twice keeps its earliest place's. Collective (one all-gather)."""
        mine = []
        reference, context = self._reference()
        for place, train_ctx, local in steps:
            pairs = local.pop(PAIRS_KEY)
            with train_ctx(), context:
                result = document_log_probs(reference, local, stats=self._policy_stats())
                sums = self._sequence_log_probs(reference, local, pairs, result).detach().cpu()
            if place is not None and self.cp_coordinates.cp_rank == 0:
                mine.extend((place, i, tuple(s)) for i, s in zip(pairs.indices.tolist(), sums.tolist()))
        everyone = [mine]
        if world_group(self.cp_coordinates.world_size) is not None:
            everyone = [None] * self.cp_coordinates.world_size
            dist.all_gather_object(everyone, mine)
        values: dict[int, tuple[float, float]] = {}
        for _, i, sums in sorted((row for part in everyone for row in part), key=lambda row: row[0]):
            values.setdefault(i, sums)
        return values

    def _policy_stats(self) -> tuple[str, ...]:
        """The per-token statistics the policy's forward computes (TRL's metrics; WPO's weights)."""
        return ("entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if self.use_weighting else ())

    def _reference(self):
        """(the model that gives reference log-probs, the context it runs in)."""
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        if is_peft(self.model):
            inner = self.accelerator.unwrap_model(self.model)
            return self.model, use_adapter(inner, "ref" if "ref" in inner.peft_config else None)
        return self.model, contextlib.nullcontext()  # precomputed before training: the policy is still the reference

    # ---------------------------------------------------------------- loss

    def _sequence_log_probs(self, model, local: dict, pairs, result: DocumentLogProbs | None = None,
                            stats: tuple[str, ...] = ()):
        """[P, 2] summed completion log-probs (chosen, rejected) of the pack's pairs, LD-DPO-weighted
        with `ld_alpha`; `result` is reused when given, else the model runs."""
        result = document_log_probs(model, local, stats=stats) if result is None else result
        sums = result.sums
        weight = pairs.streams.get("target_weight")
        if weight is not None:
            sums = result.per_document(result.token_log_probs * weight)
        return sums.view(pairs.pairs, 2)

    def _pair_losses(self, model, local: dict, pairs, mode: str, counted: bool) -> torch.Tensor:
        if "ref_chosen_logps" in pairs.values:
            ref = torch.stack([pairs.values[name] for name in REF_COLUMNS], dim=1).to(pairs.completion_tokens.device)
        else:
            reference, context = self._reference()
            with torch.no_grad(), context:
                ref = self._sequence_log_probs(reference, local, pairs)
        stats = self._policy_stats()
        aux = None
        if self.aux_loss_enabled:  # the policy's router auxiliary loss over the pack, as TRL asks its forward for it
            with router_aux_scope(model, request=True) as router:
                result = document_log_probs(model, local, stats=stats)
            aux = scope_loss(router, f"router_aux_loss_coef={self.router_aux_loss_coef}")
        else:
            result = document_log_probs(model, local, stats=stats)
        policy = self._sequence_log_probs(model, local, pairs, result)
        counts = result.counts.view(pairs.pairs, 2)
        weights = None
        if self.use_weighting:  # WPO: exp(mean over the completion of log p - log Σ p²), per sequence
            mean = (result.sums.detach() - result.stat_sums["log_sum_sq_probs"]).view(pairs.pairs, 2) / counts.clamp(min=1)
            weights = torch.exp(mean).prod(dim=1)
        tokens = pairs.completion_tokens.to(policy.device).float()
        terms = PairTerms(policy[:, 0], policy[:, 1], ref[:, 0].to(policy.dtype), ref[:, 1].to(policy.dtype),
                          tokens[:, 0], tokens[:, 1], result.sums.view(pairs.pairs, 2)[:, 0].sum(),
                          *pairs.micro_batch, weights)
        losses = pair_losses(self.args, terms)
        self._add_metrics(mode, terms, result, counts, counted and self.cp_coordinates.cp_rank == 0, aux)
        if aux is not None and mode == "train":
            self._router_aux = aux if counted else aux * 0.0  # compute_loss adds it once per pack (0: a filler pack)
        elif aux is not None:  # evaluation: each pair's share, so a pack's loss sum weighs it as TRL weighs a batch
            losses = losses + self.router_aux_loss_coef * aux
        return losses

    def _train_loader(self):
        """TRL's micro-batches (`PreferenceCPMixin`); refused up front where one spans several packs with the
        router auxiliary loss on (`_check_aux_packs`)."""
        loader = super()._train_loader()
        if self.aux_loss_enabled and self.batching == "pairs":
            self._check_aux_packs(max(len({s.pack for s in slots}) for slots in loader.batch_sampler.micro_batches()))
        return loader

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.aux_loss_enabled:  # every DP replica of a round runs as many packs: all ranks raise alike
            self._check_aux_packs(len(micro_batch_packs(inputs)))
        return super().training_step(model, inputs, num_items_in_batch)

    def _check_aux_packs(self, packs: int) -> None:
        """Refuse a micro-batch of several packs with the MoE router auxiliary loss on: TRL's term is the
        micro-batch's `E * sum_e f_e * P_e`, not linear in the router statistics of its packs, and each pack
        runs its own backward, so no sum of per-pack terms gives it."""
        if packs > 1:
            raise ValueError(
                f"a micro-batch of {packs} packs with the MoE router auxiliary loss on (router_aux_loss_coef="
                f"{self.router_aux_loss_coef}): TRL's auxiliary loss is the whole micro-batch's and is not a sum over "
                f"packs; raise max_tokens={self.packing.max_tokens} so that DPOConfig.per_device_train_batch_size="
                f"{self.args.per_device_train_batch_size} pairs fit one pack, lower per_device_train_batch_size, pass "
                "batching='tokens', or set DPOConfig.router_aux_loss_coef=0.0"
            )

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The pairs' loss (`PreferenceCPMixin`), plus TRL's MoE term in training: `router_aux_loss_coef` times the
        pack's router auxiliary loss, over the accumulation steps (TRL's DPO loss of a micro-batch, which the
        Trainer divides by them)."""
        self._router_aux = None
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        aux, self._router_aux = self._router_aux, None
        if aux is None:
            return result
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        term = self.router_aux_loss_coef * aux / steps
        return (result[0] + term, result[1]) if return_outputs else result + term

    def _add_metrics(self, mode: str, terms: PairTerms, result: DocumentLogProbs, counts, counted: bool,
                     aux: torch.Tensor | None = None) -> None:
        with torch.no_grad():
            chosen = self.beta * (terms.chosen - terms.ref_chosen)
            rejected = self.beta * (terms.rejected - terms.ref_rejected)
            stat = {name: value.view(-1, 2) for name, value in result.stat_sums.items()}
            sums = {"pairs": chosen.new_tensor(float(chosen.numel())), "rewards_chosen": chosen, "rewards_rejected": rejected,
                    "accuracies": (chosen > rejected).float(), "margins": chosen - rejected,
                    "logps_chosen": terms.chosen, "logps_rejected": terms.rejected, "entropy": stat["entropy"],
                    "targets": counts, "logits_chosen": stat["mean_logits"][:, 0], "targets_chosen": counts[:, 0],
                    "logits_rejected": stat["mean_logits"][:, 1], "targets_rejected": counts[:, 1],
                    "top1_chosen": stat["is_top1"][:, 0], "aux_loss": chosen.new_zeros(()) if aux is None else aux,
                    "aux_batches": chosen.new_tensor(float(aux is not None))}
        self.pair_metrics.add(mode, sums, counted=counted)

    def _finish_metrics(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        """TRL's per-micro-batch values (means over the round's pairs or completion tokens, the mean of its
        processes' router auxiliary losses), averaged over the rounds."""
        counted = rows["pairs"] > 0

        def mean(name: str, over: str = "pairs") -> float:
            return row_mean(rows[name], rows[over], counted)

        return {
            "entropy": mean("entropy", "targets"),
            "logits/chosen": mean("logits_chosen", "targets_chosen"),
            "logits/rejected": mean("logits_rejected", "targets_rejected"),
            "mean_token_accuracy": mean("top1_chosen", "targets_chosen"),
            "rewards/chosen": mean("rewards_chosen"),
            "rewards/rejected": mean("rewards_rejected"),
            "rewards/accuracies": mean("accuracies"),
            "rewards/margins": mean("margins"),
            "logps/chosen": mean("logps_chosen"),
            "logps/rejected": mean("logps_rejected"),
            **({"aux_loss": mean("aux_loss", "aux_batches")} if self.aux_loss_enabled else {}),
        }

    def _prepare_eval_pairs(self, dataset, name: str):
        """As TRL's `evaluate` prepares a dataset it is given: tokenized, and with the reference's
        log-probs when they are precomputed (refused after training began without a reference)."""
        if self.precompute_ref_logps and self.ref_model is None and not is_peft(self.model) and self.state.global_step > 0:
            raise ValueError(
                "precompute_ref_log_probs=True without a ref_model: the reference is the policy before training, so "
                "a dataset passed to evaluate() after training began has no reference; pass it as eval_dataset at "
                "construction or give a ref_model"
            )
        dataset = super()._prepare_eval_pairs(dataset, name)
        return self._with_reference_columns(dataset) if self.precompute_ref_logps else dataset

