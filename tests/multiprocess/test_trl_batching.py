"""`batching="pairs"`: a step of the preference trainers holds the pairs TRL's step holds. On real gloo groups of
world W, TRL's own `DPOTrainer` / `RewardTrainer` train the stock way (eager model, DDP over the W ranks,
`per_device_train_batch_size=P`, `gradient_accumulation_steps=A`), then ours at cp 1 and 2 (dp = W / cp), in the
two configurations that give the same P * A * W pairs a step. Three steps, the same seed, pairs whose sequences are
10 to 201 tokens long, fp32; "equal" means within 1e-5 relative (1e-7 absolute near 0; a DPO reward, beta times a
difference of log-prob sums, relative to the sums), final weights under SGD within 1e-6 of their norm.
- P pairs per micro-batch and A * cp accumulation steps: each micro-batch of ours is one of TRL's, so every step's
  loss (the `sft` term included), the weights and every pair mean TRL logs are equal; at cp > 1 a round of ours
  holds W / cp of TRL's micro-batches, so the round metrics (token means, extreme rewards) are TRL's at cp 1 only.
- P * cp pairs per micro-batch and A accumulation steps: each micro-batch round of ours holds the pairs of one of
  TRL's rounds (DP replica d's micro-batch is TRL processes d * cp .. d * cp + cp - 1's), so every metric TRL logs
  is equal, the round metrics included, and so are the loss and the weights of the loss types that are means over
  pairs (the reward loss, DPO's `sigmoid`); TRL's `sft` term is a token mean per process, averaged by DDP, where
  ours is a token mean over the CP group's micro-batch, so DPO runs this configuration without it.
With a small `max_tokens` a micro-batch spans two packs and DP replicas of a round run filler packs. DPO runs
TRL's `loss_type=["sigmoid", "sft"]` in the first configuration (the `sft` term a mean over a micro-batch's chosen
tokens, whichever packs hold them) and `"sigmoid"` in the second.
The order itself is checked against accelerate's dataloader in tests/unit/test_pair_batches.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows, reference_model, reward_classifier,
    reward_config,
)
from helpers.trainer import accelerate_env, quiet  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS = 3
MAX_LENGTH = 256  # no sequence is truncated (the longest has 201 tokens)
SMALL_PACK = 240  # the longest pair (226 tokens) fits; two pairs of a micro-batch often do not
MID_PACK = 304  # micro-batches of four pairs: in one pack or in two
# Every number TRL logs. Means over the pairs of a micro-batch round are equal in both configurations (with P pairs
# per micro-batch, TRL's round of W processes is cp rounds of ours, each of P * dp pairs); token means over a round
# and a round's extreme rewards are TRL's where every round of ours is one of TRL's (P * cp pairs per micro-batch)
METRICS = {"dpo": ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                   "logps/rejected", "num_tokens", "grad_norm"),
           "reward": ("accuracy", "margin", "mean_reward", "num_tokens", "grad_norm")}
ROUND_METRICS = {"dpo": ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy"),
                 "reward": ("min_reward", "max_reward")}
LEARNING_RATES = {"sgd": 0.5, "adamw_torch": 1e-3}
STEP_TOL, ABS_TOL, WEIGHT_TOL = 1e-5, 1e-7, 1e-6
# A DPO reward is beta times the difference of a policy and a reference log-prob sum, each carrying fp32 rounding
# relative to its own size (|logps| ~ 100 here): a mean reward that nearly cancels is compared within STEP_TOL of
# beta * |logps| of the sums it is a difference of, as a log-prob sum itself is compared
REWARD_OPERANDS = {"rewards/chosen": ("logps/chosen",), "rewards/rejected": ("logps/rejected",),
                   "rewards/margins": ("logps/chosen", "logps/rejected")}


def _rows(world_size: int) -> list[dict]:
    """20 pairs at W = 2 (five rounds of two micro-batches: the third step holds one round, a short step) and 24
    at W = 4; the first pair's chosen sequence is 201 tokens, the shortest sequence 10."""
    return preference_rows(count=20 if world_size == 2 else 24, seed=5, long_chars=180)


def _run(kind: str, ours: bool, out: str, rows: list[dict], optim: str, pairs: int, accumulation: int,
         options: dict, **kwargs) -> dict:
    """One training run of 3 steps (`options`: more config settings): each step's log, the final weights, and
    (ours) the micro-batches' packs."""
    from trl import DPOTrainer, RewardTrainer

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer, BlockdiagCPRewardTrainer

    config = dpo_config if kind == "dpo" else reward_config
    args = config(out, pairs, gradient_accumulation_steps=accumulation, max_steps=STEPS, max_length=MAX_LENGTH,
                  optim=optim, learning_rate=LEARNING_RATES[optim], **options)
    attn = "blockdiag_cp" if ours else "eager"
    common = dict(args=args, train_dataset=preference_dataset(rows), processing_class=char_tokenizer(), **kwargs)
    if kind == "dpo":
        policy = policy_model("llama", attn)
        trainer = (BlockdiagCPDPOTrainer if ours else DPOTrainer)(model=policy, ref_model=reference_model(policy), **common)
    else:
        trainer = (BlockdiagCPRewardTrainer if ours else RewardTrainer)(model=reward_classifier("llama", attn), **common)
    quiet(trainer).train()
    result = {"logs": [h for h in trainer.state.log_history if "loss" in h], "beta": getattr(args, "beta", 0.0),
              "weights": {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}}
    if ours:
        micro_batches = trainer.get_train_dataloader().batch_sampler.micro_batches()
        result["packs"] = [len({slot.pack for slot in slots}) for slots in micro_batches]
        result["fillers"] = sum(slot.filler for slots in micro_batches for slot in slots)
    return result


