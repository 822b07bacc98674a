"""Transformers `Trainer` integration: packed data per DP replica, one CP shard step per micro-batch.

Why a Trainer subclass and not only a callback: callbacks run after the dataloader is built,
so they cannot replace the collator or the sampler, and they cannot wrap forward *and*
backward in the step context. `BlockdiagCPTrainerMixin` therefore owns four Trainer hooks:

- `get_train_dataloader`: `packed_dataloader` with this rank's (dp, cp) coordinates, so CP
  peers get the same pack and DP replicas different ones (never `accelerator.prepare`d).
- `get_batch_samples`: counts the targets of the whole optimizer step over every rank (one
  SUM all-reduce per optimizer step, which also carries the token metrics).
- `training_step`: shard step (`make_cp_blockdiag_batch_and_ctx`), then the stock step, i.e.
  forward and `accelerator.backward`, inside `train_ctx()`.
- `compute_loss`: passes `num_items_in_batch = N / W` to the model (N = targets of the whole
  optimizer step over all ranks, W = world size), so each rank's loss is
  `local token-loss sum * W / N` (I2): DDP's gradient mean over the W ranks and the Trainer's
  logged mean over processes are exactly the non-CP values. Nothing here depends on the
  Trainer's own `num_items_in_batch` counting, `average_tokens_across_devices` or its
  multiplication by the number of processes, which differ between Transformers versions.
- `evaluate`: the eval documents packed by the same packing code (nothing dropped: the last
  partial pack is padded; packs that only fill the DP replicas' last round weigh 0), every
  pack through the shard step under CP, forward only, each rank holding 1/G of it.
  `eval_loss` is the token-weighted mean over every predicted eval token (the training
  loss's definition), i.e. the stock model's loss on each document unpacked.

`BlockdiagCPCallback` checks the setup at `on_train_begin` and meters tokens for the logs.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from ..comm import resolve_cp_group
from ..comm.consensus import agree, collective_device
from ..comm.exchange import all_gather_single
from ..data.collator import BlockdiagCPCollator
from ..data.loader import dp_cp_coordinates, packed_dataloader
from ..config import CPConfig, default_config
from ..model_patches import apply_model_patches
from ..step import IGNORE_INDEX, SHARD_KEY, STEP_KWARG, make_cp_blockdiag_batch_and_ctx, shard_batch
from ..step.build import layout_options
from .transformers import ATTN_IMPLEMENTATION

__all__ = [
    "BlockdiagCPCallback",
    "BlockdiagCPTrainer",
    "BlockdiagCPTrainerMixin",
    "CPCoordinates",
    "PackingOptions",
    "activation_checkpointing_reentrant",
]


# --------------------------------------------------------------------------- plain settings


@dataclass(frozen=True)
class CPCoordinates:
    """Where this process sits in the dp x cp grid (CP fastest-varying: CP group = ranks [dp*cp, (dp+1)*cp))."""

    world_size: int
    rank: int
    cp_size: int
    dp_size: int
    dp_rank: int
    cp_rank: int

    @staticmethod
    def of(world_size: int, rank: int, cp_size: int) -> "CPCoordinates":
        dp_size, dp_rank, cp_rank = dp_cp_coordinates(world_size, rank, cp_size)
        return CPCoordinates(world_size, rank, cp_size, dp_size, dp_rank, cp_rank)

    @property
    def cp_group_ranks(self) -> list[int]:
        return list(range(self.dp_rank * self.cp_size, (self.dp_rank + 1) * self.cp_size))


@dataclass(frozen=True)
class PackingOptions:
    """How the Trainer packs `train_dataset` (see `hf_blockdiag_cp.data.packed_dataloader`)."""

    max_tokens: int
    pad_token_id: int = 0
    buffer_size: int = 1024
    oversize: str = "split"
    shuffle: bool = True
    length_key: str = "input_ids"

    def validate(self, cp_size: int) -> None:
        """Raise ValueError naming the field (the collator's own checks: positive, multiple of 2*cp_size, ...)."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is required: the token budget of one pack (a multiple of 2*cp_size)")
        BlockdiagCPCollator(self.max_tokens, self.pad_token_id, cp_size, None, self.oversize)
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size <= 0:
            raise ValueError(f"packing_buffer_size must be a positive integer; got {self.buffer_size!r}")


# --------------------------------------------------------------------------- setup checks


def activation_checkpointing_reentrant(model: torch.nn.Module) -> bool | None:
    """None if no module checkpoints, else whether any checkpointed module uses reentrant checkpointing.

    A checkpoint function without an explicit `use_reentrant` counts as reentrant: that is
    torch's default when the argument is missing.
    """
    active = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not active:
        return None
    for module in active:
        func = getattr(module, "_gradient_checkpointing_func", None)
        keywords = getattr(func, "keywords", None) or {}
        if keywords.get("use_reentrant", True) is not False:
            return True
    return False


def _configs(model) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text(decoder=True)
        if text is not None and text is not config:
            configs.append(text)
    return configs


@dataclass
class TokenMeter:
    """Tokens since the last log: real tokens per rank, pack slots over all ranks, and the window's start time."""

    world_size: int
    real_tokens: list[int] = field(default_factory=list)
    pack_tokens: int = 0
    window_start: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.real_tokens = [0] * self.world_size
        self.pack_tokens = 0
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
    `cp_rank_imbalance` (max / mean of the per-rank real tokens).
    """

    def __init__(self, cp_size: int = 1):
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size <= 0:
            raise ValueError(f"cp_size must be a positive integer; got {cp_size!r}")
        self.cp_size = cp_size
        self.meter = TokenMeter(world_size=1)

    def check_setup(self, model, world_size: int, activation_checkpointing_kwargs: dict | None = None) -> None:
        """Raise ValueError for a setup that would train wrongly or hang under block-diagonal CP."""
        if world_size % self.cp_size:
            raise ValueError(
                f"world size {world_size} is not divisible by cp_size={self.cp_size}: every CP group needs "
                f"cp_size ranks (launch a multiple of {self.cp_size} processes or change cp_size)"
            )
        configs = _configs(model)
        if not configs:
            raise ValueError(f"model ({type(model).__name__}) has no `config`; a Transformers PreTrainedModel is expected")
        impl = getattr(configs[0], "_attn_implementation", None)
        if impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"model.config._attn_implementation is {impl!r}; expected {ATTN_IMPLEMENTATION!r}. `import hf_blockdiag_cp`, "
                f"then load with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
                f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}); any other implementation attends only "
                "inside each rank's shard"
            )
        for config in configs:
            if getattr(config, "use_cache", False):
                raise ValueError(
                    f"{type(config).__name__}.use_cache is True; expected False for CP training (a KV cache of a "
                    "CP shard is not a cache of the sequence). Leave TrainingArguments.use_cache False (the Trainer "
                    "copies it into model.config) and set model.config.use_cache = False in custom loops"
                )
        kwargs = activation_checkpointing_kwargs or {}
        if isinstance(kwargs, dict) and kwargs.get("use_reentrant") is True:
            raise ValueError(
                "activation_checkpointing_kwargs has use_reentrant=True; expected {'use_reentrant': False}: "
                "block-diagonal CP recomputes attention with the step's keyword arguments, which needs "
                "non-reentrant checkpointing"
            )
        if activation_checkpointing_reentrant(model):
            raise ValueError(
                "the model uses reentrant activation checkpointing (use_reentrant=True or not given); expected "
                "non-reentrant: enable it with activation_checkpointing_kwargs={'use_reentrant': False} "
                "(TrainingArguments) or model.activation_checkpointing_enable()"
            )

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.check_setup(model, args.world_size, getattr(args, "activation_checkpointing_kwargs", None))
        self.meter = TokenMeter(world_size=args.world_size)

    def record(self, real_tokens_per_rank: list[int], pack_tokens: int) -> None:
        """Account one optimizer step (all ranks' numbers, identical on every rank)."""
        self.meter.add(real_tokens_per_rank, pack_tokens)

    def pop_metrics(self) -> dict[str, float]:
        return self.meter.pop()


# --------------------------------------------------------------------------- the Trainer mixin


def _check_no_foreign_parallelism(owner: str, parallelism_config) -> None:
    """Raise if accelerate's own CP / SP / TP would act on the model (in the config or in accelerate's launch env)."""
    enabled = [n for n in ("cp_enabled", "sp_enabled", "tp_enabled") if getattr(parallelism_config, n, False)]
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        for dim in ("cp", "sp", "tp"):
            size = os.environ.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1").strip()
            if size not in ("", "1"):
                enabled.append(f"{dim}_size={size} (accelerate launch --parallelism_config_{dim}_size)")
    if enabled:
        raise ValueError(
            f"{owner} parallelism_config has {', '.join(enabled)}; expected no context/sequence/tensor parallelism "
            "there: accelerate's CP shards packed rows causally across documents. Pass cp_size to the BlockdiagCP "
            "Trainer instead and leave parallelism_config (and --parallelism_config_cp_size) unset"
        )


def _world_group(world_size: int):
    return dist.group.WORLD if world_size > 1 and dist.is_available() and dist.is_initialized() else None


def _in_pack_order(rows: torch.Tensor, layout, cp) -> torch.Tensor:
    """This rank's rows `[L, ...]` of a pack, gathered over the CP group into pack order `[S, ...]` (CPU)."""
    if cp.group is not None:
        gathered = rows.new_empty((cp.size * rows.shape[0],) + tuple(rows.shape[1:]))
        all_gather_single(gathered, rows.contiguous(), cp.group)
        rows = gathered  # slot order: rank-major, as layout.slot_positions
    full = rows.new_empty((layout.padded_seq_len,) + tuple(rows.shape[1:]))
    full[layout.slot_positions.reshape(-1).to(rows.device)] = rows
    return full[: layout.original_seq_len].cpu()


def _cp_group_of(cp_mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be a 1-D DeviceMesh (the CP dimension); got {cp_mesh.ndim} dimensions")
        return cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    raise TypeError(f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None; got {type(cp_mesh).__name__}")


class BlockdiagCPTrainerMixin:
    """Mix into a `transformers.Trainer` subclass (before it) for block-diagonal CP on packed data.

    Extra keyword arguments (all else goes to the Trainer):
      cp_size: ranks per CP group (1 = no CP, packing only). The world must be a multiple.
      max_tokens: tokens per pack (required; a multiple of 2*cp_size).
      cp_mesh: optional 1-D DeviceMesh or ProcessGroup of this rank's CP group; it must hold ranks
        [dp*cp_size, (dp+1)*cp_size). Default: built with `init_device_mesh(..., ("dp", "cp"))`.
      cp_config: the `CPConfig` of every CP step (kernel, exchange, layout; default: the process
        default, `configure_cp`). Its layout shards training and evaluation packs.
      pad_token_id, packing_buffer_size, oversize ("split"|"reject"), shuffle, length_key:
        packing options of `hf_blockdiag_cp.data.packed_dataloader`.
    Do not pass `data_collator`: training batches come from the packed dataloader.
    """

    # The loss from compute_loss is already normalised over the whole optimizer step (I2).
    loss_is_scaled_for_ga = True

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
        _check_no_foreign_parallelism("TrainingArguments", getattr(training_args, "parallelism_config", None))
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
        self.packing = PackingOptions(max_tokens, pad_token_id, packing_buffer_size, oversize, shuffle, length_key)
        self.packing.validate(cp_size)
        super().__init__(*args, **kwargs)
        apply_model_patches(self.model)  # per-family patches (Phi-3 global RoPE, ...); idempotent
        self.add_callback(self.cp_callback)
        self._check_trainer_setup()
        self.cp_coordinates = CPCoordinates.of(self.args.world_size, self.args.process_index, cp_size)
        self.cp_mesh = self._resolve_cp_mesh(cp_mesh)

    # ---------------------------------------------------------------- setup

    def _check_trainer_setup(self) -> None:
        """Misconfigurations that would silently break I2 or run the Trainer's own CP; same answer on every rank."""
        args = self.args
        self.cp_callback.check_setup(self.model, args.world_size, getattr(args, "activation_checkpointing_kwargs", None))
        _check_no_foreign_parallelism("accelerator", getattr(self.accelerator, "parallelism_config", None))
        if args.per_device_train_batch_size != 1:
            raise ValueError(
                f"per_device_train_batch_size is {args.per_device_train_batch_size}; expected 1: each micro-batch is one "
                "pack of max_tokens tokens (raise max_tokens or gradient_accumulation_steps for a larger batch)"
            )
        if args.n_gpu > 1:
            raise ValueError(
                f"args.n_gpu is {args.n_gpu} (torch DataParallel in one process); expected one device per process: "
                "launch with torchrun / accelerate launch"
            )
        if args.label_smoothing_factor != 0:
            raise ValueError(
                f"label_smoothing_factor is {args.label_smoothing_factor}; expected 0: the label smoother would shift "
                "the already shifted CP labels"
            )
        if getattr(self, "compute_loss_func", None) is not None:
            raise ValueError("compute_loss_func must be None: CP labels are pre-shifted per shard; the model computes the loss")
        if not getattr(self, "model_accepts_loss_kwargs", False):
            raise ValueError(
                f"{type(self.accelerator.unwrap_model(self.model)).__name__} does not accept loss kwargs "
                "(num_items_in_batch, shift_labels); expected a Transformers model whose forward takes **kwargs"
            )
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("DeepSpeed is not supported by the BlockdiagCP Trainer (its loss scaling is untested); use DDP or FSDP")
        if isinstance(self.train_dataset, torch.utils.data.IterableDataset):
            raise ValueError(
                "train_dataset is an IterableDataset; expected a map-style dataset (datasets.Dataset or a list of "
                "dicts with input_ids): the packed sampler plans every epoch from the document lengths"
            )

    def _resolve_cp_mesh(self, cp_mesh):
        c = self.cp_coordinates
        if cp_mesh is None:
            if c.cp_size == 1:
                return None
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(self.args.device.type, (c.dp_size, c.cp_size), mesh_dim_names=("dp", "cp"))
            return mesh["cp"]
        group = _cp_group_of(cp_mesh)
        ranks = dist.get_process_group_ranks(group)
        if sorted(ranks) != c.cp_group_ranks:
            raise ValueError(
                f"cp_mesh holds ranks {sorted(ranks)}; expected {c.cp_group_ranks} (cp_size={c.cp_size}, CP fastest-"
                "varying: init_device_mesh(device, (dp, cp), mesh_dim_names=('dp', 'cp'))['cp'])"
            )
        return cp_mesh

    # ---------------------------------------------------------------- data

    def get_train_dataloader(self):
        """One pack per micro-batch, already sharded for this CP rank; the same number of packs on every rank."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        c = self.cp_coordinates
        loader = self._packed_loader(self.train_dataset, shuffle=self.packing.shuffle, drop_last=self.args.dataloader_drop_last)
        agreement = agree(_world_group(c.world_size), False, {"packs per epoch": len(loader)})
        if agreement.disagreeing():
            low, high = agreement.value("packs per epoch")
            raise RuntimeError(
                f"ranks disagree on the number of packs per epoch (this rank: {len(loader)}; range "
                f"{low}..{high}): every rank must see the same train_dataset and "
                "packing options, or the Trainer's steps would hang"
            )
        return loader

    def _packed_loader(self, dataset, shuffle: bool, drop_last: bool):
        c, p = self.cp_coordinates, self.packing
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return packed_dataloader(
            dataset,
            p.max_tokens,
            dp_size=c.dp_size,
            dp_rank=c.dp_rank,
            cp_size=c.cp_size,
            cp_rank=c.cp_rank,
            pad_token_id=p.pad_token_id,
            seed=seed,
            shuffle=shuffle,
            buffer_size=p.buffer_size,
            num_workers=self.args.dataloader_num_workers,
            oversize=p.oversize,
            drop_last=drop_last,
            length_key=p.length_key,
            cp_config=self.cp_config,
        )

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
        totals = torch.zeros(3, dtype=torch.float64)  # token-loss sum, targets, real tokens
        for pack in self._sharded_forward(dataset, with_logits=False):
            totals += torch.tensor(pack["totals"], dtype=torch.float64)
        metrics = self._loss_metrics(totals, time.time() - started, metric_key_prefix)
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

        started = time.time()
        totals = torch.zeros(3, dtype=torch.float64)
        mine = []
        for pack in self._sharded_forward(test_dataset, with_logits=True):
            totals += torch.tensor(pack["totals"], dtype=torch.float64)
            if pack["index"] is not None:
                mine.append((pack["index"], pack["logits"], pack["labels"]))
        metrics = self._loss_metrics(totals, time.time() - started, metric_key_prefix)
        group = _world_group(self.cp_coordinates.world_size)
        if group is not None:  # every replica's packs to every rank (CP peers hold the same: rank 0 sends)
            everyone: list = [None] * self.cp_coordinates.world_size
            dist.all_gather_object(everyone, mine if self.cp_coordinates.cp_rank == 0 else [], group=group)
            mine = [item for part in everyone for item in part]
        mine.sort(key=lambda item: item[0])
        predictions = np.stack([logits.numpy() for _, logits, _ in mine])
        label_ids = np.stack([labels.numpy() for _, _, labels in mine])
        return PredictionOutput(predictions=predictions, label_ids=label_ids, metrics=metrics)

    def _sharded_forward(self, dataset, with_logits: bool):
        """Forward only, every pack of `dataset` through the shard step under CP. Yields per pack this
        rank's `totals` (token-loss sum, targets, real tokens; zeros for packs that only fill the DP
        replicas' last round), and with `with_logits` the pack's logits and shifted labels in pack
        order (gathered over the CP group) and its index in the epoch (None for a fill pack)."""
        loader = self.get_eval_dataloader(dataset)
        sampler = loader.batch_sampler
        repeats = sampler.replica_repeats()
        cp = resolve_cp_group(self.cp_mesh)
        model = self.model  # not the DDP wrapper: forward only; an FSDP2 module is its own wrapper
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for j, (batch, repeat) in enumerate(zip(loader, repeats)):
                    inputs = self._prepare_inputs(self._local_batch(batch))
                    train_ctx, local, layout = make_cp_blockdiag_batch_and_ctx(
                        self.cp_mesh, None, inputs, padding_token_id=self.packing.pad_token_id, config=self.cp_config
                    )
                    local["num_items_in_batch"] = 1  # the model returns this rank's token-loss sum
                    with train_ctx():
                        out = model(**local)
                    targets = int(local["shift_labels"].ne(IGNORE_INDEX).sum())
                    pack = {"totals": [0.0, 0, 0] if repeat else
                            [float(out.loss) if targets else 0.0, targets, int(local["document_ids"].gt(0).sum())]}
                    if with_logits:
                        pack["index"] = None if repeat else j * sampler.dp_size + sampler.dp_rank
                        pack["logits"] = _in_pack_order(out.logits[0].float(), layout, cp)
                        pack["labels"] = _in_pack_order(local["shift_labels"][0], layout, cp)
                    yield pack
        finally:
            model.train(was_training)

    def _loss_metrics(self, totals: torch.Tensor, runtime: float, prefix: str) -> dict[str, float]:
        """Token-weighted loss over every rank's targets (one SUM all-reduce of the per-rank totals)."""
        group = _world_group(self.cp_coordinates.world_size)
        if group is not None:
            totals = totals.to(collective_device(group))
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
            totals = totals.cpu()
        loss_sum, targets, tokens = totals.tolist()
        return {
            f"{prefix}_loss": loss_sum / targets if targets else math.nan,
            f"{prefix}_tokens": int(tokens),
            f"{prefix}_runtime": round(runtime, 4),
            f"{prefix}_tokens_per_second": round(tokens / runtime, 3) if runtime > 0 else math.nan,
        }

    @property
    def cp_config(self) -> CPConfig:
        """The `CPConfig` given at construction, else the process default at the time of the call."""
        return self._cp_config if self._cp_config is not None else default_config()

    def _local_batch(self, batch: dict) -> dict:
        """A batch sharded for this CP rank: as given if the collator already did it, else the pure
        shard step with the configured layout."""
        if SHARD_KEY in batch:
            return batch
        c = self.cp_coordinates
        return shard_batch(batch, c.cp_size, c.cp_rank, padding_token_id=self.packing.pad_token_id,
                           **layout_options(self.cp_config))

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
        for batch in batches:
            labels = batch.get("shift_labels")
            if labels is not None:
                tally[0] += int(labels.ne(IGNORE_INDEX).sum())
            tally[1] += batch["input_ids"].shape[1]
            tally[2 + c.rank] += int(batch["document_ids"].gt(0).sum())
        group = _world_group(c.world_size)
        if group is not None:
            tally = tally.to(collective_device(group))
            dist.all_reduce(tally, op=dist.ReduceOp.SUM, group=group)
            tally = tally.cpu()
        self.cp_callback.record(tally[2:].tolist(), int(tally[1]))
        num_items = torch.tensor(float(max(int(tally[0]), 1)), device=device) if batches else None
        return batches, num_items

    # ---------------------------------------------------------------- step and loss

    def training_step(self, model, inputs: dict[str, Any], num_items_in_batch=None):
        """Shard step, then the stock step (forward + backward) inside the step context."""
        inputs = self._prepare_inputs(self._local_batch(inputs))
        train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(
            self.cp_mesh, None, inputs, padding_token_id=self.packing.pad_token_id, config=self.cp_config
        )
        with train_ctx():
            return super().training_step(model, local, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """Each rank: local token-loss sum * W / N, so means over the W ranks are the non-CP loss and gradient (I2)."""
        if STEP_KWARG not in inputs:  # evaluation / prediction: the stock path
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        if num_items_in_batch is not None:
            # Without it (a direct call), the shard's own per-pack count (targets / cp_size) is used.
            inputs["num_items_in_batch"] = num_items_in_batch / self.cp_coordinates.world_size
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if loss is None:
            raise ValueError("the model returned no loss for a CP batch with labels; expected a causal LM with a loss")
        return (loss, outputs) if return_outputs else loss

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
            output = output._replace(training_loss=output.metrics["train_loss"])
        return output

    def _mean_over_world(self, value: float) -> float:
        group = _world_group(self.cp_coordinates.world_size)
        if group is None:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return float(t.item()) / self.cp_coordinates.world_size


class BlockdiagCPTrainer(BlockdiagCPTrainerMixin, Trainer):
    """`transformers.Trainer` with block-diagonal CP on packed data (see `BlockdiagCPTrainerMixin`)."""
