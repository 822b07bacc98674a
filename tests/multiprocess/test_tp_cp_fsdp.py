"""TP × CP × FSDP2 composed on one `ParallelDims` grid, on real gloo groups (I1, I2).

World 8 = dp_shard 2 × cp 2 × tp 2 and world 4 = cp 2 × tp 2. `wrap_model` shards the model with
its own Transformers TP plan over the tp mesh (Transformers' DTensor styles), then FSDP2 over
dp_shard × cp; each dp replica trains its own pack, its CP group shards it, and the TP ranks of
each CP rank run that shard with half the heads and MLP channels. A tiny Llama and a tiny Qwen3.5
(gated delta-rule layers, which its plan leaves replicated: their projections gather their
outputs). Against the stock model run on each document alone (eager, unpacked; `helpers.reference`):
the mean loss over each CP group equals its pack's, and every gradient, gathered from the DTensors
with `full_tensor()`, equals the mean over the replicas' packs (FSDP2 averages over dp_shard × cp,
and each rank's loss carries the CP scale), within 1e-4. The attention calls see the local heads
only, and a tp mesh that shares ranks with the cp mesh is refused on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import TP_MIN_TRANSFORMERS, tensor_parallel_supported
from hf_blockdiag_cp.integrations.accelerate import wrap_model
from hf_blockdiag_cp.planning import PAIR_COUNT
from helpers.model_zoo import build_hybrid_pair
from helpers.reference import build_models, make_pack, reference_loss_and_grads, rel_err

pytestmark = pytest.mark.skipif(not tensor_parallel_supported(),
                                reason=f"tensor parallelism needs transformers >= {TP_MIN_TRANSFORMERS}")

TOL = 1e-4
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather", kernel_cost=PAIR_COUNT)
PACKS = ("straddle", "span_all")  # the pack of dp replica 0 and of replica 1 (helpers.reference layouts)


def _references(ref, dims, group):
    """Per replica: its pack (documents, batch), its reference loss; and the reference gradients
    averaged over the replicas (what FSDP2's average over dp_shard × cp gives). The ranks of `group`
    build each replica's reference together."""
    packs, losses, grads = [], [], {}
    for replica in range(dims.dp_size):
        docs, batch = make_pack(PACKS[replica % len(PACKS)], dims.cp, seed=1 + replica)
        loss, replica_grads = reference_loss_and_grads(ref, docs, group=group)
        packs.append(batch)
        losses.append(loss)
        for name, g in replica_grads.items():
            grads[name] = grads.get(name, 0) + g / dims.dp_size
    return packs, losses, grads


def _local_head_widths(model) -> list[int]:
    """The width of every attention output that reaches `o_proj` (heads × head_dim of this TP rank), recorded."""
    widths = []
    for name, module in model.named_modules():
        if name.endswith("self_attn.o_proj"):
            module.register_forward_pre_hook(lambda _, args: widths.append(args[0].shape[-1]))
    return widths


def _tp_sharded(param, tp: int) -> bool:
    """Whether a parameter is a DTensor sharded over the "tp" dimension of its mesh."""
    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return tp > 1 and param.placements[param.device_mesh.mesh_dim_names.index("tp")].is_shard()


def tp_cp_fsdp_case(rank, world_size, group, family, dp_shard, cp, tp, dp_replicate=1):
    """One step of `family` on the grid; the worst relative errors against the reference and what TP did."""
    dims = bdcp.ParallelDims(dp_replicate, dp_shard, cp, tp)  # world size and rank: the default group's
    mesh = dims.build_mesh("cpu")
    ref, model = build_hybrid_pair("qwen3_5") if family == "qwen3_5" else build_models("llama")
    packs, ref_losses, ref_grads = _references(ref, dims, group)
    heads_width = model.config.num_attention_heads * model.config.head_dim
    model = wrap_model(model, mesh, fsdp=True)
    widths = _local_head_widths(model)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(mesh.cp, mesh.tp, packs[dims.dp_rank], config=CONFIG)
    with train_ctx() as step:
        loss = model(**local).loss
        loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    cp_loss = loss.detach().clone()
    dist.all_reduce(cp_loss, group=mesh.cp.get_group())
    errors = {"loss": rel_err(cp_loss / dims.cp, ref_losses[dims.dp_rank])}
    errors.update({n: rel_err(grads[n], ref_grads[n]) for n in ref_grads})
    worst = max(errors, key=errors.get)
    sharded = sorted(n for n, p in model.named_parameters() if _tp_sharded(p, tp))
    return {
        "worst": (worst, errors[worst]),
        "local_widths": sorted(set(widths)),
        "full_width": heads_width,
        "tp_sharded": sharded,
        "cp_ranks": dist.get_process_group_ranks(mesh.cp.get_group()),
        "expected_cp_ranks": dims.cp_group_ranks,
        "attention_calls": step.attention_calls,
    }


# (family, dp_replicate, dp_shard, cp, tp); dp_replicate > 1: HSDP (FSDP2 shards over dp_shard × cp, replicates across).
GRIDS = [
    pytest.param(family, 1, 2, 2, 2, id=f"{family}-world8-dp_shard2-cp2-tp2") for family in ("llama", "qwen3_5")
] + [
    pytest.param(family, 1, 1, 2, 2, id=f"{family}-world4-cp2-tp2") for family in ("llama", "qwen3_5")
] + [
    pytest.param("llama", 2, 1, 2, 2, id="llama-world8-hsdp-dp_replicate2-cp2-tp2"),
    pytest.param("llama", 2, 1, 2, 1, id="llama-world4-hsdp-dp_replicate2-cp2"),
]


@pytest.mark.parametrize("family,dp_replicate,dp_shard,cp,tp", GRIDS)
def test_tp_cp_fsdp2_matches_the_stock_model_per_document(gloo, family, dp_replicate, dp_shard, cp, tp):
    world_size = dp_replicate * dp_shard * cp * tp
    results = gloo(world_size).run(tp_cp_fsdp_case, timeout=240, family=family, dp_replicate=dp_replicate,
                                   dp_shard=dp_shard, cp=cp, tp=tp)
    for rank, res in enumerate(results):
        name, error = res["worst"]
        assert error <= TOL, f"{family} rank {rank}: {name} relative error {error:.2e}"
        assert res["cp_ranks"] == res["expected_cp_ranks"], f"rank {rank}: CP group {res['cp_ranks']}"
        assert res["attention_calls"] > 0
        # TP really split the heads: each attention output holds 1/tp of them, and the projections are DTensors.
        assert res["local_widths"] == [res["full_width"] // tp], f"rank {rank}: attention widths {res['local_widths']}"
        if tp == 1:
            assert res["tp_sharded"] == []
            continue
        assert any(n.endswith("self_attn.q_proj.weight") for n in res["tp_sharded"]), res["tp_sharded"]
        assert any(n.endswith("mlp.down_proj.weight") for n in res["tp_sharded"]), res["tp_sharded"]
        if family == "qwen3_5":  # the delta-rule layers' projections are sharded too, their outputs gathered
            assert any("linear_attn.in_proj_qkv" in n for n in res["tp_sharded"]), res["tp_sharded"]


def refused_case(rank, world_size, group):
    """The cp mesh passed as tp_mesh too, and DDP asked for around TP: each refused on every rank."""
    mesh = bdcp.ParallelDims(cp=2, tp=2).build_mesh("cpu")
    _, batch = make_pack("straddle", 2)
    messages = []
    try:
        bdcp.make_cp_blockdiag_batch_and_ctx(mesh.cp, mesh.cp, batch, config=CONFIG)
    except ValueError as exc:
        messages.append(str(exc))
    try:
        wrap_model(build_models("llama")[1], mesh, fsdp=False)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_overlapping_meshes_and_ddp_around_tp_are_refused_on_every_rank(gloo):
    for rank, messages in enumerate(gloo(4).run(refused_case, timeout=120)):
        assert len(messages) == 2, f"rank {rank}: {messages}"
        assert "cp_mesh and tp_mesh share ranks" in messages[0], messages[0]
        assert "tp=2 with dp×cp=2 ranks needs fsdp=True" in messages[1], messages[1]
