"""TRL 1.16's DPO losses from per-pair sums: what `DPOTrainer._compute_loss` computes from its padded
batch, here from the per-document log-probs of a pack (`logprobs.document_log_probs`).

Every `loss_type` of TRL 1.16 needs only per-sequence sums and counts, so each has a row here; the
formulas follow TRL's (its f-divergence scores, `loss_weights`, WPO weighting), and
`tests/multiprocess/test_trl_dpo.py` holds them to TRL's own trainer. TRL's `sft` term is a mean over
the chosen targets of its micro-batch: each pack adds its share of the micro-batch's (`PairBatch.micro_batch`),
so the micro-batch's packs together give TRL's term. The `aot` sorts run over the pack, which must then
hold the whole micro-batch (the DPO trainer checks it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
              "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass(frozen=True)
class PairTerms:
    """Per pair ([P]): the policy's and the reference's summed completion log-probs (LD-DPO-weighted
    when `ld_alpha` is set), the completion tokens of each sequence (TRL's `completion_mask` sums),
    the chosen sequences' unweighted log-prob sum over the pack, the pairs and the chosen targets of
    the micro-batch the pack belongs to (the `sft` term), and the WPO weights (None without `use_weighting`)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    sft_log_prob_sum: torch.Tensor
    sft_pairs: int
    sft_targets: int
    weights: torch.Tensor | None = None


def micro_batch_losses(args) -> list[str]:
    """The loss types of `args` that need TRL's whole micro-batch in one pack: the `aot` sorts run over their
    batch, and `sft` with WPO weights is the micro-batch's mean times each pair's weight."""
    return [t for t in args.loss_type if t in ("aot", "aot_unpaired") or (t == "sft" and args.use_weighting)]


def check_loss_types(args) -> None:
    """Raise ValueError, naming the field, for a `DPOConfig` whose loss this trainer cannot compute from sums."""
    unknown = [t for t in args.loss_type if t not in LOSS_TYPES]
    if unknown:
        raise ValueError(
            f"DPOConfig.loss_type holds {unknown}; expected loss types built on per-sequence log-prob sums, those of "
            f"TRL 1.16: {', '.join(LOSS_TYPES)}"
        )
    if args.f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"DPOConfig.f_divergence_type is {args.f_divergence_type!r}; expected one of {F_DIVERGENCES}")


def _scores(args, logratios: torch.Tensor) -> torch.Tensor:
    """TRL's f-divergence score of a log-ratio (`f_divergence_type`)."""
    kind = args.f_divergence_type
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence" and abs(args.f_alpha_divergence_coef - 1.0) >= 1e-6:
        coef = args.f_alpha_divergence_coef - 1.0
        clamp = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}.get(logratios.dtype, 80.0)
        t = torch.clamp((coef * logratios).float(), max=clamp)
        return (torch.exp(t) - 1.0).to(logratios.dtype) / coef
    return logratios


def _sorted_delta(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.sort(a, dim=0)[0] - torch.sort(b, dim=0)[0]


def _one_loss(args, loss_type: str, t: PairTerms, chosen_lr, rejected_lr, chosen_s, rejected_s) -> torch.Tensor:
    beta, smoothing = args.beta, args.label_smoothing
    delta = chosen_s - rejected_s
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):
        normalised = chosen_s / t.chosen_tokens.clamp(min=1.0) - rejected_s / t.rejected_tokens.clamp(min=1.0)
        return (normalised - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * normalised)
    if loss_type == "exo_pair":
        epsilon = torch.tensor(smoothing, device=delta.device)
        qw, ql = torch.sigmoid(beta * delta), torch.sigmoid(-beta * delta)
        return (qw * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
                + ql * (F.logsigmoid(-beta * delta) - torch.log(epsilon)))
    if loss_type == "nca_pair":
        return (-F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr)
                - 0.5 * F.logsigmoid(-beta * rejected_lr))
    if loss_type == "robust":
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        flipped = -smoothing * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1 - 2 * smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
    if loss_type == "sppo_hard":
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            d = _sorted_delta(t.chosen - t.rejected, t.ref_chosen - t.ref_rejected)
        else:
            d = _sorted_delta(chosen_lr, rejected_lr)
        return -F.logsigmoid(beta * d) * (1 - smoothing) - F.logsigmoid(-beta * d) * smoothing
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
    if loss_type == "discopop":
        logits = delta * beta
        modulation = torch.sigmoid(logits / args.discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    if loss_type == "sft":  # the pack's share of TRL's micro-batch mean, as much on each of its pairs
        share = t.sft_pairs / (t.chosen.shape[0] * max(t.sft_targets, 1))
        return (-t.sft_log_prob_sum * share).expand(t.chosen.shape[0])
    raise ValueError(f"DPOConfig.loss_type {loss_type!r} is not one of {LOSS_TYPES}")


def pair_losses(args, terms: PairTerms) -> torch.Tensor:
    """Per pair ([P]): Σ over `args.loss_type` of weight × that loss (× the WPO weights), as TRL sums
    its per-sequence losses (TRL then takes their mean over the batch; the trainer normalises)."""
    chosen_lr = terms.chosen - terms.ref_chosen
    rejected_lr = terms.rejected - terms.ref_rejected
    chosen_s, rejected_s = _scores(args, chosen_lr), _scores(args, rejected_lr)
    weights = args.loss_weights or [1.0] * len(args.loss_type)
    total = torch.zeros_like(terms.chosen)
    for loss_type, weight in zip(args.loss_type, weights, strict=True):
        loss = _one_loss(args, loss_type, terms, chosen_lr, rejected_lr, chosen_s, rejected_s)
        if terms.weights is not None:
            loss = loss * terms.weights
        total = total + loss * weight
    return total
