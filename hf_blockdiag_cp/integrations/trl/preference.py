"""What the preference trainers (DPO, reward models) share under block-diagonal CP.

`PreferenceCPMixin` sits on `BlockdiagCPTrainerMixin` (one CP step per pack, the same pack on the CP
peers of a DP replica) and replaces what is token-level there by pairs:
- data: TRL's prepared pairs packed whole (`data.pairs`): both sequences of a pair in one pack. With
  `batching="pairs"` (the default) a micro-batch is `per_device_train_batch_size` pairs of each CP group in
  the stock Trainer's order (TRL's micro-batch; `data.pair_batches`), in as few packs as `max_tokens`
  allows, every DP replica running as many packs per round (filler packs weigh 0); with `batching="tokens"`
  a micro-batch is one pack of as many pairs as fit (`per_device_train_batch_size=1`);
- the loss: `_pair_losses` (the trainer's) gives one loss per pair of the pack, the same on every
  rank of the CP group (it is built from per-document sums over the group); each rank's loss is
  `Σ pack losses · dp_size / P`, P the pairs of the optimizer step over every DP replica, so the
  mean over the ranks is TRL's mean over pairs, and so is the mean gradient (invariant I2);
- TRL's metrics: sums per micro-batch (all its packs) on each rank, combined over the DP replicas per
  micro-batch round and averaged over the rounds when the trainer logs, as TRL gathers each micro-batch's
  values over its processes and averages them (`PairMetrics`; one collective per log); with
  `batching="tokens"`, and in `evaluate`, one row holds every pair since the last log: TRL's metrics of
  one micro-batch holding them all;
- `evaluate`: the same losses and metrics over the eval pairs, forward only, sharded.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ...comm.consensus import collective_device
from ...data.pair_batches import pair_micro_batch_dataloader
from ...data.pairs import PAIRS_KEY, PairBatch, PairPackCollator, check_pairs_fit, pair_dataloader, pair_lengths
from ...step import STEP_KWARG
from ..trainer import BlockdiagCPTrainerMixin
from ..trainer.setup import check_one_pack_per_micro_batch, sum_over_world, world_group

MODES = ("train", "eval")
BATCHING = ("pairs", "tokens")


def check_batching(batching) -> str:
    """`batching` as given, or ValueError naming it and its two values."""
    if not isinstance(batching, str) or batching not in BATCHING:
        raise ValueError(
            f"batching is {batching!r}; expected 'pairs' (per_device_train_batch_size pairs per micro-batch of each CP "
            "group, TRL's batch size) or 'tokens' (per_device_train_batch_size=1: one pack of as many pairs as fit "
            "max_tokens per micro-batch)"
        )
    return batching


class PairMetrics:
    """This rank's rows of metric sums since the last log, per mode: one row per micro-batch (all its packs;
    a CP group adds to it on its CP rank 0 only, every rank of the group holding the same sums; a filler pack
    adds nothing), kept on the device. When the trainer logs, ONE all-gather combines row i of every rank,
    the same micro-batch round of every DP replica (each replica runs as many micro-batches): `sums` columns
    added, `extremes` columns (e.g. -min and max reward) maximised, as TRL gathers each micro-batch's values
    over its processes; the trainer's `_finish_metrics` then averages per-row values over the rows, as TRL's
    `log` averages its micro-batches."""

    def __init__(self, sums: tuple[str, ...], extremes: tuple[str, ...] = ()):
        self.sums, self.extremes = sums, extremes
        self.rows: dict[str, list[torch.Tensor]] = {mode: [] for mode in MODES}
        self.open: dict[str, torch.Tensor | None] = {mode: None for mode in MODES}

    def add(self, mode: str, sums: dict[str, torch.Tensor], extremes: dict[str, torch.Tensor] | None = None,
            counted: bool = True) -> None:
        """One pack, into the open row of its micro-batch (`close` ends it); `counted=False` (another CP rank,
        a filler pack, a pack that only fills an eval round) opens the row without adding to it."""
        device = next((v.device for v in sums.values()), torch.device("cpu"))
        width = len(self.sums) + len(self.extremes)
        row = self.open[mode]
        if row is None:
            row = torch.cat([torch.zeros(len(self.sums), dtype=torch.float64, device=device),
                             torch.full((len(self.extremes),), -torch.inf, dtype=torch.float64, device=device)])
        if counted:
            added = [sums[name].detach().to(device, torch.float64).sum() for name in self.sums]
            high = [extremes[name].detach().to(device, torch.float64).max() for name in self.extremes]
            pack = torch.stack(added + high) if width else row
            row = torch.cat([row[: len(self.sums)] + pack[: len(self.sums)],
                             torch.maximum(row[len(self.sums):], pack[len(self.sums):])])
        self.open[mode] = row

    def close(self, mode: str) -> None:
        """End the open row of `mode` (its micro-batch is done); nothing without one."""
        row, self.open[mode] = self.open[mode], None
        if row is not None:
            self.rows[mode].append(row)

    def pop(self, mode: str, world_size: int) -> dict[str, torch.Tensor] | None:
        """Per column, [R] over the micro-batch rounds since the last log: the sums over every rank, the
        extremes' maxima over every rank; None without rows. A collective when there are rows (every rank
        has as many): call it on every rank at the same log."""
        self.close(mode)
        rows, self.rows[mode] = self.rows[mode], []
        if not rows:
            return None
        local = torch.stack(rows)
        group = world_group(world_size)
        if group is None:
            gathered = local.cpu().unsqueeze(0)
        else:
            local = local.to(collective_device(group))
            parts = [torch.empty_like(local) for _ in range(world_size)]
            dist.all_gather(parts, local, group=group)  # the one collective of the log
            gathered = torch.stack(parts).cpu()
        count = len(self.sums)
        columns = torch.cat([gathered[..., :count].sum(dim=0), gathered[..., count:].amax(dim=0)], dim=1)
        return dict(zip(self.sums + self.extremes, columns.unbind(dim=1)))


def row_mean(numerator: torch.Tensor, denominator: torch.Tensor, rows: torch.Tensor) -> float:
    """TRL's average over its micro-batches of a per-micro-batch ratio: numerator / denominator per row (0 for an
    empty denominator, as TRL logs an empty mean), averaged over the rows where `rows` is true (0.0 for none)."""
    values = torch.where(denominator != 0, numerator / denominator.where(denominator != 0, 1.0), 0.0)[rows]
    return float(values.mean()) if values.numel() else 0.0


class PreferenceCPMixin(BlockdiagCPTrainerMixin):
    """Pair packing, per-pair loss normalisation, metrics and sharded evaluation for TRL's preference
    trainers; a trainer defines `_pair_reader()`, `_pair_collator_options()`, `_pair_losses(model,
    local, pairs, mode, counted)` and `_finish_metrics(sums, extremes)`."""

    pair_metrics: PairMetrics
    batching: str = "pairs"

    def _pair_reader(self):
        raise NotImplementedError

    def _dropped_by(self) -> str:
        """Which pairs TRL's preparation drops, and by which setting (for an emptied train dataset)."""
        raise NotImplementedError

    def _count_prepared(self, dataset_name: str, raw, prepared):
        """`prepared`, after noting how many of `raw`'s pairs TRL's preparation kept (`_empty_dataset_cause`)."""
        with contextlib.suppress(TypeError):
            self.__dict__.setdefault("_prepared_sizes", {})[dataset_name] = (len(raw), len(prepared))
        return prepared

    def _empty_dataset_cause(self) -> str | None:
        raw, kept = self.__dict__.get("_prepared_sizes", {}).get("train", (0, 0))
        if raw == 0 or kept:
            return None
        return f"TRL's preparation dropped all {raw} pairs: {self._dropped_by()}; raise max_length"

    def _pair_collator_options(self) -> dict:
        return {}

    def _pair_limits(self) -> str:
        """Which settings bound a pair's length, for the error of a pair longer than the pack."""
        return "no truncation"

    def _pair_lengths(self, dataset, name: str = "train") -> list[int]:
        """The tokens of each pair of `dataset` (cached per dataset object); raises ValueError naming the
        dataset for an empty one, and naming the pair for a malformed pair or one longer than the pack."""
        cache = self.__dict__.setdefault("_pair_length_cache", {})
        if id(dataset) in cache and cache[id(dataset)][0] is dataset:
            return cache[id(dataset)][1]
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"the {name} dataset holds no preference pair (after TRL's preparation and filtering)")
        try:
            lengths = pair_lengths(dataset, self._pair_reader())
            check_pairs_fit(lengths, self.packing.max_tokens, self._pair_limits())
        except ValueError as exc:
            raise ValueError(f"{name} dataset: {exc}") from None
        cache[id(dataset)] = (dataset, lengths)
        return lengths

    def _check_pairs(self) -> None:
        """Every train and eval pair readable and within the pack, before any step (the same on every rank)."""
        self._pair_lengths(self.train_dataset, "train")
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"eval": self.eval_dataset}
        for name, dataset in evals.items():
            if dataset is not None:
                self._pair_lengths(dataset, name)

    def _pack_collator(self) -> PairPackCollator:
        c = self.cp_coordinates
        return PairPackCollator(self._pair_reader(), self.packing.max_tokens, self.packing.pad_token_id, c.cp_size,
                                c.cp_rank, self.cp_config, **self._pair_collator_options())

    def _packed_loader(self, dataset, shuffle: bool, drop_last: bool):
        """Whole pairs per pack for this rank (the mixin's hook behind evaluation data, and training data with
        `batching="tokens"`)."""
        lengths = self._pair_lengths(dataset)
        c = self.cp_coordinates
        options = self._loader_options(shuffle, drop_last)
        return pair_dataloader(dataset, self._pack_collator(), lengths, self.packing.max_tokens, dp_size=c.dp_size,
                               dp_rank=c.dp_rank, seed=options["seed"], shuffle=shuffle, drop_last=drop_last,
                               num_workers=options["num_workers"])

    def _train_loader(self):
        """With `batching="pairs"`: micro-batches of `per_device_train_batch_size` pairs per DP replica in the stock
        Trainer's order (`data.pair_batches`: seed `data_seed`, else `seed`; `dataloader_drop_last`), each in as
        few packs as `max_tokens` allows; with `"tokens"`: one pack each."""
        if self.batching == "tokens":
            return super()._train_loader()
        args, c = self.args, self.cp_coordinates
        options = self._loader_options(self.packing.shuffle, args.dataloader_drop_last)
        sequential = getattr(args, "train_sampling_strategy", "random") == "sequential"
        loader = pair_micro_batch_dataloader(
            self.train_dataset, self._pack_collator(), self._pair_lengths(self.train_dataset),
            args.per_device_train_batch_size, self.packing.max_tokens, dp_size=c.dp_size, dp_rank=c.dp_rank,
            seed=options["seed"], shuffle=self.packing.shuffle and not sequential, drop_last=args.dataloader_drop_last,
            num_workers=options["num_workers"], limits=self._pair_limits())
        if len(loader) == 0:  # the same on every rank: all raise
            raise ValueError(
                f"train_dataset's {len(self.train_dataset)} pairs fill no round of {type(args).__name__}."
                f"per_device_train_batch_size={args.per_device_train_batch_size} pairs on each of {c.dp_size} DP "
                "replicas, and dataloader_drop_last=True drops the rest; add pairs, lower per_device_train_batch_size, "
                "or set dataloader_drop_last=False"
            )
        return loader

    def _default_pack_pairs(self, args) -> int:
        """The pairs the default pack holds at their longest: a micro-batch's (`batching="pairs"`), else one."""
        size = args.per_device_train_batch_size
        return size if self.batching == "pairs" and isinstance(size, int) and size > 0 else 1

    def _check_micro_batch_size(self) -> None:
        """`batching="tokens"`: per_device_train_batch_size=1. `"pairs"`: the stock Trainer's batching settings that
        TRL's order follows (`data.pair_batches`); others would give TRL's step other pairs."""
        args = self.args
        name = type(args).__name__
        if self.batching == "tokens":
            check_one_pack_per_micro_batch(args, f"; or pass batching='pairs' for {name}.per_device_train_batch_size "
                                                 "pairs per micro-batch, as TRL batches them")
            return
        strategy = getattr(args, "train_sampling_strategy", "random")
        if strategy not in ("random", "sequential") or getattr(args, "group_by_length", False):
            raise ValueError(
                f"{name}.train_sampling_strategy is {strategy!r}; expected 'random' or 'sequential' with batching='pairs': "
                "the micro-batches follow the stock Trainer's random (or sequential) order; pass batching='tokens' to "
                "group pairs by length into packs"
            )
        config = getattr(args, "accelerator_config", None)
        if getattr(config, "split_batches", False) or not getattr(config, "even_batches", True):
            raise ValueError(
                f"{name}.accelerator_config has split_batches={config.split_batches}, even_batches={config.even_batches}; "
                "expected split_batches=False and even_batches=True (the defaults) with batching='pairs': "
                "per_device_train_batch_size pairs per micro-batch of each DP replica, every replica stepping alike"
            )

    def _is_filler(self, pack: dict) -> bool:
        return bool(pack[PAIRS_KEY].filler)

    def _micro_batch_items(self, batch: dict) -> int:
        """Pairs, counted by CP rank 0 of each group (its peers hold the same pack); none in a filler pack."""
        pairs: PairBatch = batch[PAIRS_KEY]
        return pairs.pairs if self.cp_coordinates.cp_rank == 0 and not pairs.filler else 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The mixin's step over the micro-batch's packs. With `batching="pairs"` the micro-batch is TRL's and its
        metrics row ends with it (`PairMetrics.close`); with `"tokens"` a pack holds however many pairs fit, so
        the row stays open until the log: TRL's metrics of one micro-batch of every pair since the last log."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.batching == "pairs":
            self.pair_metrics.close("train")
        return loss

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """This rank's share of the step's mean loss over pairs: Σ pack losses · dp_size / P (class docstring);
        without `num_items_in_batch` (a direct call) the pack's mean. A filler pack's loss is exactly 0, through
        the model (DDP and FSDP2 see every parameter), and adds nothing to the metrics."""
        if STEP_KWARG not in inputs or PAIRS_KEY not in inputs:
            raise ValueError(
                f"{type(self).__name__}.compute_loss takes a CP step's local batch of packed pairs (training_step "
                "builds it); the stock padded batches of TRL are not used"
            )
        local = dict(inputs)
        pairs: PairBatch = local.pop(PAIRS_KEY)
        mode = "train" if self.model.training else "eval"
        losses = self._pair_losses(model, local, pairs, mode, counted=not pairs.filler)
        if pairs.filler:
            losses = losses * 0.0
        if num_items_in_batch is None:
            loss = losses.sum() / max(pairs.pairs, 1)
        else:
            loss = losses.sum() * self.cp_coordinates.dp_size / num_items_in_batch
        return (loss, {"pair_losses": losses.detach()}) if return_outputs else loss

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Sharded evaluation: `{prefix}_loss` is the mean loss over every eval pair (TRL's, for a batch
        holding them all), and TRL's metrics as `{prefix}_*` of that one batch (one `PairMetrics` row), each
        pair counted once."""
        dataset = self._eval_pairs(eval_dataset, metric_key_prefix)
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if self.compute_metrics is not None:
            raise ValueError(f"compute_metrics is not supported by {type(self).__name__}'s sharded evaluation")
        started = time.time()
        loader = self.get_eval_dataloader(dataset)
        totals = torch.zeros(2, dtype=torch.float64)  # loss sum, pairs
        first = self.cp_coordinates.cp_rank == 0
        for model, train_ctx, local, _, index in self._eval_steps(loader):
            pairs = local.pop(PAIRS_KEY)
            counted = index is not None
            with train_ctx():
                losses = self._pair_losses(model, local, pairs, "eval", counted=counted)
            if counted and first:
                totals += torch.tensor([float(losses.sum()), pairs.pairs], dtype=torch.float64)
        loss_sum, count = sum_over_world(totals, self.cp_coordinates.world_size).tolist()
        runtime = time.time() - started
        metrics = {f"{metric_key_prefix}_loss": loss_sum / count if count else float("nan"),
                   f"{metric_key_prefix}_runtime": round(runtime, 4),
                   f"{metric_key_prefix}_samples_per_second": round(count / runtime, 3) if runtime > 0 else float("nan")}
        with self._in_mode("eval"):
            self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        raise NotImplementedError(
            f"{type(self).__name__}.predict is not supported (a preference trainer predicts no tokens); "
            "evaluate() gives the loss and TRL's metrics over the pairs"
        )

    def _eval_pairs(self, dataset, prefix: str):
        """The eval dataset(s) as the trainer prepares them (a dataset given to `evaluate` is prepared as
        TRL prepares eval data; the ones prepared at construction pass as they are)."""
        if dataset is None:
            return self.eval_dataset
        if isinstance(dataset, str):
            return self.eval_dataset[dataset]
        own = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
        if any(dataset is d for d in own):
            return dataset
        if isinstance(dataset, dict):
            return {name: self._prepare_eval_pairs(part, name) for name, part in dataset.items()}
        return self._prepare_eval_pairs(dataset, prefix)

    def _prepare_eval_pairs(self, dataset, name: str):
        return self._prepare_dataset(dataset, self.processing_class, self.args, name)

    @contextlib.contextmanager
    def _in_mode(self, mode: str):
        """The model in `mode` (TRL files its logs by the model's mode)."""
        was_training = self.model.training
        self.model.train(mode == "train")
        try:
            yield
        finally:
            self.model.train(was_training)

    # ---------------------------------------------------------------- logging

    def _finish_metrics(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        """TRL's metrics from `PairMetrics.pop`'s per-round columns."""
        raise NotImplementedError

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """TRL's metrics of the mode since the last log (one all-reduce on every rank), as TRL names them."""
        mode = "train" if self.model.training else "eval"
        popped = self.pair_metrics.pop(mode, self.cp_coordinates.world_size)
        if popped is not None:
            metrics = self._finish_metrics(popped)
            metrics["num_tokens"] = float(self.cp_tokens_trained)
            logs.update({f"eval_{k}" if mode == "eval" else k: v for k, v in metrics.items()})
        super().log(logs, *args, **kwargs)

