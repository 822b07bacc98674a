"""The Trainer's setup: packing options, the checks that refuse a setup which would train wrongly
or hang under block-diagonal CP, this rank's place in the dp x cp grid and its CP mesh.

Every check gives the same answer on every rank (it reads only settings that all ranks share),
so a mistake raises everywhere instead of leaving some ranks waiting in a collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...comm.consensus import collective_device
from ...compat.transformers import attn_implementation, checkpoint_function, checkpointing_call
from ...comm.parallel_dims import ParallelDims, world_size_error
from ...data.collator import BlockdiagCPCollator
from ...data.packing import oversize_policy
from ..accelerate import launched_world_size
from ..memory import check_offload_kept
from ..transformers import ATTN_IMPLEMENTATION


@dataclass(frozen=True)
class PackingOptions:
    """How the Trainer packs its train and eval datasets (see `hf_blockdiag_cp.data.packed_dataloader`).

    `oversize`: what happens to a document longer than `max_tokens`: "split" (cut into pack-sized
    pieces, each its own document; a warning counts them) or "raise" (a ValueError naming it).
    """

    max_tokens: int
    pad_token_id: int = 0
    buffer_size: int = 1024
    oversize: str = "split"
    shuffle: bool = True
    length_key: str = "input_ids"

    def __post_init__(self):
        object.__setattr__(self, "oversize", oversize_policy(self.oversize))  # frozen: normalise once

    def validate(self, cp_size: int) -> None:
        """Raise ValueError naming the field (the collator's own checks: positive, multiple of 2*cp_size, ...)."""
        if self.max_tokens is None:
            raise ValueError("max_tokens is required: the token budget of one pack (a multiple of 2*cp_size)")
        BlockdiagCPCollator(self.max_tokens, self.pad_token_id, cp_size, None, self.oversize)
        if isinstance(self.buffer_size, bool) or not isinstance(self.buffer_size, int) or self.buffer_size <= 0:
            raise ValueError(f"packing_buffer_size must be a positive integer; got {self.buffer_size!r}")


# --------------------------------------------------------------------------- the model


def activation_checkpointing_reentrant(model: torch.nn.Module) -> bool | None:
    """None if no module checkpoints, else whether any checkpointed module uses reentrant checkpointing.

    A checkpoint function without an explicit `use_reentrant` counts as reentrant: that is
    torch's default when the argument is missing.
    """
    active = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not active:
        return None
    for module in active:
        func = checkpoint_function(module)
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


def check_model_setup(model, world_size: int, cp_size: int, activation_checkpointing_kwargs: dict | None,
                      cache_allowed: bool = False) -> None:
    """Raise ValueError for a model or world that would train wrongly or hang under block-diagonal CP.
    `cache_allowed`: the model also generates (RL), and its CP steps pass use_cache=False themselves."""
    reason = world_size_error(world_size, cp_size)
    if reason is not None:
        raise ValueError(reason)
    configs = _configs(model)
    if not configs:
        raise ValueError(f"model ({type(model).__name__}) has no `config`; a Transformers PreTrainedModel is expected")
    impl = attn_implementation(configs[0])
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model's attention implementation is {impl!r}; expected {ATTN_IMPLEMENTATION!r}. `import hf_blockdiag_cp`, "
            f"then load with attn_implementation={ATTN_IMPLEMENTATION!r} or call "
            f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}); any other implementation attends only "
            "inside each rank's shard"
        )
    for config in configs:
        if getattr(config, "use_cache", False) and not cache_allowed:
            raise ValueError(
                f"{type(config).__name__}.use_cache is True; expected False for CP training (a KV cache of a "
                "CP shard is not a cache of the sequence). Leave TrainingArguments.use_cache False (the Trainer "
                "copies it into model.config) and set model.config.use_cache = False in custom loops"
            )
    _check_checkpointing(model, activation_checkpointing_kwargs)


def checkpointing_kwargs(args) -> dict | None:
    """The TrainingArguments' checkpointing keyword arguments under either spelling:
    `activation_checkpointing_kwargs` (transformers >= 5.23) or `gradient_checkpointing_kwargs` (before)."""
    return getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)


