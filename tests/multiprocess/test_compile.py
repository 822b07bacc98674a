"""`torch.compile` through `blockdiag_cp` (docs/performance.md, "torch.compile"), on real gloo groups.

A compiled copy of the tiny Llama (each decoder layer, the whole model, each checkpointed layer's
body with the exchange plain and overlapped) and of the Qwen3.5-style hybrid trains on four packs
of 14 tokens a rank whose documents, padding and rank assignment differ, at one CP size or several
in turn on the same compiled model (Llama cp = 2 then 1, the hybrid G = 3 then 2). Each step's loss
and every gradient equal the eager model's on the same pack (Llama: ≤ 1e-5 relative, fp32, dense
kernel) and the independent reference (the stock model on every document alone, I1, I2); every step
runs compiled graphs, which hold the decoder layers' dense math (RMSNorm, MLP), not the attention
call; and no pack after a model's first compiles anything, a change of CP size or mixer transport
included (frames and graphs counted by dynamo; one compiled model switched from overlapping by
queries to by keys may compile once more at the switch, then nothing). The Llama variants run one
after the other in one process, as a user's second model would: a later one runs the graphs an
earlier one compiled where dynamo's guards allow. FSDP2 around a compiled model (per layer and
whole, both with checkpointing) stays exact. The Trainer's `torch_compile=True` is tested in
test_trainer.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.compat.torch import compile_counters
from hf_blockdiag_cp.integrations.compile import compile_model
from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.compile_probe import RecordingBackend
from helpers.model_zoo import build_hybrid_pair
from helpers.reference import build_models, compare_with_reference, make_docs, reference_loss_and_grads, rel_err

EAGER_TOL = 1e-5
REFERENCE_TOL = 1e-4
# (document lengths, padding tokens) by CP size: 14 tokens a rank at every size, so one compiled shape
# serves every pack at every size. Each size has several documents, a document over every rank,
# padding, and one document alone.
PACKS = {
    1: (([5, 3, 6], 0), ([2, 12], 0), ([6, 3], 5), ([14], 0)),
    2: (([5, 7, 3, 9, 4], 0), ([2, 17, 9], 0), ([11, 9], 8), ([28], 0)),
    3: (([5, 7, 3, 9, 4, 14], 0), ([2, 31, 9], 0), ([11, 9, 14], 8), ([42], 0)),
}
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather")

# A mode: (CP size, overlap, mixer transport). A variant: (family, compile regions, activation
# checkpointing, its modes, the indices of the modes whose first pack may compile).
CP2_THEN_CP1 = ((2, False, "auto"), (1, False, "auto"))
OVERLAPS = ((2, False, "auto"), (2, "queries", "auto"), (2, "keys", "auto"))
LLAMA_VARIANTS = (("llama", "layers", False, ((2, False, "auto"),), ()), ("llama", "model", False, CP2_THEN_CP1, ()),
                  ("llama", "layers", True, OVERLAPS, (2,)))


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


def cp_groups(group, world_size, sizes):
    """The process group of each CP size in `sizes` on the pool's `world_size` ranks: the pool's own
    group, None (cp = 1: no CP) or a new group of ranks 0..cp-1 (made by every rank; the caller
    destroys it)."""
    return {cp: group if cp == world_size else None if cp == 1 else dist.new_group(list(range(cp)))
            for cp in dict.fromkeys(sizes)}


def compile_case(rank, world_size, group, variants, backend="aot_eager", packs=4):
    """Each variant in turn (`LLAMA_VARIANTS`' form): its steps, as `variant_steps`. One recording backend
    for the whole case, so a later variant runs the graphs an earlier one compiled where dynamo's guards
    let it (as a second model in one process would); compile counts run from the case's start."""
    torch.compiler.reset()
    start = compile_counters()
    recording = RecordingBackend(backend)
    groups = cp_groups(group, world_size, [mode[0] for variant in variants for mode in variant[3]])
    try:
        return [variant_steps(rank, groups, recording, start, packs, *variant[:4]) for variant in variants]
    finally:
        for cp, g in groups.items():
            if g is not None and cp != world_size:
                dist.destroy_process_group(g)


def variant_steps(rank, groups, recording, start, packs, family, regions, checkpointing, modes):
    """A fresh model pair; the compiled copy takes `packs` packs in each mode `(cp, overlap, mixer
    transport)` in turn (a rank outside a mode's CP group sits it out). Per pack: the worst relative
    error against the eager model (this rank's loss and gradients) and against the reference (means
    over the CP group), dynamo's totals since `start`, and what the compiled graphs that ran called."""
    ref, eager = build_hybrid_pair("qwen3_5") if family == "qwen3_5" else build_models("llama")
    if checkpointing:
        enable_activation_checkpointing(eager, use_reentrant=False)
    compiled = compile_model(copy.deepcopy(eager), regions, backend=recording)
    steps = []
    for cp, overlap, transport in modes:
        for seed, (lengths, n_pad) in enumerate(PACKS[cp][:packs] if rank < cp else ()):
            docs, batch = pack(lengths, n_pad, seed)
            ref_loss, ref_grads = reference_loss_and_grads(ref, docs, group=groups[cp])
            config = CONFIG.replace(mixer_transport=transport)
            want_loss, want_grads = train_step(eager, batch, groups[cp], config)
            calls = recording.calls()
            loss, grads = train_step(compiled, batch, groups[cp], config.replace(overlap=overlap))
            ran = recording.ran_between(calls, recording.calls())
            counted = compile_counters()
            vs_eager = max([rel_err(loss, want_loss)] + [rel_err(grads[n], want_grads[n]) for n in want_grads])
            vs_ref = compare_with_reference(compiled, ref_loss, ref_grads, loss, groups[cp], cp)
            worst = max(vs_ref, key=vs_ref.get)
            steps.append({"vs_eager": vs_eager, "vs_reference": max(vs_ref.values()), "worst": (worst, vs_ref[worst]),
                          "compiled": tuple(counted[k] - start[k] for k in ("frames_compiled", "graphs_compiled")),
                          "graphs_ran": len(ran), "ops": sorted(set().union(*(g["ops"] for g in ran))),
                          "mode": (cp, overlap, transport)})
    return steps


def _assert_compiled_steps(results, variants, what, eager_tol=EAGER_TOL):
    """Every pack within `eager_tol` of the eager model and within REFERENCE_TOL of the reference, and
    run through compiled graphs that hold the decoder layers' dense math (MLP activation, RMSNorm) and
    not the attention call. The case's first pack compiles; a variant's first pack may compile, and so
    may the first pack of each of its modes listed as recompiling; no other pack compiles anything."""
    for rank, by_variant in enumerate(results):
        assert by_variant[0][0]["compiled"][1] > 0, f"{what} rank {rank}: nothing compiled"
        for steps, (family, regions, checkpointing, _, recompiling) in zip(by_variant, variants):
            name = f"{what} {family} {regions}{' +ac' if checkpointing else ''} rank {rank}"
            for i, s in enumerate(steps):
                where = f"{name} pack {i} {s['mode']}"
                assert s["vs_eager"] <= eager_tol, f"{where}: {s['vs_eager']:.2e} off the eager model"
                assert s["vs_reference"] <= REFERENCE_TOL, f"{where}: {s['worst']} off the reference"
                assert s["graphs_ran"] > 0, f"{where}: no compiled graph ran"
            modes = list(dict.fromkeys(s["mode"] for s in steps))
            for before, s in zip(steps, steps[1:]):
                if s["mode"] != before["mode"] and modes.index(s["mode"]) in recompiling:
                    continue
                totals = [(t["mode"], t["compiled"]) for t in steps]
                assert s["compiled"] == before["compiled"], f"{name}: a later pack compiled again: {totals}"
            ops = " ".join(op for s in steps for op in s["ops"])
            assert "silu" in ops and "rsqrt" in ops, f"{name}: no decoder layer ran compiled: {ops}"
            assert "scaled_dot_product" not in ops and "all_gather" not in ops, f"{name}: {ops}"


def test_compiled_llama_matches_eager_and_never_recompiles(gloo):
    """On two ranks, the variants of `LLAMA_VARIANTS` in turn: each decoder layer compiled; the whole
    model compiled, at cp = 2 then at cp = 1 (each rank alone, packs of the same 14 tokens a rank),
    compiling nothing at the switch: the process group stays out of the graphs and their guards; the
    checkpointed layers' compiled bodies, running the plain exchange, then the overlapped one split by
    queries and then by keys (against the eager model in order): its collectives and the merge stay
    out of the graphs like the plain exchange's; the switch to keys may compile on its first pack.
    (The whole model compiled with checkpointing: test_trainer.py's compiled Trainer and the FSDP2
    case below.)"""
    results = gloo(2).run(compile_case, timeout=300, variants=LLAMA_VARIANTS)
    _assert_compiled_steps(results, LLAMA_VARIANTS, "cp2")


def test_compiled_hybrid_matches_the_reference_and_never_recompiles(gloo):
    """Qwen3.5-style hybrid: its gated delta-rule token mixer (head-parallel all-to-alls, or state
    passing's all-gathers) is a graph break like attention. One compiled model per rank trains at
    G = 3 by state passing, then ranks 0 and 1 at G = 2 by the head-parallel transport and by state
    passing (packs of 14 tokens a rank throughout): neither switch compiles anything.
    Against the eager model the I1 bound: its gate gradients (A_log, dt_bias) are small, so the compiled
    projections' rounding shows at about 1e-5."""
    variants = (("qwen3_5", "layers", False, ((3, False, "states"), (2, False, "heads"), (2, False, "states")), ()),)
    results = gloo(3).run(compile_case, timeout=300, variants=variants)
    assert [len(r[0]) for r in results] == [12, 12, 4], [[s["mode"] for s in r[0]] for r in results]
    _assert_compiled_steps(results, variants, "G=3 then 2", eager_tol=REFERENCE_TOL)


def test_inductor_compiled_layers_match_eager(gloo):
    """The default backend once (C++ code generation on CPU: slow here, so one rank and two packs)."""
    variants = (("llama", "layers", False, ((1, False, "auto"),), ()),)
    results = gloo(1).run(compile_case, timeout=600, variants=variants, backend="inductor", packs=2)
    _assert_compiled_steps(results, variants, "inductor")


def fsdp_compile_case(rank, world_size, group, regions):
    """FSDP2 (`wrap_model(..., fsdp=True)`) over the CP ranks around a compiled model: the mean loss
    over the group and every full gradient against the reference, after a second step on the same
    pack (the first compiles)."""
    from hf_blockdiag_cp.comm import DPCPCoordinates, build_dp_cp_mesh
    from hf_blockdiag_cp.integrations.accelerate import wrap_model

    ref, model = build_models("llama")
    enable_activation_checkpointing(model, use_reentrant=False)
    docs, batch = pack(*PACKS[2][0], seed=0)
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
