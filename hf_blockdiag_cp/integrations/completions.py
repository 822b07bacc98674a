"""Per-token log-probs of completion rows, computed by the CP group together: `completion_log_probs`.

What an RL step needs from the model (TRL's `_get_per_token_logps_and_entropies`): for padded rows
`[B, L]` of prompt + completion, the log-prob of each completion token, `[B, completions]`. Each
rank of a CP group holds its own rows (its own prompts and completions, as a data-parallel rank
holds them). The group gathers every rank's rows, packs them padding-free into one pack
(`data.completions`), shards the pack over the group and runs one CP step; each rank scores the
targets of its shard with the chunked head (`logprobs.shard_log_probs`, no `[tokens, vocab]`
logits), scatters them to their slots, and one differentiable SUM all-reduce gives every rank every
slot. Each rank keeps its own rows' block. A loss built on that block only reaches the other
ranks' shards through the all-reduce's backward, so the sum of the group's gradients is the
gradient of the sum of its losses, and DDP's mean over the ranks is the data-parallel one.

A step with gradients must be backpropagated while it is still active (checkpointed layers and
token mixers find it then): give `scope`, an `ExitStack` that stays open until the backward is done.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from accelerate.utils import send_to_device

from ..comm.reduce import all_reduce_sum
from ..config import CPConfig, default_config
from ..data.completions import NO_SLOT, CompletionRows, completion_pack
from ..logprobs import shard_log_probs
from ..step import make_cp_blockdiag_batch_and_ctx


def cp_group_of(cp_mesh):
    """The process group of a 1-D CP DeviceMesh or ProcessGroup (None: no CP)."""
    if cp_mesh is None or isinstance(cp_mesh, dist.ProcessGroup):
        return cp_mesh
    return cp_mesh.get_group()


def gather_rows(rows: CompletionRows, group) -> tuple[list[CompletionRows], int]:
    """Every CP rank's rows in rank order, and this rank's index among them (one all_gather_object)."""
    if group is None or dist.get_world_size(group) == 1:
        return [rows], 0
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, rows, group=group)
    return everyone, dist.get_rank(group)


def completion_log_probs(
    model,
    rows: CompletionRows,
    *,
    cp_mesh=None,
    group_rows: list[CompletionRows] | None = None,
    cp_config: CPConfig | None = None,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    stats: tuple[str, ...] = (),
    chunk_size: int | None = None,
    scope: contextlib.ExitStack | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """([B, completions] fp32 log-probs of this rank's completion tokens, 0 where the mask is 0;
    {stat: [B, completions]} without gradient), computed in one CP step over the group's rows.

    `cp_mesh`: this rank's 1-D CP mesh or group (None: one rank); `group_rows`: every CP rank's rows
    when already gathered (`gather_rows`), else gathered here; `stats`, `chunk_size`, `temperature`:
    as for `document_log_probs`; `scope`: where a step with gradients stays active until the
    backward (module docstring). Every rank of the group must call this, in the same order.
    """
    if scope is None and torch.is_grad_enabled():
        raise ValueError("completion_log_probs with gradients needs `scope`, an ExitStack left open until the backward "
                         "is done (the CP step must be active while it runs); under torch.no_grad() it is not needed")
    group = cp_group_of(cp_mesh)
    if group_rows is None:
        group_rows, me = gather_rows(rows, group)
    else:
        me = 0 if group is None else dist.get_rank(group)
    cp_size = len(group_rows)
    config = cp_config if cp_config is not None else default_config()
    local, slots = completion_pack(group_rows, pad_token_id, cp_size, me, config)
    device = model.device if hasattr(model, "device") else next(model.parameters()).device
    local = send_to_device(local, device)
    local["use_cache"] = False
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(cp_mesh, None, local, padding_token_id=pad_token_id,
                                                          config=config, model=model)
    with contextlib.ExitStack() as own:
        (scope if torch.is_grad_enabled() else own).enter_context(train_ctx())
        tokens, extra, _ = shard_log_probs(model, local, stats=stats, chunk_size=chunk_size, temperature=temperature)
    slots = slots.reshape(-1).to(tokens.device)
    scored = slots != NO_SLOT
    where = slots[scored]
    total = sum(r.slots for r in group_rows)
    start = sum(r.slots for r in group_rows[:me])

    def mine(values: torch.Tensor) -> torch.Tensor:
        flat = values.new_zeros(total).index_put((where,), values[scored])
        return all_reduce_sum(flat, group)[start : start + rows.slots].view(rows.rows, rows.completions)

    with torch.no_grad():
        extra = {name: mine(value) for name, value in extra.items()}
    return mine(tokens), extra