def _check_checkpointing(model, activation_checkpointing_kwargs: dict | None) -> None:
    kwargs = activation_checkpointing_kwargs or {}
    if isinstance(kwargs, dict) and kwargs.get("use_reentrant") is True:
        raise ValueError(
            "the checkpointing kwargs (TrainingArguments.activation_checkpointing_kwargs, before transformers 5.23 "
            "gradient_checkpointing_kwargs) have use_reentrant=True; expected {'use_reentrant': False}: "
            "block-diagonal CP recomputes attention with the step's keyword arguments, which needs "
            "non-reentrant checkpointing"
        )
    if activation_checkpointing_reentrant(model):
        raise ValueError(
            "the model uses reentrant activation checkpointing (use_reentrant=True or not given); expected "
            "non-reentrant: enable it with activation_checkpointing_kwargs={'use_reentrant': False} "
            f"(TrainingArguments; gradient_checkpointing_kwargs before transformers 5.23) or {checkpointing_call()}"
        )


# --------------------------------------------------------------------------- the Trainer


def check_no_foreign_parallelism(owner: str, parallelism_config) -> None:
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


def check_no_deepspeed(owner: str, args) -> None:
    """Raise if DeepSpeed would wrap the model: `args.deepspeed` (a config file or dict), or accelerate's
    launch environment (`accelerate launch --use_deepspeed`). Reads settings only: every rank raises
    alike, before any collective."""
    if getattr(args, "deepspeed", None):
        found = f"{type(args).__name__}.deepspeed is set"
    elif (getattr(args, "deepspeed_plugin", None) is not None
          or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
        found = "DeepSpeed is on (ACCELERATE_USE_DEEPSPEED=true: accelerate launch --use_deepspeed)"
    else:
        return
    raise ValueError(
        f"{found}; expected no DeepSpeed: {owner} was not verified under DeepSpeed's engine (its loss scaling, and "
        "ZeRO's parameter gathering around the CP step). Use DDP or FSDP2"
    )


def check_sharded_model_engine(trainer) -> None:
    """Raise if the model was sharded with FSDP2 (`fully_shard`) but the Trainer does not run FSDP:
    accelerate would wrap the sharded model in DDP, which cannot reduce FSDP2's sharded parameters."""
    from torch.distributed.fsdp import FSDPModule

    if getattr(trainer, "is_fsdp_enabled", False) or not any(isinstance(m, FSDPModule) for m in trainer.model.modules()):
        return
    raise ValueError(
        f"the model is sharded with FSDP2 (fully_shard), but {type(trainer).__name__} does not run FSDP "
        "(TrainingArguments.fsdp is unset, or accelerate runs FSDP on accelerator devices only); expected "
        "TrainingArguments(fsdp=True, fsdp_config={'version': 2}) on GPUs, or the model unsharded"
    )


def check_launched_world(args) -> None:
    """Raise if the launcher started several processes but TrainingArguments runs each alone: on a host
    without CUDA, transformers does that unless `use_cpu=True`."""
    launched = launched_world_size()
    if launched <= 1 or args.world_size == launched:
        return
    if not torch.cuda.is_available() and not args.use_cpu:
        fix = (
            "This host has no CUDA, and then transformers joins the processes only with TrainingArguments(use_cpu=True): "
            "pass use_cpu=True (or use_cpu=not torch.cuda.is_available(), right on CPU and on GPUs)"
        )
    else:
        fix = "Check the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) and TrainingArguments' device settings"
    raise ValueError(
        f"the launcher started {launched} processes (WORLD_SIZE={launched}), but TrainingArguments sees world size "
        f"{args.world_size}: each process would train alone. {fix}"
    )


def check_world(args, cp_size: int) -> None:
    """Raise ValueError if the launched processes cannot form CP groups of `cp_size` (the first thing a
    user fixes: checked before the pack size, which must be a multiple of 2*cp_size)."""
    check_launched_world(args)
    reason = world_size_error(args.world_size, cp_size)
    if reason is not None:
        raise ValueError(reason)


def check_one_pack_per_micro_batch(args, hint: str = "") -> None:
    """Raise unless `per_device_train_batch_size` is 1: each micro-batch is one pack of max_tokens tokens.
    `hint`: what else the trainer offers, appended to the message."""
    if args.per_device_train_batch_size != 1:
        raise ValueError(
            f"{type(args).__name__}.per_device_train_batch_size is {args.per_device_train_batch_size}; expected 1: each "
            "micro-batch is one pack of max_tokens tokens (raise max_tokens or gradient_accumulation_steps for a larger "
            f"batch){hint}"
        )


def check_trainer_setup(trainer, cp_size: int) -> None:
    """Misconfigurations of a constructed Trainer that would silently break I2 or run the Trainer's own CP."""
    args = trainer.args
    check_launched_world(args)
    check_model_setup(trainer.model, args.world_size, cp_size, checkpointing_kwargs(args))
    check_sharded_model_engine(trainer)
    check_offload_kept(trainer.model, args)
    check_no_foreign_parallelism("accelerator", getattr(trainer.accelerator, "parallelism_config", None))
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
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError("compute_loss_func must be None: CP labels are pre-shifted per shard; the model computes the loss")
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        raise ValueError(
            f"{type(trainer.accelerator.unwrap_model(trainer.model)).__name__} does not accept loss kwargs "
            "(num_items_in_batch, shift_labels); expected a Transformers model whose forward takes **kwargs"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("DeepSpeed is not supported by the BlockdiagCP Trainer (its loss scaling is untested); use DDP or FSDP")
    if isinstance(trainer.train_dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            "train_dataset is an IterableDataset; expected a map-style dataset (datasets.Dataset or a list of "
            "dicts with input_ids): the packed sampler plans every epoch from the document lengths"
        )


# --------------------------------------------------------------------------- ranks and groups


def resolve_cp_mesh(cp_mesh, coords: ParallelDims, device_type: str):
    """The CP mesh of this rank: the given one after checking its ranks, else `coords.build_mesh`'s
    (None without CP). `coords`: this rank's `ParallelDims` (or its alias `DPCPCoordinates`)."""
    if cp_mesh is None:
        return coords.build_mesh(device_type).cp if coords.cp_size > 1 else None
    ranks = dist.get_process_group_ranks(_cp_group_of(cp_mesh))
    if sorted(ranks) != coords.cp_group_ranks:
        raise ValueError(
            f"cp_mesh holds ranks {sorted(ranks)}; expected {coords.cp_group_ranks} (cp_size={coords.cp_size}, CP "
            "fastest-varying: ParallelDims(cp=cp_size, world_size=world_size, rank=rank).build_mesh(device_type).cp)"
        )
    return cp_mesh


def _cp_group_of(cp_mesh):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be a 1-D DeviceMesh (the CP dimension); got {cp_mesh.ndim} dimensions")
        return cp_mesh.get_group()
    if isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    raise TypeError(f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None; got {type(cp_mesh).__name__}")


def world_group(world_size: int):
    """The default process group, or None in a single process (nothing to reduce)."""
    return dist.group.WORLD if world_size > 1 and dist.is_available() and dist.is_initialized() else None


def sum_over_world(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """`values` summed over every rank with one all-reduce, on the CPU (as given in a single process)."""
    group = world_group(world_size)
    if group is None:
        return values
    values = values.to(collective_device(group))
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values.cpu()


def weight_checksum(model: torch.nn.Module) -> torch.Tensor:
    """[2] float64: the sum and the sum of squares of `model`'s parameters held whole on this rank (a
    DTensor's shard differs per rank by design and is left out), in chunks of 16M elements."""
    from torch.distributed.tensor import DTensor

    total = torch.zeros(2, dtype=torch.float64)
    for param in model.parameters():
        if isinstance(param, DTensor):
            continue
        for chunk in param.detach().reshape(-1).split(1 << 24):
            chunk = chunk.double()
            total += torch.stack([chunk.sum(), chunk.dot(chunk)]).cpu()
    return total


def check_same_weights(models: dict, world_size: int) -> None:
    """Raise ValueError on every rank where one of `models` ({name: module}) differs between ranks
    (`weight_checksum`, bit for bit against rank 0), naming the model and the ranks: one all-gather.
    A reference model is not synchronised by DDP, so one built from each rank's own seed would train
    each rank against a different reference, silently."""
    group = world_group(world_size)
    if group is None or not models:
        return
    mine = torch.stack([weight_checksum(m) for m in models.values()]).reshape(-1)
    every = torch.empty(world_size * mine.numel(), dtype=torch.float64, device=collective_device(group))
    dist.all_gather_into_tensor(every, mine.to(every.device), group=group)
    every = every.cpu().reshape(world_size, len(models), 2)
    for i, name in enumerate(models):
        ranks = [r for r in range(world_size) if not torch.equal(every[r, i], every[0, i])]
        if ranks:
            raise ValueError(
                f"{name} differs between ranks: ranks {ranks} hold other weights than rank 0 (sum, sum of squares: "
                f"{every[0, i].tolist()} on rank 0, {every[ranks[0], i].tolist()} on rank {ranks[0]}); expected the same "
                f"{name} on every rank: build or load it identically everywhere (the same path, or the same seed "
                "before building it)"
            )

