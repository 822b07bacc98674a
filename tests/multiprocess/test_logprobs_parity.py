"""Per-document log-probs under CP (`logprobs.document_log_probs`) on real gloo groups, for every
family the library trains (I1, I2, I5).

Compared: each rank's `[D]` per-document sums of log p(target) against the stock model with `eager`
attention run on each document alone (log_softmax of its logits, gathered at the next tokens whose
label is not -100, summed in float64), and with every other rank's sums (identical: one all-reduce);
the counts; each rank's per-token log-probs at its shard's positions; the per-document sums of the
statistics (entropy, mean logit, top-1 hits, log sum p^2); and the mean over ranks of each rank's
parameter gradients of `loss = sum(w * sums)` (random `w`, the same loss on every rank) against the
gradient of the same loss over the per-document reference: the backward all-reduce hands each rank
the group's summed upstream gradient, so DDP-style averaging gives the true gradient.

Families: the attention ones of `helpers.model_zoo.tiny_config` (with Llama from `helpers.reference`,
Qwen2-VL with 3-D positions and with images) and every hybrid of `helpers.model_zoo` (gated
delta-rule, KDA, short convolution, Mamba2, Mamba1, lightning attention), all in one pool case per
world size (G = 2 contiguous, G = 3 balanced, G = 4 contiguous). The pack holds a 1-token document,
a document over every rank at G <= 3 (three ranks at G = 4), documents across shard boundaries,
prompt tokens whose labels are -100, and a padding token. The reference runs once per family in the
test process and serves every world size.
"""

from __future__ import annotations

import functools

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.logprobs import STATS, document_log_probs
from hf_blockdiag_cp.planning import PAIR_COUNT, document_ids_from_lengths
from helpers.model_packs import family_pack
from helpers.model_zoo import (
    CONV_FAMILIES,
    HYBRID_FAMILIES,
    KDA_FAMILIES,
    LIGHTNING_FAMILIES,
    MAMBA1_FAMILIES,
    MAMBA2_FAMILIES,
    build_hybrid_pair,
    build_pair,
)
from helpers.reference import build_models, layout_lengths, make_docs, make_pack, mean_over_group, rel_err

TOL = 1e-4
ATTENTION_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gpt_oss", "deepseek_v3", "granite", "olmo2",
                      "phi3", "qwen2_vl", "qwen2_vl_image")
MIXER_FAMILIES = HYBRID_FAMILIES + KDA_FAMILIES + CONV_FAMILIES + MAMBA2_FAMILIES + MAMBA1_FAMILIES + LIGHTNING_FAMILIES
FAMILIES = ATTENTION_FAMILIES + MIXER_FAMILIES
LAYOUTS = {2: "contiguous", 3: "balanced", 4: "contiguous"}

# Document lengths (one pack for every world size): a 1-token document, 25 tokens over every rank at
# G = 2 and 3 (over three at G = 4), then one padding token. Phi-3: every document longer than
# LongRoPE's original context (8), so that each one alone takes the long factors as the pack does.
LENGTHS = [1, 5, 25, 3, 7]
PHI3_LENGTHS = [9, 25, 11]
PROMPTS = {2: 4, 4: 2}  # document index -> leading tokens labelled -100
N_PAD = 1


def build(family: str):
    """(stock eager model, blockdiag_cp model) with identical weights (seeded: the same in every process)."""
    if family == "llama":
        return build_models("llama")
    if family in MIXER_FAMILIES:
        return build_hybrid_pair(family)
    return build_pair(family)


def family_documents(family: str, ref, pack: str = "mixed"):
    """(documents, their labels, per-document extra inputs of the reference, packed batch, shard_primary) of
    the pack above ("mixed"), or of `helpers.reference.make_pack`'s "padding_rank" at G = 3, whose last
    rank holds only padding ("padding_rank")."""
    if pack == "padding_rank":
        docs, batch = make_pack("padding_rank", 3)
        return docs, docs, None, batch, True
    if family.startswith("qwen2_vl"):  # 3-D positions (and images) of the model-coverage tests' pack (any G)
        docs, batch, extra, shard_primary = family_pack(family, 2, model=ref)
        prompts = {1: 3}
    else:
        docs = make_docs(PHI3_LENGTHS if family == "phi3" else LENGTHS, seed=3)
        prompts, extra, shard_primary = PROMPTS if family != "phi3" else {1: 3}, None, True
        lengths = [d.numel() for d in docs]
        ids = torch.cat(docs + [torch.zeros(N_PAD, dtype=torch.long)])[None]
        batch = {"input_ids": ids, "document_ids": document_ids_from_lengths(lengths, ids.shape[1])[None]}
    labels = [d.clone() for d in docs]
    for i, n in prompts.items():
        labels[i][:n] = -100
    pad = batch["input_ids"].shape[1] - sum(d.numel() for d in docs)
    batch = dict(batch, labels=torch.cat(labels + [torch.full((pad,), -100)])[None])
    return docs, labels, extra, batch, shard_primary


