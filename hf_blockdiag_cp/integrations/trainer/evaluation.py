"""Sharded evaluation and prediction for the BlockdiagCP Trainer.

The eval documents are packed by the same packing code as training (nothing dropped: the last
partial pack is padded; packs that only fill the DP replicas' last round weigh 0), and every pack
runs through the shard step under CP, forward only, each rank holding 1/G of it, under the stock
Trainer's mixed-precision autocast (`bf16=True` evaluates as the stock Trainer does). `eval_loss` is
the token-weighted mean over every predicted eval token (the training loss's definition), i.e.
the stock model's loss on each document unpacked, as long as no eval document is longer than a
pack: those are split into pieces (oversize="split"), counted in `{prefix}_split_documents`, and
the loss is then the pieces' loss, which a warning says. An MoE model's router auxiliary loss is a
training regulariser of each pack's routing, not a token loss: `eval_loss` leaves it out.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device

from ...comm import resolve_cp_group
from ...comm.exchange import all_gather_single
from ...model_patches.router_aux_loss import router_aux_scope
from ...step import IGNORE_INDEX, make_cp_blockdiag_batch_and_ctx
from .setup import sum_over_world, world_group


def _in_pack_order(rows: torch.Tensor, layout, cp) -> torch.Tensor:
    """This rank's rows `[L, ...]` of a pack, gathered over the CP group into pack order `[S, ...]` (CPU)."""
    if cp.group is not None:
        gathered = rows.new_empty((cp.size * rows.shape[0],) + tuple(rows.shape[1:]))
        all_gather_single(gathered, rows.contiguous(), cp.group)
        rows = gathered  # slot order: rank-major, as layout.slot_positions
    full = rows.new_empty((layout.padded_seq_len,) + tuple(rows.shape[1:]))
    full[layout.slot_positions.reshape(-1).to(rows.device)] = rows
    return full[: layout.original_seq_len].cpu()


def _loss_metrics(totals: torch.Tensor, world_size: int, runtime: float, prefix: str, loader) -> dict[str, float | int]:
    """Token-weighted loss over every rank's targets (one SUM all-reduce of the per-rank totals),
    and how many documents of the dataset were split (the same on every rank: all plan alike)."""
    loss_sum, targets, tokens = sum_over_world(totals, world_size).tolist()
    split = loader.batch_sampler.oversized.documents
    if split:
        _warn_split_loss(prefix, split, len(loader.batch_sampler.lengths), loader.batch_sampler.max_tokens)
    return {
        f"{prefix}_loss": loss_sum / targets if targets else math.nan,
        f"{prefix}_tokens": int(tokens),
        f"{prefix}_split_documents": split,
        f"{prefix}_runtime": round(runtime, 4),
        f"{prefix}_tokens_per_second": round(tokens / runtime, 3) if runtime > 0 else math.nan,
    }


@functools.cache
def _warn_split_loss(prefix: str, documents: int, total: int, max_tokens: int) -> None:
    """Warn (once per process for the same numbers) that the loss is not the per-document loss."""
    warnings.warn(
        f"{documents} of {total} {prefix} documents are longer than max_tokens={max_tokens} and were split into "
        f"pieces: {prefix}_loss is the loss of the pieces (no piece attends to the one before it), not the "
        "per-document loss. Raise max_tokens for a per-document loss",
        UserWarning,
        stacklevel=2,
    )