def batching_case(rank, world_size, group, plans):
    """`plans`: (kind, optimizer, stock (P, A), ours [(cp, P, A, max_tokens or None)], config options) each; TRL's
    run, then ours (keyed by their (cp, P, A, max_tokens))."""
    rows = _rows(world_size)
    results = []
    for kind, optim, (pairs, accumulation), variants, options in plans:
        with accelerate_env(rank, world_size) as out:
            stock = _run(kind, False, out, rows, optim, pairs, accumulation, options)
        ours = {}
        for cp, p, a, max_tokens in variants:
            with accelerate_env(rank, world_size) as out:
                ours[cp, p, a, max_tokens] = _run(kind, True, out, rows, optim, p, a, options, cp_size=cp,
                                            max_tokens=max_tokens)
        results.append((stock, ours))
    return results


def _close(got: float, want: float, scale: float = 0.0) -> bool:
    """Within STEP_TOL of the larger of |want| and `scale` (the size of the operands `want` is a difference of)."""
    return abs(got - want) <= STEP_TOL * max(abs(want), scale) + ABS_TOL


def _compare(got: dict, want: dict, kind: str, optim: str, what: str, whole_rounds: bool) -> None:
    """`whole_rounds`: every micro-batch round of ours holds one of TRL's (P * cp pairs per micro-batch)."""
    assert len(got["logs"]) == len(want["logs"]) == STEPS, f"{what}: {len(got['logs'])} steps, TRL {len(want['logs'])}"
    names = ("loss",) + METRICS[kind] + (ROUND_METRICS[kind] if whole_rounds else ())
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"]), start=1):
        assert not set(w) - set(g), f"{what} step {step}: TRL logs {sorted(set(w) - set(g))}, ours not"
        for name in names:
            scale = want["beta"] * sum(abs(w[operand]) for operand in REWARD_OPERANDS.get(name, ()))
            assert _close(g[name], w[name], scale), f"{what} step {step}: {name} {g[name]} vs TRL's {w[name]}"
    if optim != "sgd":
        return
    for name, ref in want["weights"].items():
        err = float((got["weights"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err <= WEIGHT_TOL, f"{what}: final {name} off by {err:.2e} of its norm"


SFT = {"loss_type": ["sigmoid", "sft"]}
# world: (kind, optimizer, TRL's (P, A), ours [(cp, P, A, max_tokens)], config options) each. Ours at cp 2 with
# P * 2 pairs and A steps only where the loss is a mean over pairs (no `sft` term: module docstring)
PLANS = {
    2: [("dpo", "adamw_torch", (2, 2), [(1, 2, 2, None), (2, 2, 4, None)], SFT),
        ("dpo", "adamw_torch", (2, 2), [(2, 4, 2, None)], {}),
        ("reward", "adamw_torch", (2, 2), [(1, 2, 2, None), (2, 2, 4, None), (2, 4, 2, None)], {})],
    4: [("dpo", "sgd", (2, 1), [(1, 2, 1, None), (2, 2, 2, None), (2, 2, 2, SMALL_PACK), (1, 2, 1, SMALL_PACK)], SFT),
        ("dpo", "sgd", (2, 1), [(2, 4, 1, None)], {}),
        ("reward", "sgd", (2, 1), [(1, 2, 1, None), (2, 2, 2, None), (1, 2, 1, SMALL_PACK), (2, 4, 1, None),
                                   (2, 4, 1, MID_PACK)], {})],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_pairs_per_step_match_trl(gloo, world_size):
    """W = 2: DPO and a reward model with AdamW; W = 4: both with SGD, each also with micro-batches of two packs
    and filler packs (SMALL_PACK at cp 1 x dp 4 and, for the reward model, MID_PACK at cp 2 x dp 2 with P * 2
    pairs, where every metric is TRL's; for DPO also SMALL_PACK at cp 2 x dp 2 with P pairs)."""
    runs = gloo(world_size).run(batching_case, timeout=600, plans=PLANS[world_size])
    for i, (kind, optim, (pairs, _), variants, options) in enumerate(PLANS[world_size]):
        for variant in variants:
            cp, p, a, max_tokens = variant
            what = f"{kind} {optim} W={world_size} cp={cp} P={p} A={a} max_tokens={max_tokens}"
            if max_tokens is not None:  # over the replicas: micro-batches of two packs, and filler packs
                packs = [run[i][1][variant]["packs"] for run in runs]
                assert max(map(max, packs)) > 1, f"{what}: packs per micro-batch {packs}"
                assert any(run[i][1][variant]["fillers"] for run in runs), f"{what}: no filler pack"
            for rank, run in enumerate(runs):
                stock, ours = run[i]
                _compare(ours[variant], stock, kind, optim, f"{what} rank {rank}", p == pairs * cp)
