"""The parity matrix (exactness, invariants I1 and I2 in docs/design.md) on any process group: a
tiny Llama model with activation checkpointing trains one step under CP for every kernel x
exchange (and overlap, where the exchange has it) x layout on named packs (documents across shard boundaries, a rank holding only padding,
one document over every rank, optionally a pack of real document lengths), against the stock
model run on each document separately in fp32. gloo on CPU in fp32 (tests/multiprocess/), NCCL
with one process per GPU in bf16 (tests/gpu/); the criteria are docs/testing.md's."""

from __future__ import annotations

import copy

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.kernels import get_kernel
from hf_blockdiag_cp.planning import get_exchange
from hf_blockdiag_cp.bench.common import histogram_lengths
from hf_blockdiag_cp.bench.setups import HIST_CSV
from hf_blockdiag_cp.planning import PAIR_COUNT  # balanced layouts permute tiny packs
from helpers.exchanges import exchanges_for
from helpers.packs import make_pack
from helpers.reference import build_models, make_docs, mean_over_group, means_over_group, reference_loss_and_grads, rel_err

LAYOUTS = ("contiguous", "balanced")
PACKS = ("straddle", "padding_rank", "span_all")
HEADS = (4, 2)  # query, KV heads of the matrix's model


def matrix_exchanges(world_size: int) -> tuple[str, ...]:
    """Every registered exchange that can split the model's heads over `world_size` ranks (a
    head-parallel one needs the 4 query heads divisible by G: not at G = 3)."""
    return exchanges_for(world_size, HEADS)


def matrix_modes(world_size: int, kernel: str = "dense") -> tuple[tuple[str, bool | str], ...]:
    """(exchange, overlap) of every matrix row: each exchange in order, then each one that can
    overlap attention (`ExchangeRecord.begin`) split by queries, then (for a kernel that
    `returns_lse`) split by keys (`CPConfig.overlap`)."""
    names = matrix_exchanges(world_size)
    able = [x for x in names if get_exchange(x).begin is not None]
    splits = ("queries", "keys") if get_kernel(kernel).returns_lse else ("queries",)
    return tuple((x, False) for x in names) + tuple((x, split) for split in splits for x in able)


def model_dims(head_dim: int) -> dict:
    """The tiny Llama of the matrix: 4 query / 2 KV heads (GQA) of `head_dim`."""
    return dict(hidden_size=64, intermediate_size=128, num_attention_heads=HEADS[0], num_key_value_heads=HEADS[1], head_dim=head_dim)


def real_lengths_pack(tokens: int, seed: int = 3):
    """(documents, packed batch) of `tokens` tokens with real document lengths (capped at a quarter of the pack)."""
    lengths = histogram_lengths(HIST_CSV, tokens, seed=seed)
    docs = make_docs(lengths, seed=seed)
    ids = torch.cat(docs)[None]
    return docs, {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}


def _flat(grads: dict, names) -> torch.Tensor:
    return torch.cat([grads[n].float().reshape(-1).cpu() for n in names])


def _reference(ref32, docs, dtype, group=None):
    """The fp32 per-document loss and gradients (built by the ranks of `group` together), and (for a
    half dtype) the stock model's own error in that dtype against them, on this rank alone:
    (loss32, grads32, stock_grad_err, stock_loss_err)."""
    loss32, grads32 = reference_loss_and_grads(ref32, docs, group=group)
    if dtype == torch.float32:
        return loss32, grads32, None, None
    loss_s, grads_s = reference_loss_and_grads(copy.deepcopy(ref32).to(dtype), docs)
    names = list(grads32)
    return loss32, grads32, rel_err(_flat(grads_s, names), _flat(grads32, names)), rel_err(loss_s.float().cpu(), loss32.cpu())


def _cp_row(model, batch, group, world_size, config, loss32, grads32) -> dict:
    """One CP step of `model` on `batch`: the mean-over-ranks loss and gradient errors against the
    reference, the exchange it ran, ranks holding no real token and whether the layout permuted rows."""
    model.zero_grad(set_to_none=True)
    train_ctx, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    with train_ctx() as step:
        loss = model(**local).loss
        loss.backward()
    grads = means_over_group({n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()},
                             group, world_size)
    names = list(grads32)
    slots = layout.slot_positions.reshape(-1)
    return {
        "loss_err": rel_err(mean_over_group(loss, group, world_size).cpu(), loss32.cpu()),
        "grad_err": rel_err(_flat(grads, names), _flat(grads32, names)),
        "grad_err_max_param": max(rel_err(grads[n].cpu(), grads32[n].cpu()) for n in names),
        "exchange_taken": step.kv_exchange,
        "overlapped_queries": round(float(mean_over_group(torch.tensor(float(step.overlapped_queries)), group, world_size)) * world_size),
        "padding_ranks": sum(1 for r in layout.real_tokens_per_rank() if r == 0),
        "permuted": bool((slots != torch.arange(slots.numel())).any()),
    }


def parity_matrix_case(
    rank, world_size, group, kernels, device="cpu", dtype="float32", head_dim=16, packs=PACKS, real_tokens_per_rank=0
):
    """Every kernel x exchange x layout on every pack (plus, with `real_tokens_per_rank`, a pack of
    real lengths of that many tokens per rank): one row of errors each. `device="cuda"` runs on the
    rank's current GPU (the NCCL pool puts rank r on GPU r)."""
    device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    dtype = getattr(torch, dtype)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    named = [(name, *make_pack(name, world_size)) for name in packs]
    if real_tokens_per_rank:
        named.append(("real_lengths", *real_lengths_pack(real_tokens_per_rank * world_size)))
    rows = []
    for pack, docs, batch in named:
        ref32, model = build_models("llama", **model_dims(head_dim))
        loss32, grads32, stock_grad_err, stock_loss_err = _reference(ref32.to(device), [d.to(device) for d in docs], dtype, group)
        model = model.to(device, dtype)
        enable_activation_checkpointing(model, use_reentrant=False)
        batch = {k: v.to(device) for k, v in batch.items()}
        for kernel in kernels:
            for exchange, overlap in matrix_modes(world_size, kernel):
                for layout in LAYOUTS:
                    config = bdcp.CPConfig(attn_backend=kernel, kv_exchange=exchange, layout=layout, kernel_cost=PAIR_COUNT,
                                           overlap=overlap)
                    row = {"pack": pack, "kernel": kernel, "exchange": exchange, "overlap": overlap, "layout": layout,
                           "stock_grad_err": stock_grad_err, "stock_loss_err": stock_loss_err}
                    rows.append({**row, **_cp_row(model, batch, group, world_size, config, loss32, grads32)})
    return rows