def loss_weights(num_documents: int) -> torch.Tensor:
    return torch.randn(num_documents, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def all_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (zeros where none reached it, e.g. an expert no token chose)."""
    return {name: (torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
            for name, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def reference(family: str, pack: str = "mixed") -> dict:
    """The stock model on each document alone: per-document float64 sums of log p(next token) where
    the next label is not -100, their counts, the pack's per-token log-probs (0 where no target), the
    statistics' per-document sums, and the parameter gradients of `sum(w * sums)`."""
    ref, _ = build(family)
    docs, labels, extra, _, _ = family_documents(family, ref, pack)
    sums, counts, tokens, stat_sums = [], [], [], []
    for i, (d, lab) in enumerate(zip(docs, labels)):
        logits = ref(input_ids=d[None], **(extra[i] if extra else {})).logits[0].double()[:-1]
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(1, d[1:, None]).squeeze(1)
        keep = (lab[1:] != -100).double()
        p = logp_all.exp().detach()
        values = {
            "entropy": -(p * logp_all.detach()).sum(-1),
            "mean_logits": logits.detach().mean(-1),
            "is_top1": (logits.argmax(-1) == d[1:]).double(),
            "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        }
        sums.append((logp * keep).sum())
        counts.append(int(keep.sum()))
        tokens.append(torch.cat([(logp * keep).detach(), logits.new_zeros(1)]))
        stat_sums.append([float((values[name] * keep).sum()) for name in STATS])
    sums = torch.stack(sums)
    ref.zero_grad(set_to_none=True)
    (loss_weights(len(docs)) * sums).sum().backward()
    return {
        "sums": sums.detach(), "counts": counts, "tokens": torch.cat(tokens),
        "stat_sums": dict(zip(STATS, torch.tensor(stat_sums, dtype=torch.float64).T)), "grads": all_grads(ref),
    }


def log_probs_case(rank, world_size, group, families, pack="mixed", layout=None):
    """Per family, this rank's document_log_probs of the pack (sums, counts, statistics' sums, per-token
    log-probs with the pack positions of its shard) and, on rank 0, the mean over ranks of every
    parameter's gradient of `sum(w * sums)` (one all-reduce of all of them)."""
    config = bdcp.CPConfig(attn_backend="auto", kv_exchange="allgather", layout=layout or LAYOUTS[world_size],
                           kernel_cost=PAIR_COUNT)
    out = {}
    for family in families:
        ref, model = build(family)
        _, _, _, batch, shard_primary = family_documents(family, ref, pack)
        train_ctx, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(
            group, None, batch, shard_primary=shard_primary, config=config, model=model
        )
        with train_ctx():
            result = document_log_probs(model, local, stats=STATS)
            (loss_weights(result.num_documents) * result.sums).sum().backward()
        grads = all_grads(model)
        flat = mean_over_group(torch.cat([g.reshape(-1) for g in grads.values()]), group, world_size)
        mean_grads = dict(zip(grads, flat.split([g.numel() for g in grads.values()])))
        out[family] = {
            "sums": result.sums.detach(), "counts": result.counts.tolist(),
            "stat_sums": {name: v.clone() for name, v in result.stat_sums.items()},
            "tokens": result.token_log_probs[0].detach(), "positions": layout.slot_positions[rank].clone(),
            "moved": not torch.equal(layout.slot_positions.reshape(-1), torch.arange(layout.padded_seq_len)),
            "grads": {n: g.reshape(grads[n].shape) for n, g in mean_grads.items()} if rank == 0 else None,
        }
    return out


def _check_family(family: str, world_size: int, results: list[dict], pack: str = "mixed") -> None:
    want = reference(family, pack)
    ranks = [res[family] for res in results]
    what = f"{family} G={world_size} {pack}"
    for rank, got in enumerate(ranks):
        assert torch.equal(got["sums"], ranks[0]["sums"]), f"{what}: rank {rank}'s sums differ from rank 0's"
        assert got["counts"] == want["counts"], f"{what} rank {rank}: counts {got['counts']} != {want['counts']}"
        # per token: this rank's shard positions of the reference (0 on padding)
        padded = want["tokens"].new_zeros(got["positions"].numel() * world_size)
        padded[: want["tokens"].numel()] = want["tokens"]
        assert rel_err(got["tokens"], padded[got["positions"]]) <= TOL, f"{what} rank {rank}: per-token log-probs"
        for name in STATS:
            err = rel_err(got["stat_sums"][name], want["stat_sums"][name])
            assert err <= TOL, f"{what} rank {rank}: {name} sums off by {err:.2e}"
    no_target = [i for i, n in enumerate(want["counts"]) if n == 0]  # the 1-token document: exactly 0
    assert all(ranks[0]["sums"][i].item() == 0.0 for i in no_target), f"{what}: {ranks[0]['sums']}"
    err = rel_err(ranks[0]["sums"], want["sums"])
    assert err <= TOL, f"{what}: sums off the per-document reference by {err:.2e}"
    grads = ranks[0]["grads"]
    assert set(grads) == set(want["grads"]), what
    errors = {n: rel_err(grads[n], g) for n, g in want["grads"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{what}: mean gradient of {worst} off by {errors[worst]:.2e}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_document_log_probs_match_each_document_alone(gloo, world_size):
    results = gloo(world_size).run(log_probs_case, timeout=600, families=FAMILIES)
    if LAYOUTS[world_size] == "balanced":  # the balanced layout really moved positions (else it tested nothing new)
        assert all(res[f]["moved"] for res in results for f in FAMILIES)
    failures = []
    for family in FAMILIES:
        try:
            _check_family(family, world_size, results)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


PADDING_RANK_FAMILIES = ("llama", "gpt_oss", "qwen3_5", "lfm2", "nemotron_h", "mamba", "minimax")


def test_a_rank_without_targets_joins_the_sums_and_the_backward(gloo):
    """G = 3, the last rank's shard all padding: it scores nothing, yet receives the sums, takes part
    in the backward, and the mean gradient is still the reference's."""
    results = gloo(3).run(log_probs_case, timeout=300, families=PADDING_RANK_FAMILIES, pack="padding_rank",
                          layout="contiguous")
    real_tokens = sum(layout_lengths("padding_rank", 3)[0])
    assert all(int(results[-1][f]["positions"].min()) >= real_tokens for f in PADDING_RANK_FAMILIES)
    for family in PADDING_RANK_FAMILIES:
        _check_family(family, 3, results, "padding_rank")
