"""`BlockdiagCPTrainerMixin`: packed data per DP replica, one CP shard step per micro-batch.

Why a Trainer subclass and not only a callback: callbacks run after the dataloader is built,
so they cannot replace the collator or the sampler, and they cannot wrap forward *and*
backward in the step context. The mixin therefore owns these Trainer hooks:

- `get_train_dataloader`: `packed_dataloader` with this rank's (dp, cp) coordinates, so CP
  peers get the same pack and DP replicas different ones (never `accelerator.prepare`d).
- `get_batch_samples`: counts the targets of the whole optimizer step over every rank (one
  SUM all-reduce per optimizer step, which also carries the token metrics).
- `training_step`: shard step (`make_cp_blockdiag_batch_and_ctx`), then the stock step, i.e.
  forward and `accelerator.backward`, inside `train_ctx()`; what the step ran goes to the callback.
  A micro-batch of several packs (`data.loader.PACKS_KEY`, the preference trainers' `batching="pairs"`)
  runs one such step per pack, gradients synchronised once, after its last pack.
- `compute_loss`: `num_items_in_batch = N / W` (N = targets of the whole optimizer step over all
  ranks, W = world size), so each rank's loss is `local token-loss sum * W / N` (I2), from the
  chunked log-prob head where the model's own loss is the stock cross-entropy (`head_loss`: no
  `[tokens, vocab]` logits), else passed to the model for its own loss: DDP's gradient mean over the W ranks and the Trainer's
  logged mean over processes are exactly the non-CP values. Nothing here depends on the
  Trainer's own `num_items_in_batch` counting, `average_tokens_across_devices` or its
  multiplication by the number of processes, which differ between Transformers versions. An MoE
  model's router auxiliary loss is the whole pack's on every rank (`model_patches.router_aux_loss`);
  the auxiliary losses of the step's packs add up, as in the stock Trainer.
- `evaluate` / `predict`: sharded, from `ShardedEvaluationMixin` (evaluation.py).
- `loss_is_scaled_for_ga`: True where the Trainer reads it (transformers >= 5.19); earlier
  Trainers decide from the `num_items_in_batch` the mixin passes.
With `torch_compile`, a callback compiles the bodies of checkpointed layers inside their
checkpoint when training begins (`integrations.compile`); accelerate compiles the model as usual.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from accelerate.utils import send_to_device
from transformers import Trainer, TrainerCallback

from ...comm.consensus import agree
from ...comm.parallel_dims import ParallelDims
from ...compat.transformers import trainer_reads_loss_scaling_flag
from ...config import CPConfig, default_config
from ...data.loader import PACKS_KEY, micro_batch_packs, packed_dataloader
from ...model_patches import apply_model_patches
from ...model_patches.router_aux_loss import router_aux_scope
from ...step import IGNORE_INDEX, SHARD_KEY, STEP_KWARG, make_cp_blockdiag_batch_and_ctx, shard_batch
from ...step.targets import no_targets_error
from ..compile import compile_checkpointed_layers
from .callback import BlockdiagCPCallback
from .evaluation import ShardedEvaluationMixin
from .head_loss import PathNote, head_loss_refusal, head_token_loss
from .setup import (
    PackingOptions,
    check_no_foreign_parallelism,
    check_one_pack_per_micro_batch,
    check_trainer_setup,
    check_world,
    resolve_cp_mesh,
    sum_over_world,
    world_group,
)


class BlockdiagCPTrainerMixin(ShardedEvaluationMixin):
    """Mix into a `transformers.Trainer` subclass (before it) for block-diagonal CP on packed data.

    Extra keyword arguments (all else goes to the Trainer):
      cp_size: ranks per CP group (1 = no CP, packing only). The world must be a multiple.
      max_tokens: tokens per pack (required; a multiple of 2*cp_size).
      cp_mesh: optional 1-D DeviceMesh or ProcessGroup of this rank's CP group; it must hold ranks
        [dp*cp_size, (dp+1)*cp_size). Default: `ParallelDims(cp=cp_size).build_mesh(...).cp`.
      cp_config: the `CPConfig` of every CP step (kernel, exchange, layout; default: the process
        default, `configure_cp`). Its layout shards training and evaluation packs.
      pad_token_id, packing_buffer_size, oversize ("split"|"raise"), shuffle, length_key:
        packing options (`PackingOptions`) of `hf_blockdiag_cp.data.packed_dataloader`.
    Do not pass `data_collator`: training batches come from the packed dataloader.
    """

    @property
    def loss_is_scaled_for_ga(self) -> bool | None:
        """True: the loss from `compute_loss` is already normalised over the whole optimizer step (I2).
        None where the Trainer never reads it (transformers < 5.19), so that TRL's trainers there do
        not turn it into a placeholder `compute_loss_func` (which the setup checks would refuse)."""
        return True if trainer_reads_loss_scaling_flag() else None

    def __init__(
        self,
        *args,
        cp_size: int = 1,
        max_tokens: int | None = None,
        cp_mesh=None,
        cp_config: CPConfig | None = None,
        pad_token_id: int = 0,
        packing_buffer_size: int = 1024,
        oversize: str = "split",
        shuffle: bool = True,
        length_key: str = "input_ids",
        **kwargs,
    ):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        check_no_foreign_parallelism("TrainingArguments", getattr(training_args, "parallelism_config", None))
        collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        if collator is not None:
            raise ValueError(
                "data_collator must not be given to a BlockdiagCP Trainer: training batches come from its own packing "
                "collator and sampler (set max_tokens, pad_token_id, oversize instead)"
            )
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise TypeError(f"cp_config must be a CPConfig or None; got {type(cp_config).__name__}")
        self._cp_config = cp_config
        self.cp_callback = BlockdiagCPCallback(cp_size)
        if training_args is not None:  # the processes and the CP size first, the pack size after
            check_world(training_args, cp_size)
        self.packing = PackingOptions(max_tokens, pad_token_id, packing_buffer_size, oversize, shuffle, length_key)
        self.packing.validate(cp_size)
        _default_find_unused_parameters(training_args, kwargs.get("model", args[0] if args else None))
        super().__init__(*args, **kwargs)
        apply_model_patches(self.model)  # per-family patches (Phi-3 global RoPE, ...); idempotent
        self.add_callback(self.cp_callback)
        if self.args.torch_compile:
            self.add_callback(_CompileCheckpointedBodies(self.accelerator.state.dynamo_plugin.to_kwargs()))
        check_trainer_setup(self, cp_size)
        self._check_micro_batch_size()
        check_train_dataset(self.train_dataset, self._empty_dataset_cause())  # empty: the Trainer would end at once
        self._loss_path_note = PathNote()
        self.cp_tokens_trained = 0  # real tokens of every pack trained on so far (each once, not per CP rank)
        self.cp_coordinates = ParallelDims(cp=cp_size, world_size=self.args.world_size, rank=self.args.process_index)
        self.cp_mesh = resolve_cp_mesh(cp_mesh, self.cp_coordinates, self.args.device.type)

    def _check_micro_batch_size(self) -> None:
        """Raise for a `per_device_train_batch_size` this trainer's micro-batches cannot take (here: other than 1)."""
        check_one_pack_per_micro_batch(self.args)

    def _empty_dataset_cause(self) -> str | None:
        """Why the train dataset came out empty, where a setting of the trainer's explains it (None here)."""
        return None

    # ---------------------------------------------------------------- data

    def get_train_dataloader(self):
        """One pack per micro-batch, already sharded for this CP rank; the same number of packs on every rank."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        c = self.cp_coordinates
        loader = self._train_loader()
        agreement = agree(world_group(c.world_size), False, {"packs per epoch": len(loader)})
        if agreement.disagreeing():
            low, high = agreement.value("packs per epoch")
            raise RuntimeError(
                f"ranks disagree on the number of packs per epoch (this rank: {len(loader)}; range "
                f"{low}..{high}): every rank must see the same train_dataset and "
                "packing options, or the Trainer's steps would hang"
            )
        if len(loader) == 0:  # the same on every rank (just agreed): all raise, none trains nothing silently
            raise ValueError(
                f"train_dataset gives no pack to train on: its {len(self.train_dataset)} examples fill fewer packs of "
                f"max_tokens={self.packing.max_tokens} than the {c.dp_size} DP replicas (dataloader_drop_last="
                f"{self.args.dataloader_drop_last}); add examples, lower max_tokens, or set dataloader_drop_last=False"
            )
        return loader

    def _train_loader(self):
        """The training micro-batches of this rank (one pack each here; the preference trainers' may hold several)."""
        return self._packed_loader(self.train_dataset, shuffle=self.packing.shuffle, drop_last=self.args.dataloader_drop_last)

    def _packed_loader(self, dataset, shuffle: bool, drop_last: bool):
        """Packs of `dataset` for this rank, already sharded: the hook behind training and evaluation
        data (the TRL trainer overrides it to take TRL's packs as they are)."""
        p = self.packing
        return packed_dataloader(dataset, p.max_tokens, buffer_size=p.buffer_size, oversize=p.oversize,
                                 length_key=p.length_key, **self._loader_options(shuffle, drop_last))

    def _loader_options(self, shuffle: bool, drop_last: bool) -> dict[str, Any]:
        """What every packed loader of this rank shares: its dp x cp place, padding, seed, workers, CP config."""
        c = self.cp_coordinates
        return dict(
            dp_size=c.dp_size,
            dp_rank=c.dp_rank,
            cp_size=c.cp_size,
            cp_rank=c.cp_rank,
            pad_token_id=self.packing.pad_token_id,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=self.args.dataloader_num_workers,
            cp_config=self.cp_config,
        )

    @property
    def cp_config(self) -> CPConfig:
        """The `CPConfig` given at construction, else the process default at the time of the call."""
        return self._cp_config if self._cp_config is not None else default_config()

    def _local_batch(self, batch: dict) -> dict:
        """A batch sharded for this CP rank: as given if the collator already did it, else the pure
        shard step with the configured layout (each pack of a micro-batch of several)."""
        if PACKS_KEY in batch:
            return {**batch, PACKS_KEY: [self._local_batch(pack) for pack in batch[PACKS_KEY]]}
        if SHARD_KEY in batch:
            return batch
        c = self.cp_coordinates
        return shard_batch(batch, c.cp_size, c.cp_rank, padding_token_id=self.packing.pad_token_id,
                           config=self.cp_config)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device) -> tuple[list, torch.Tensor | None]:
        """The micro-batches of one optimizer step and N = their targets summed over every rank (one all-reduce)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(self._local_batch(next(epoch_iterator)))
            except StopIteration:
                break
        c = self.cp_coordinates
        tally = torch.zeros(2 + c.world_size, dtype=torch.int64)
        packs = [pack for batch in batches for pack in micro_batch_packs(batch)]
        for pack in packs:
            tally[0] += self._micro_batch_items(pack)
            tally[1] += pack["input_ids"].shape[1]
            tally[2 + c.rank] += 0 if self._is_filler(pack) else int(pack["document_ids"].gt(0).sum())
        # Packs with labels but no target, each once: counted by the first rank of its CP group.
        targetless = torch.tensor([sum(c.cp_rank == 0 and _without_targets(pack) for pack in packs)])
        tally, targetless = sum_over_world(torch.cat([tally, targetless]), c.world_size).split([tally.numel(), 1])
        self._note_packs_without_targets(int(targetless))
        self.cp_callback.record(tally[2:].tolist(), int(tally[1]))
        self.cp_tokens_trained += int(tally[2:].sum())
        num_items = torch.tensor(float(max(int(tally[0]), 1)), device=device) if batches else None
        return batches, num_items

    def _micro_batch_items(self, batch: dict) -> int:
        """What the loss of one pack is normalised over, this rank's share: its shard's targets (the
        preference trainers count pairs). Summed over the packs of the optimizer step and every rank, it
        is the `num_items_in_batch` that `compute_loss` receives."""
        labels = batch.get("shift_labels")
        return 0 if labels is None else int(labels.ne(IGNORE_INDEX).sum())

    # ---------------------------------------------------------------- step and loss

    def _is_filler(self, pack: dict) -> bool:
        """Whether a pack only evens the DP replicas' packs of a round (its tokens are no training data)."""
        return False

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None):
        """Each pack of the micro-batch (`micro_batch_packs`) as its own step: the packs before the last
        under `accelerator.no_sync` where the Trainer synchronises this micro-batch, so gradients are
        reduced once, as for one batch; the packs' summed loss, detached, as the Trainer expects."""
        packs = micro_batch_packs(inputs)
        total = None
        for i, pack in enumerate(packs):
            defer = i < len(packs) - 1 and self.accelerator.sync_gradients
            with self.accelerator.no_sync(model) if defer else contextlib.nullcontext():
                loss = self._pack_step(model, pack, num_items_in_batch)
            total = loss if total is None else total + loss
        return total

    def _pack_step(self, model, inputs: dict[str, Any], num_items_in_batch=None):
        """Shard step, then the stock step (forward + backward) inside the step context."""
        inputs = send_to_device(self._local_batch(inputs), self.args.device)
        train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(
            self.cp_mesh, None, inputs, padding_token_id=self.packing.pad_token_id, config=self.cp_config, model=model
        )
        with train_ctx() as step:
            loss = super().training_step(model, local, num_items_in_batch)
        self.cp_callback.note_choices(step.choices)  # kernel, exchange, layout: into the next log, once each
        return loss

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Each rank: local token-loss sum * W / N, so means over the W ranks are the non-CP loss and gradient (I2)."""
        if STEP_KWARG not in inputs:  # evaluation / prediction: the stock path
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        if num_items_in_batch is not None:
            # Without it (a direct call), the shard's own per-pack count (targets / cp_size) is used.
            inputs["num_items_in_batch"] = num_items_in_batch / self.cp_coordinates.world_size
        with router_aux_scope(scale=self._router_aux_scale()) as router:
            outputs = self._cp_forward(model, inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if loss is None:
            raise ValueError("the model returned no loss for a CP batch with labels; expected a causal LM with a loss")
        loss = self._with_router_aux(loss, router.loss, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    # Per-token statistics of the chunked head (`logprobs.STATS`) a CP step's outputs carry, for metrics.
    head_stats: tuple[str, ...] = ()

    def _cp_forward(self, model, inputs: dict):
        """The CP step's forward and loss: through the chunked log-prob head where the model's own loss is
        the same token cross-entropy (`head_loss`: no `[tokens, vocab]` logits), else the model's own."""
        refusal = head_loss_refusal(model, inputs, keeps_router_aux=self._router_aux_scale() != 0)
        outputs = head_token_loss(model, inputs, self.head_stats) if refusal is None else None
        if outputs is None and refusal is None:  # the head could not run in the model's forward: say why
            refusal = head_loss_refusal(model, inputs, keeps_router_aux=self._router_aux_scale() != 0)
        self._loss_path_note(refusal)
        return model(**inputs) if outputs is None else outputs

    def _router_aux_scale(self) -> float:
        """How much of an MoE model's router auxiliary loss (the whole pack's: `model_patches.router_aux_loss`)
        its own loss keeps: dp_size, so the auxiliary losses of every pack of the optimizer step add up, as
        in the stock Trainer (over accumulation steps, and over replicas: it multiplies the model's loss,
        auxiliary loss included, by the number of processes)."""
        return float(self.cp_coordinates.dp_size)

    def _with_router_aux(self, loss: torch.Tensor, aux: torch.Tensor | None, num_items_in_batch) -> torch.Tensor:
        """The loss with any router auxiliary term the model's own loss lacks (`_router_aux_scale`); the
        Trainer's has it all."""
        return loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """Add the callback's token metrics to every training log; average the final `train_loss`."""
        if "loss" in logs:
            logs.update(self.cp_callback.pop_metrics())
        if "train_loss" in logs:
            # The Trainer adds the loss of steps not yet logged as this rank's own value (the logged
            # ones are means over processes). Under CP a rank's loss is its shard's share, so the
            # mean over every rank is the loss of the whole packs; every rank logs this once.
            logs["train_loss"] = self._mean_over_world(float(logs["train_loss"]))
        super().log(logs, *args, **kwargs)

    def train(self, *args, **kwargs):
        """The stock `train`; its returned `training_loss` is the averaged `train_loss` (see `log`)."""
        output = super().train(*args, **kwargs)
        if "train_loss" in output.metrics:
            output = type(output)(output.global_step, output.metrics["train_loss"], output.metrics)
        return output

    def _mean_over_world(self, value: float) -> float:
        world_size = self.cp_coordinates.world_size
        if world_group(world_size) is None:
            return value
        return float(sum_over_world(torch.tensor([value], dtype=torch.float64), world_size).item()) / world_size

    def _note_packs_without_targets(self, packs: int) -> None:
        """Into the next training log (`cp_packs_without_targets`); with `CPConfig(no_target_packs="raise")`
        a ValueError, on every rank alike (`packs` is the world's) before any of them runs the step."""
        if packs and self.cp_config.no_target_packs == "raise":
            raise no_targets_error(packs)
        self.cp_callback.record_packs_without_targets(packs)


