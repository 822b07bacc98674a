"""`precompute_ref_log_probs=True` without a reference model, over several packs a step. The initial policy is its
own reference, so step 1 is a tie on every pair: TRL logs rewards of exactly 0 and `rewards/accuracies` 0. On real
gloo groups of world W, TRL's own `DPOTrainer` precomputes and trains the stock way (eager model, DDP over the W
ranks, `per_device_train_batch_size=P`, `gradient_accumulation_steps=A`), then ours at cp 1 and 2 (dp = W / cp) with
P pairs per micro-batch and A * cp accumulation steps, each micro-batch in one pack or (small `max_tokens`) two, with
filler packs. A packed sum changes with its pack and place at rounding level, so the stored sums must come from the
packs the pairs train in: step 1's rewards, margins and accuracy are exactly 0, as TRL's, and every number logged
over 3 steps (the third in the second, reshuffled epoch) is TRL's within test_trl_batching.py's tolerances. With
`batching="tokens"` a step holds other pairs than TRL's: step 1's ties are checked.

TRL's stock precompute writes the reference columns to a cache file beside the dataset's own, on the main process,
and every rank then reads that file. A dataset held in memory has no cache file: each process names a random file in
its own temporary directory, and the other ranks fail to find rank 0's (which then waits for them in its first
collective). A user's `load_dataset` gives a dataset on disk; the runs here load the pairs with `load_from_disk`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows,
)
from helpers.trainer import accelerate_env, quiet  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS = 3
MAX_LENGTH = 256  # no sequence is truncated (the longest has 186 tokens)
SMALL_PACK = 240  # the longest pair (201 tokens) fits; two pairs of a micro-batch sometimes do not
TIES = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
# every number TRL logs; the token means over a micro-batch round only where our rounds are TRL's (cp 1)
METRICS = TIES + ("logps/chosen", "logps/rejected", "num_tokens", "grad_norm")
ROUND_METRICS = ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
STEP_TOL, ABS_TOL = 1e-5, 1e-7  # test_trl_batching.py's


def _run(ours: bool, out: str, path: str, pairs: int, accumulation: int, **kwargs) -> dict:
    """3 steps of SGD from the pairs on disk at `path`, the reference precomputed: each step's log, and (ours) the
    packs of each micro-batch and the filler packs."""
    from datasets import load_from_disk
    from trl import DPOTrainer

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    args = dpo_config(out, pairs, gradient_accumulation_steps=accumulation, max_steps=STEPS, max_length=MAX_LENGTH,
                      learning_rate=0.5, precompute_ref_log_probs=True)
    trainer = (BlockdiagCPDPOTrainer if ours else DPOTrainer)(
        model=policy_model("llama", "blockdiag_cp" if ours else "eager"), args=args, train_dataset=load_from_disk(path),
        processing_class=char_tokenizer(), **kwargs)
    quiet(trainer).train()
    result = {"logs": [h for h in trainer.state.log_history if "loss" in h]}
    if ours and kwargs["batching"] == "pairs":
        micro_batches = trainer.get_train_dataloader().batch_sampler.micro_batches()
        result["packs"] = [len({slot.pack for slot in slots}) for slots in micro_batches]
        result["fillers"] = sum(slot.filler for slots in micro_batches for slot in slots)
    return result


def precompute_case(rank, world_size, group, path, stock, variants):
    """TRL's run with (P, A) = `stock`, then ours for each (cp, P, A, max_tokens or None, batching) of `variants`."""
    with accelerate_env(rank, world_size) as out:
        want = _run(False, out, path, *stock)
    got = {}
    for cp, pairs, accumulation, max_tokens, batching in variants:
        with accelerate_env(rank, world_size) as out:
            got[cp, max_tokens, batching] = _run(True, out, path, pairs, accumulation, cp_size=cp,
                                                 max_tokens=max_tokens, batching=batching)
    return want, got


def _differences(got: dict, want: dict, what: str, cp: int, batching: str) -> list[str]:
    """Where our run's logs are not TRL's: step 1's rewards not exactly TRL's 0, a number off its tolerance (with
    batching="tokens" a step holds other pairs than TRL's: step 1's ties only)."""
    if len(got["logs"]) != STEPS or len(want["logs"]) != STEPS:
        return [f"{what}: {len(got['logs'])} steps, TRL {len(want['logs'])}"]
    found = [f"{what}: step-1 {name} (ours, TRL's) {got['logs'][0][name]}, {want['logs'][0][name]}"
             for name in TIES if (got["logs"][0][name], want["logs"][0][name]) != (0.0, 0.0)]
    if batching == "tokens":
        return found
    names = ("loss",) + METRICS + (ROUND_METRICS if cp == 1 else ())
    for step, (g, w) in enumerate(zip(got["logs"], want["logs"]), start=1):
        found += [f"{what} step {step}: {name} {g[name]} vs TRL's {w[name]}" for name in names
                  if not abs(g[name] - w[name]) <= STEP_TOL * abs(w[name]) + ABS_TOL]
    return found


ROWS = {2: 20, 4: 24}  # TRL's last round full: it fills one with repeated pairs, ours at dp < W would not
# W: TRL's (P, A), ours [(cp, P, A, max_tokens, batching)]
PLANS = {2: ((2, 4), [(1, 2, 4, None, "pairs"), (1, 2, 4, SMALL_PACK, "pairs"), (2, 2, 8, None, "pairs"),
                      (2, 2, 8, SMALL_PACK, "pairs"), (2, 1, 4, None, "tokens")]),
         4: ((2, 2), [(1, 2, 2, None, "pairs"), (2, 2, 4, None, "pairs")])}


@pytest.mark.parametrize("world_size", sorted(PLANS))
def test_precomputed_reference_ties_at_step_one(gloo, tmp_path, world_size):
    """Pairs whose sequences hold 8 to 186 tokens. W = 2: ours at cp 1 (one pack a micro-batch, A packs a step per
    rank; or micro-batches of two packs and filler packs), at cp 2 (one pack or two a micro-batch) and at cp 2 with
    batching="tokens"; W = 4: at cp 1 and at cp 2 x dp 2. Steps of 16, then 4 (W = 2) or 8 pairs, then 16."""
    path = str(tmp_path / "pairs")
    preference_dataset(preference_rows(count=ROWS[world_size], seed=2, long_chars=180)).save_to_disk(path)
    stock, variants = PLANS[world_size]
    runs = gloo(world_size).run(precompute_case, timeout=300, path=path, stock=stock, variants=variants)
    problems = []
    for cp, _, _, max_tokens, batching in variants:
        what, key = f"W={world_size} cp={cp} max_tokens={max_tokens} batching={batching}", (cp, max_tokens, batching)
        if max_tokens is not None:
            assert max(max(got[key]["packs"]) for _, got in runs) > 1, f"{what}: one pack per micro-batch"
            if cp < world_size:  # DP replicas even their rounds
                assert any(got[key]["fillers"] for _, got in runs), f"{what}: no filler pack"
        for rank, (want, got) in enumerate(runs):
            problems += _differences(got[key], want, f"{what} rank {rank}", cp, batching)
    assert not problems, "\n".join(problems)
