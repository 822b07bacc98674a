"""`BlockdiagCPGRPOTrainer` and `BlockdiagCPRLOOTrainer`: TRL's RL trainers with exact, packed CP log-probs.

Everything of TRL's stays as it is at the world size it runs at: the prompts each rank samples,
generation (the HF model's `generate` outside any CP step, or vLLM), rewards and advantages, the
losses of every `loss_type`, their normalisation over accumulation steps and ranks, and the
metrics. One thing is replaced: `_get_per_token_logps_and_entropies`, the model's log-probs of the
completion tokens (policy, old policy, reference). Each rank keeps its own rows; its CP group
gathers the rows of all its ranks, packs them padding-free, shards the pack and scores it in one
CP step without `[tokens, vocab]` logits (`integrations.completions`), and each rank gets its own
rows' log-probs back. Every rank so trains on its own completions as in TRL, while the long
sequences are split over the group; DDP's mean gradient is TRL's (docs/design.md, "RL steps").

The step with gradients stays active until `training_step`'s backward is done (`_step_scope`).
"""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from ...comm.parallel_dims import ParallelDims
from ...compat.trl import logps_result, overrides
from ...config import CPConfig, default_config
from ...data.completions import CompletionRows
from ...model_patches import apply_model_patches
from ...model_patches.router_aux_loss import router_aux_scope, scope_loss
from ..completions import completion_log_probs, cp_group_of, gather_rows
from ..trainer.setup import (
    check_model_setup,
    check_no_deepspeed,
    check_no_foreign_parallelism,
    check_same_weights,
    check_sharded_model_engine,
    check_world,
    checkpointing_kwargs,
    resolve_cp_mesh,
    sum_over_world,
)
from .setup import check_reference_source, pad_token_of, policy_load_args, prepare_reference, warn_if_unverified_trl


class RLCPMixin:
    """What GRPO and RLOO share: the CP setup and checks, and the log-probs of completion rows
    computed by the CP group (module docstring). Extra keyword arguments:
      cp_size: ranks per CP group (1 = padding-free packing only); the world size must be a multiple.
      cp_config: the `CPConfig` of every CP step (default: the process default, `configure_cp`).
      cp_mesh: optional 1-D DeviceMesh or ProcessGroup of this rank's CP group.
      max_tokens: optional bound on one CP step's pack (the group's rows of one forward); a forward
        over more tokens raises, naming the longest sequence, instead of running out of memory.
    """

    config_class: type = GRPOConfig

    def __init__(self, *args, cp_size: int = 1, cp_config: CPConfig | None = None, cp_mesh=None,
                 max_tokens: int | None = None, **kwargs):
        warn_if_unverified_trl()
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        name = self.config_class.__name__
        if not isinstance(training_args, self.config_class):
            raise ValueError(f"args must be a trl.{name}; got {type(training_args).__name__}")
        check_no_foreign_parallelism(name, getattr(training_args, "parallelism_config", None))
        check_no_deepspeed(type(self).__name__, training_args)
        check_world(training_args, cp_size)
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise TypeError(f"cp_config must be a CPConfig or None; got {type(cp_config).__name__}")
        _check_rl_config(training_args, name, cp_size, max_tokens)
        model = kwargs.get("model", args[0] if args else None)
        check_reference_source(model, training_args, name, kwargs.get("peft_config"))
        loaded_with = policy_load_args(model, training_args, name)
        if loaded_with is not training_args:
            args, kwargs = _with_args(args, kwargs, loaded_with)
        self._cp_config, self.cp_max_tokens = cp_config, max_tokens
        self._step_scope: contextlib.ExitStack | None = None
        super().__init__(*args, **kwargs)
        apply_model_patches(self.accelerator.unwrap_model(self.model))
        check_model_setup(self.model, self.args.world_size, cp_size, checkpointing_kwargs(self.args), cache_allowed=True)
        check_sharded_model_engine(self)
        if self.ref_model is not None:
            prepare_reference(self.model, self.ref_model)
            check_same_weights({"ref_model": self.ref_model}, self.args.world_size)
        self.cp_coordinates = ParallelDims(cp=cp_size, world_size=self.args.world_size, rank=self.args.process_index)
        self.cp_mesh = resolve_cp_mesh(cp_mesh, self.cp_coordinates, self.args.device.type)
        self.cp_pad_token_id = pad_token_of(self.processing_class)

    @property
    def cp_config(self) -> CPConfig:
        """The `CPConfig` given at construction, else the process default at the time of the call."""
        return self._cp_config if self._cp_config is not None else default_config()

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's step; the CP step of the log-probs with gradients stays active through its backward."""
        with contextlib.ExitStack() as scope:
            self._step_scope = scope
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._step_scope = None

    @overrides("GRPOTrainer", "RLOOTrainer")
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **model_inputs):
        """TRL's per-token log-probs ([B, logits_to_keep]) and entropies of the completion tokens, from
        the CP group's packed rows; TRL's `batch_size` chunks the rows of forwards without gradients. With
        `compute_aux_loss`, the MoE router auxiliary loss of this rank's own rows, as TRL computes it per
        rank (`_router_aux`), averaged over the chunks as TRL averages them."""
        given = sorted(k for k, v in model_inputs.items() if v is not None)
        if given:
            raise ValueError(f"{type(self).__name__} takes text-only rows; got the multimodal inputs {given}, which "
                             "block-diagonal CP does not shard")
        rows = CompletionRows.of(input_ids, attention_mask, logits_to_keep)
        group_rows, me = gather_rows(rows, cp_group_of(self.cp_mesh))
        most = max(r.rows for r in group_rows)
        size = batch_size if batch_size and not torch.is_grad_enabled() else max(most, 1)
        pieces = [[r.take(start, start + size) for r in group_rows] for start in range(0, most, size)]
        self._check_forward(pieces)
        stats = ("entropy",) if compute_entropy else ()
        logps, entropies, aux = [], [], []
        for piece in pieces:
            with self._router_aux(model, piece, me, compute_aux_loss) as router:
                values, extra = completion_log_probs(
                    model, piece[me], cp_mesh=self.cp_mesh, group_rows=piece, cp_config=self.cp_config,
                    pad_token_id=self.cp_pad_token_id, temperature=self.temperature, stats=stats, scope=self._step_scope)
            logps.append(values)
            entropies.append(extra.get("entropy"))
            if router is not None and piece[me].rows:
                aux.append(scope_loss(router, f"{self.config_class.__name__}.router_aux_loss_coef"))
        aux_loss = torch.stack(aux).mean() if compute_aux_loss else None
        return logps_result(torch.cat(logps), torch.cat(entropies) if compute_entropy else None, aux_loss)

    def _router_aux(self, model, piece: list[CompletionRows], me: int, wanted: bool):
        """The scope of one forward's MoE router auxiliary loss (`model_patches.router_aux_loss`), or a null
        context when not `wanted`: the pack's documents are the CP ranks' rows in rank order, so each rank's
        rows are one group of the statistics and each rank gets its own rows' loss, TRL's per-rank value."""
        if not wanted:
            return contextlib.nullcontext()
        owners = torch.repeat_interleave(torch.arange(len(piece)), torch.tensor([r.rows for r in piece]))
        return router_aux_scope(model, request=True, groups=owners, own=me)

    def _check_forward(self, pieces: list[list[CompletionRows]]) -> None:
        """Refuse, on every rank alike (one all-reduce over the world), a forward whose pack would exceed
        `max_tokens`; the message names the setting to change. A forward without any completion token
        (every completion masked by `mask_truncated_completions`) runs like any other: TRL's losses weigh
        the log-probs by the completion mask, so it trains nothing (zero gradients, on every parameter the
        forward used) and logs what TRL logs for it."""
        tokens = [sum(sum(r.tokens()) for r in piece) for piece in pieces]
        over = self.cp_max_tokens is not None and max(tokens) > self.cp_max_tokens
        if not int(sum_over_world(torch.tensor([int(over)]), self.cp_coordinates.world_size)[0]):
            return
        name = self.config_class.__name__
        if not over:
            raise ValueError(f"another CP group's forward packs more than max_tokens={self.cp_max_tokens} tokens")
        piece = pieces[tokens.index(max(tokens))]
        r, b = max(((r, b) for r in piece for b in range(r.rows)), key=lambda rb: rb[0].tokens()[rb[1]])
        prompt = int(r.attention_mask[b, : r.prompt_columns].sum())
        raise ValueError(
            f"the CP group's rows of one forward hold {max(tokens)} tokens, more than max_tokens={self.cp_max_tokens} "
            f"(the longest: a prompt of {prompt} tokens and a completion of {r.tokens()[b] - prompt}); raise "
            f"max_tokens, or lower {name}.per_device_train_batch_size, max_completion_length or the prompts' length"
        )


