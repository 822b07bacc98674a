"""`torch.compile` through `blockdiag_cp` (docs/performance.md, "torch.compile"), on real gloo groups.

A compiled copy of the tiny Llama (the whole model or each decoder layer, with and without
activation checkpointing) and of the Qwen3.5-style hybrid trains on four packs of one length
whose documents, padding and rank assignment differ. Each step's loss and every gradient equal
the eager model's on the same pack (Llama: ≤ 1e-5 relative, fp32, dense kernel) and the
independent reference (the stock model on every document alone, I1, I2); the compiled graphs
hold the decoder layers' dense math (RMSNorm, MLP), not the attention call; and no pack after
the first compiles anything (frames and graphs counted by dynamo; one compiled model switched from
overlapping by queries to by keys compiles once more at the switch, then nothing). FSDP2 around a compiled model
(per layer and whole) stays exact. The Trainer's `torch_compile=True` is tested in test_trainer.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.compat.torch import compile_counters
from hf_blockdiag_cp.integrations.compile import compile_model
from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.model_zoo import build_hybrid_pair
from helpers.reference import build_models, compare_with_reference, make_docs, reference_loss_and_grads, rel_err

EAGER_TOL = 1e-5
REFERENCE_TOL = 1e-4
# (document lengths, padding tokens): 28 tokens each, so one compiled shape serves every pack.
PACKS = (([5, 7, 3, 9, 4], 0), ([2, 17, 9], 0), ([11, 9], 8), ([28], 0))
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather")

GRAPH_OPS: list[set[str]] = []  # the call targets of every graph the recording backend compiled


def recording_backend(backend: str):
    """`backend` (a registered torch.compile backend), recording what each compiled graph calls."""
    inner = lookup_backend(backend)

    def compile_graph(gm, example_inputs):
        GRAPH_OPS.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return inner(gm, example_inputs)

    return compile_graph


def pack(lengths: list[int], n_pad: int, seed: int):
    docs = make_docs(lengths, seed)
    ids = torch.cat(docs + [torch.zeros(n_pad, dtype=torch.long)])[None]
    labels = ids.clone()
    labels[0, ids.shape[1] - n_pad :] = -100
    batch = {"input_ids": ids, "labels": labels}
    if n_pad:
        batch["document_ids"] = torch.cat([document_ids_from_lengths(lengths), torch.zeros(n_pad, dtype=torch.long)])[None]
    else:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, batch


def train_step(model, batch, group, config=CONFIG):
    model.zero_grad(set_to_none=True)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    with train_ctx() as step:
        loss = model(**local).loss
        loss.backward()
    assert step.attention_calls > 0
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def compile_case(rank, world_size, group, regions, checkpointing, backend="aot_eager", packs=PACKS, family="llama",
                 overlaps=(False,), transports=("auto",)):
    """Per pack: the worst relative error against the eager model (this rank's loss and gradients)
    and against the reference (means over the group), and dynamo's running totals after the step.
    One compiled model takes the packs under each overlap mode and each mixer transport in turn."""
    torch.compiler.reset()
    GRAPH_OPS.clear()
    ref, eager = build_hybrid_pair("qwen3_5") if family == "qwen3_5" else build_models("llama")
    if checkpointing:
        enable_activation_checkpointing(eager, use_reentrant=False)
    compiled = compile_model(copy.deepcopy(eager), regions, backend=recording_backend(backend))
    steps = []
    packs = PACKS[:packs] if isinstance(packs, int) else packs
    runs = [(overlap, transport, seed, *p) for overlap in overlaps for transport in transports
            for seed, p in enumerate(packs)]
    for overlap, transport, seed, lengths, n_pad in runs:
        docs, batch = pack(lengths, n_pad, seed)
        ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
        want_loss, want_grads = train_step(eager, batch, group, CONFIG.replace(mixer_transport=transport))
        loss, grads = train_step(compiled, batch, group, CONFIG.replace(overlap=overlap, mixer_transport=transport))
        counted = compile_counters()
        totals = (counted["frames_compiled"], counted["graphs_compiled"])
        vs_eager = max([rel_err(loss, want_loss)] + [rel_err(grads[n], want_grads[n]) for n in want_grads])
        vs_ref = compare_with_reference(compiled, ref_loss, ref_grads, loss, group, world_size)
        worst = max(vs_ref, key=vs_ref.get)
        steps.append({"vs_eager": vs_eager, "vs_reference": max(vs_ref.values()), "compiled": totals,
                      "worst": (worst, vs_ref[worst]), "mode": (overlap, transport)})
    return {"steps": steps, "graph_ops": [sorted(ops) for ops in GRAPH_OPS]}


def _assert_compiled_steps(results, what, eager_tol=EAGER_TOL, switch_compiles=False):
    """`switch_compiles`: a new mode (overlap, transport) may compile on its first pack, else nothing may."""
    for rank, res in enumerate(results):
        steps = res["steps"]
        for i, s in enumerate(steps):
            assert s["vs_eager"] <= eager_tol, f"{what} rank {rank} pack {i}: {s['vs_eager']:.2e} off the eager model"
            assert s["vs_reference"] <= REFERENCE_TOL, f"{what} rank {rank} pack {i}: {s['worst']} off the reference"
        assert steps[0]["compiled"][1] > 0, f"{what} rank {rank}: nothing compiled"
        for mode in dict.fromkeys(s["mode"] for s in steps) if switch_compiles else [None]:
            totals = [s["compiled"] for s in steps if mode is None or s["mode"] == mode]
            assert totals[1:] == totals[:1] * (len(totals) - 1), f"{what} {mode} rank {rank}: later packs compiled again: {totals}"
        ops = " ".join(op for graph in res["graph_ops"] for op in graph)
        # The decoder layers' dense math is in the graphs (MLP activation, RMSNorm), the attention call is not.
        assert "silu" in ops and "rsqrt" in ops, f"{what} rank {rank}: no decoder layer compiled: {res['graph_ops']}"
        assert "scaled_dot_product" not in ops and "all_gather" not in ops


@pytest.mark.parametrize(
    "world_size,regions,checkpointing,overlaps",
    [(2, "model", False, (False,)), (2, "layers", False, (False,)), (2, "layers", True, (False,)),
     (1, "model", False, (False,)), (2, "model", True, ("queries", "keys"))],
    ids=["cp2-model", "cp2-layers", "cp2-layers-ac", "cp1-model", "cp2-model-ac-overlap"],
)
def test_compiled_steps_match_eager_and_never_recompile(gloo, world_size, regions, checkpointing, overlaps):
    """Also compiled with the exchange overlapped, split by queries and then by keys on the same compiled
    model (against the eager model in order): its collectives and the merge stay out of the graphs like
    the plain exchange's; the switch may compile on its first pack, no later pack compiles."""
    results = gloo(world_size).run(compile_case, timeout=300, regions=regions, checkpointing=checkpointing,
                                   overlaps=overlaps)
    _assert_compiled_steps(results, f"cp{world_size} {regions}{' +ac' if checkpointing else ''}", switch_compiles=True)


@pytest.mark.parametrize("world_size,transports", [(2, ("heads", "states")), (3, ("states",))],
                         ids=["2-heads-states", "3-states"])
def test_compiled_hybrid_matches_the_reference_and_never_recompiles(gloo, world_size, transports):
    """Qwen3.5-style hybrid: its gated delta-rule token mixer (head-parallel all-to-alls, or state
    passing's all-gathers; at G = 2 both in turn on one compiled model, the switch compiling nothing) is a
    graph break like attention.
    Against the eager model the I1 bound: its gate gradients (A_log, dt_bias) are small, so the compiled
    projections' rounding shows at about 1e-5."""
    results = gloo(world_size).run(compile_case, timeout=300, regions="layers", checkpointing=False, family="qwen3_5",
                                   transports=transports)
    _assert_compiled_steps(results, f"qwen3_5 cp{world_size} layers {'+'.join(transports)}", eager_tol=REFERENCE_TOL)


def test_inductor_compiled_layers_match_eager(gloo):
    """The default backend once (C++ code generation on CPU: slow here, so one rank and two packs)."""
    results = gloo(1).run(compile_case, timeout=600, regions="layers", checkpointing=False, backend="inductor", packs=2)
    _assert_compiled_steps(results, "inductor cp1 layers")


def fsdp_compile_case(rank, world_size, group, regions):
    """FSDP2 (`wrap_model(..., fsdp=True)`) over the CP ranks around a compiled model: the mean loss
    over the group and every full gradient against the reference, after a second step on the same
    pack (the first compiles)."""
    from hf_blockdiag_cp.comm import DPCPCoordinates, build_dp_cp_mesh
    from hf_blockdiag_cp.integrations.accelerate import wrap_model

    ref, model = build_models("llama")
    enable_activation_checkpointing(model, use_reentrant=False)
    docs, batch = pack(*PACKS[0], seed=0)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    mesh = build_dp_cp_mesh(DPCPCoordinates(world_size, rank, world_size), "cpu")
    model = wrap_model(compile_model(model, regions, backend="aot_eager"), mesh, fsdp=True)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(mesh.cp, None, batch, config=CONFIG)
        with train_ctx():
            loss = model(**local).loss
            loss.backward()
    grads = {n.replace("_orig_mod.", ""): p.grad.full_tensor() for n, p in model.named_parameters()}
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    mean_loss = loss.detach().clone()
    torch.distributed.all_reduce(mean_loss, group=group)
    errors = [rel_err(mean_loss / world_size, ref_loss)] + [rel_err(grads[n], ref_grads[n]) for n in ref_grads]
    return max(errors)


@pytest.mark.parametrize("regions", ["layers", "model"])
def test_fsdp2_around_a_compiled_model_matches_the_reference(gloo, regions):
    """FSDP2 shards over the dp x cp ranks (here the two CP ranks) and averages the gradients; the
    compiled layers' graph break at attention leaves the CP step exact under it."""
    for rank, worst in enumerate(gloo(2).run(fsdp_compile_case, timeout=300, regions=regions)):
        assert worst <= REFERENCE_TOL, f"rank {rank} {regions}: relative error {worst:.2e}"