def check_train_dataset(dataset, cause: str | None = None) -> None:
    """Raise ValueError for a `train_dataset` without an example (`None`, for evaluation only, and
    datasets without a length pass): the Trainer would stop at once and exit 0 having trained nothing.
    `cause`, where the trainer knows it (a TRL setting that dropped every example), leads the message."""
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return
    try:
        size = len(dataset)
    except TypeError:
        return
    if size == 0 and cause:
        raise ValueError(f"train_dataset holds no example: {cause}")
    if size == 0:
        raise ValueError(
            "train_dataset holds no example (len 0): the Trainer would stop at once, having trained nothing. If a "
            "filter emptied it (dataset.filter, a length cut, TRL's preparation), check that filter"
        )


def _default_find_unused_parameters(training_args, model) -> None:
    """`TrainingArguments.ddp_find_unused_parameters` left None: False for a text-only Transformers model.

    Transformers' own default is True unless activation checkpointing is on, and then every DDP run
    (dp = 1 under CP included) warns that no parameter was unused, and walks the autograd graph an
    extra time per step. Every parameter of a dense text-only causal LM takes part in its loss; a
    composite model (vision tower, ...) and a mixture of experts (an expert no token of a step chose
    has no gradient) keep Transformers' default, as does any value the user set. A model given by
    name (TRL loads it) is left alone too."""
    if training_args is None or getattr(training_args, "ddp_find_unused_parameters", True) is not None:
        return
    config = getattr(model, "config", None) if isinstance(model, torch.nn.Module) else None
    get_text = getattr(config, "get_text_config", None)
    if config is None or not callable(get_text) or get_text(decoder=True) is not config or _has_experts(config):
        return
    training_args.ddp_find_unused_parameters = False


def _has_experts(config) -> bool:
    """Whether a config routes tokens to experts (any positive `*expert*` count: num_experts,
    num_local_experts, n_routed_experts, ...)."""
    return any("expert" in name and isinstance(value, int) and not isinstance(value, bool) and value > 0
               for name, value in config.to_dict().items())


def _without_targets(batch: dict) -> bool:
    """Whether a sharded pack has labels but no target token in the whole pack (its agreed fingerprint)."""
    return "labels" in batch and batch[SHARD_KEY].fingerprint.label_count == 0


class BlockdiagCPTrainer(BlockdiagCPTrainerMixin, Trainer):
    """`transformers.Trainer` with block-diagonal CP on packed data (see `BlockdiagCPTrainerMixin`)."""


class _CompileCheckpointedBodies(TrainerCallback):
    """With `torch_compile`: when training begins (activation checkpointing on, which installs fresh
    checkpoint functions; the model compiled by accelerate; no forward yet), each checkpointed
    layer's body compiles inside its checkpoint, which would otherwise keep it eager."""

    def __init__(self, compile_kwargs: dict):
        self.compile_kwargs = compile_kwargs

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        compile_checkpointed_layers(model, **self.compile_kwargs)