def _with_args(args: tuple, kwargs: dict, config) -> tuple[tuple, dict]:
    """The trainer's positional and keyword arguments with `config` as its `args` (third positional)."""
    if "args" in kwargs:
        return args, {**kwargs, "args": config}
    return (*args[:2], config, *args[3:]), kwargs


def _check_rl_config(args, name: str, cp_size: int, max_tokens: int | None) -> None:
    """Settings the CP log-probs do not support, refused by name before TRL builds anything."""
    if args.use_liger_kernel:
        raise ValueError(f"{name}.use_liger_kernel is True; expected False: Liger's GRPO loss computes its own "
                         "log-probs, which are not sharded under block-diagonal CP")
    if getattr(args, "cast_lm_head_to_fp32", False):
        raise ValueError(f"{name}.cast_lm_head_to_fp32 is True; expected False: the CP log-prob head already "
                         "projects each chunk with float32 accumulation, and the cast was not verified with it")
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        raise ValueError(f"{name}.entropy_coef={args.entropy_coef} / use_adaptive_entropy="
                         f"{args.use_adaptive_entropy}; expected 0 / False: the entropy bonus needs the entropy's "
                         "gradient, which the CP log-prob head does not compute")
    if max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0 or max_tokens % (2 * cp_size):
            raise ValueError(f"max_tokens must be a positive multiple of 2*cp_size={2 * cp_size}; got {max_tokens!r}")
        if args.max_completion_length is not None and args.max_completion_length >= max_tokens:
            raise ValueError(f"{name}.max_completion_length={args.max_completion_length} is not below max_tokens="
                             f"{max_tokens}: a completion and its prompt must fit one pack")


class BlockdiagCPGRPOTrainer(RLCPMixin, GRPOTrainer):
    """`trl.GRPOTrainer` whose log-probs are computed packed and sharded over a CP group, exactly per
    sequence (`RLCPMixin`). Arguments: those of `GRPOTrainer` (as keywords), plus `cp_size`,
    `cp_config`, `cp_mesh` and `max_tokens`. Every `loss_type` of TRL 1.16 runs unchanged."""

    config_class = GRPOConfig


class BlockdiagCPRLOOTrainer(RLCPMixin, RLOOTrainer):
    """`trl.RLOOTrainer` with the same CP log-probs (`RLCPMixin`)."""

    config_class = RLOOConfig