class ShardedEvaluationMixin:
    """`get_eval_dataloader`, `evaluate` and `predict` of `BlockdiagCPTrainerMixin` (which mixes this in).

    Relies on the Trainer mixin's `_packed_loader`, `_local_batch`, `cp_coordinates`, `cp_mesh`,
    `packing` and `cp_config`.
    """

    def get_eval_dataloader(self, eval_dataset=None):
        """Eval packs for this rank, already sharded: the eval documents in order, nothing dropped."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._packed_loader(dataset, shuffle=False, drop_last=False)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sharded evaluation: `{prefix}_loss` is the token-weighted mean loss over every eval target."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if not self.args.prediction_loss_only and self.compute_metrics is not None:
            raise ValueError(
                "compute_metrics is not supported by the BlockdiagCP Trainer's sharded evaluation (each rank holds "
                "1/cp_size of every pack); evaluate gives the token-weighted eval loss"
            )
        started = time.time()
        loader = self.get_eval_dataloader(dataset)
        totals = torch.zeros(3, dtype=torch.float64)  # token-loss sum, targets, real tokens
        for pack in self._sharded_forward(loader, with_logits=False, on_pack=self._eval_pack_done):
            totals += torch.tensor(pack["totals"], dtype=torch.float64)
        runtime = time.time() - started
        metrics = _loss_metrics(totals, self.cp_coordinates.world_size, runtime, metric_key_prefix, loader)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """Sharded prediction: per-token logits of every pack, gathered over the CP group in pack order.

        Returns `PredictionOutput(predictions [P, S, V], label_ids [P, S], metrics)` on every rank, P
        the packs of the whole dataset in epoch order (S = max_tokens): `label_ids[p, i]` is the token
        that logit row i predicts (-100: no target, e.g. a document's last token or padding).
        """
        import numpy as np
        from transformers.trainer_utils import PredictionOutput

        c = self.cp_coordinates
        started = time.time()
        loader = self.get_eval_dataloader(test_dataset)
        totals = torch.zeros(3, dtype=torch.float64)
        mine = []
        for pack in self._sharded_forward(loader, with_logits=True):
            totals += torch.tensor(pack["totals"], dtype=torch.float64)
            if pack["index"] is not None:
                mine.append((pack["index"], pack["logits"], pack["labels"]))
        metrics = _loss_metrics(totals, c.world_size, time.time() - started, metric_key_prefix, loader)
        group = world_group(c.world_size)
        if group is not None:  # every replica's packs to every rank (CP peers hold the same: rank 0 sends)
            everyone: list = [None] * c.world_size
            dist.all_gather_object(everyone, mine if c.cp_rank == 0 else [], group=group)
            mine = [item for part in everyone for item in part]
        mine.sort(key=lambda item: item[0])
        predictions = np.stack([logits.numpy() for _, logits, _ in mine])
        label_ids = np.stack([labels.numpy() for _, _, labels in mine])
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    def _eval_forward_context(self) -> contextlib.ExitStack:
        """The stock Trainer's forward context for evaluation: `compute_loss_context_manager()`, which
        `prediction_step` enters, and accelerate's mixed-precision autocast, which the stock evaluation
        gets from `accelerator.prepare_model` wrapping the model's forward (`bf16=True` / `fp16=True`;
        transformers 5.x's own `autocast_smart_context_manager` is a no-op). Without mixed precision
        both are no-ops. Nesting the same autocast once the model's forward is wrapped changes nothing."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.compute_loss_context_manager())
        stack.enter_context(self.accelerator.autocast())
        return stack

    def _eval_model(self):
        """The model evaluation runs (not the DDP wrapper: forward only; an FSDP2 module is its own
        wrapper), cast to fp16 / bf16 for an evaluation outside training with `fp16_full_eval` /
        `bf16_full_eval`, in place, as the stock Trainer's evaluation loop does."""
        model, args = self.model, self.args
        if not self.is_in_train and (args.fp16_full_eval or args.bf16_full_eval):
            model = model.to(dtype=torch.float16 if args.fp16_full_eval else torch.bfloat16, device=args.device)
        return model

    def _eval_pack_done(self, outputs, local: dict, fill: bool) -> None:
        """Hook, on every rank after each pack's forward in `evaluate` (not `predict`): the model's
        `outputs` and the shard step's `local` batch; `fill` for a pack that only fills the DP
        replicas' last round (it must weigh 0). Nothing here; the TRL trainer records its token metrics."""

    def _eval_steps(self, loader, model=None):
        """Every pack of `loader` (`get_eval_dataloader`) as a forward-only CP step: yields per pack
        `(model, train_ctx, local, layout, index)` inside the model's eval mode, `no_grad` and the stock
        evaluation's forward context; `index` is the pack's place in the epoch, None for a pack that only
        fills the DP replicas' last round (it must weigh 0). `model`: the one to run (default: the
        trained model, as evaluation runs it)."""
        sampler = loader.batch_sampler
        repeats = sampler.replica_repeats()
        model = self._eval_model() if model is None else model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), self._eval_forward_context():
                for j, (batch, repeat) in enumerate(zip(loader, repeats)):
                    inputs = send_to_device(self._local_batch(batch), self.args.device)
                    train_ctx, local, layout = make_cp_blockdiag_batch_and_ctx(
                        self.cp_mesh, None, inputs, padding_token_id=self.packing.pad_token_id, config=self.cp_config,
                        model=model,
                    )
                    yield model, train_ctx, local, layout, None if repeat else j * sampler.dp_size + sampler.dp_rank
        finally:
            model.train(was_training)

    def _sharded_forward(self, loader, with_logits: bool, on_pack=None):
        """Forward only, every pack of `loader` through the shard step under CP (`_eval_steps`). Yields
        per pack this rank's `totals` (token-loss sum, targets, real tokens; zeros for fill packs), and
        with `with_logits` the pack's logits and shifted labels in pack order (gathered over the CP
        group) and its index in the epoch (None for a fill pack). `on_pack(outputs, local, fill)` is
        called after each forward."""
        cp = resolve_cp_group(self.cp_mesh)
        for model, train_ctx, local, layout, index in self._eval_steps(loader):
            local["num_items_in_batch"] = 1  # the model returns this rank's token-loss sum
            with train_ctx(), router_aux_scope(scale=0.0):  # without an MoE model's router auxiliary loss
                out = model(**local)
            if on_pack is not None:
                on_pack(out, local, index is None)
            targets = int(local["shift_labels"].ne(IGNORE_INDEX).sum())
            pack = {"totals": [0.0, 0, 0] if index is None else
                    [float(out.loss) if targets else 0.0, targets, int(local["document_ids"].gt(0).sum())]}
            if with_logits:
                pack["index"] = index
                pack["logits"] = _in_pack_order(out.logits[0].float(), layout, cp)
                pack["labels"] = _in_pack_order(local["shift_labels"][0], layout, cp)
            yield pack
