"""`BlockdiagCPRewardTrainer`: TRL's `RewardTrainer` on packed pairs under exact block-diagonal CP.

A sequence classifier (`AutoModelForSequenceClassification`, `num_labels=1`) scores every token of its
shard. The reward of a sequence is the score where the model's own sequence-classification forward reads
it (what `pipeline("text-classification")` and every later user of the model read): its last token that is
not the model's `config.pad_token_id` (`data.pairs.pooled_position`). TRL sets that id to the tokenizer's
pad token, which is EOS for tokenizers without one (Llama-3 style), so the reward is then read on the
token before the appended EOS. That token may sit on any rank of the CP group: each rank keeps the scores
of the pooled tokens it holds (`PairBatch.streams["last_token"]`) and one differentiable all-reduce gives
every rank every sequence's reward (`logprobs.per_document_sum`). The model's own pooling over the packed
shard is not used. TRL's pairwise loss (with its `margin` column and `center_rewards_coefficient`) and its
metrics follow, per pair.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from trl import RewardConfig, RewardTrainer

from ...compat.trl import overrides
from ...data.pairs import WholePairs
from ...logprobs import per_document_sum
from ...logprobs.fsdp import as_unit_output, fsdp_unit
from ...step import STEP_KWARG
from ...step.model_support import configured_model
from .preference import PairMetrics, PreferenceCPMixin, check_batching, row_mean
from .setup import pack_size, pad_token_of, require_pair_columns, warn_if_unverified_trl

REWARD_SUMS = ("pairs", "rewards", "accuracy", "margin")
REWARD_EXTREMES = ("neg_min_reward", "max_reward")


def score_module(model) -> torch.nn.Module:
    """The head that maps hidden states to per-token scores (`score` of Transformers' sequence classifiers)."""
    inner = configured_model(model)
    head = getattr(inner, "score", None)
    if not isinstance(head, torch.nn.Module):
        raise ValueError(
            f"{type(inner).__name__} has no `score` head; expected a Transformers sequence classifier "
            "(AutoModelForSequenceClassification with num_labels=1), whose `score` maps every token to a reward"
        )
    return head


def classifier_pad_token_id(model) -> int | None:
    """The pad token id under which the model's sequence-classification forward pools each sequence (its
    `config.get_text_config().pad_token_id`; TRL's RewardTrainer sets it from the tokenizer). None: the last
    token. Raises ValueError where the config holds no usable id."""
    inner = configured_model(model)
    config = getattr(inner, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = type(inner).__name__
    if text is None or not hasattr(text, "pad_token_id"):
        raise ValueError(
            f"{name}'s config has no pad_token_id; expected an int (or None): a sequence classifier reads each "
            "sequence's score at its last token that is not config.pad_token_id, and the reward is read there"
        )
    pad = text.pad_token_id
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)):
        raise ValueError(
            f"{name}'s config.pad_token_id is {pad!r}; expected an int (or None): a sequence classifier reads each "
            "sequence's score at its last token that is not that id"
        )
    return pad


@contextlib.contextmanager
def captured_scores(model):
    """Yields a dict that holds, after the forward, the score head's output `[1, L, num_labels]`."""
    box: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        box.setdefault("scores", output)

    handle = score_module(model).register_forward_hook(keep)
    try:
        yield box
    finally:
        handle.remove()


def sequence_rewards(model, local: dict, last_token: torch.Tensor) -> torch.Tensor:
    """[D] the reward of every sequence of the pack (the score at its pooled token), the same on every rank
    of the CP group, differentiable; `last_token` [1, L] marks the shard's pooled tokens."""
    step = local.get(STEP_KWARG)
    with captured_scores(model) as box:
        model(**local)
    scores = box.get("scores")
    if scores is None or scores.shape[:2] != last_token.shape or scores.shape[-1] != 1:
        raise ValueError(
            f"the score head gave {None if scores is None else tuple(scores.shape)}; expected [1, L, 1] per token of the "
            "shard (a reward model has num_labels=1)"
        )
    scores = as_unit_output(fsdp_unit(model, score_module(model)), lambda: scores)  # FSDP2's backward hooks
    count = int(step.layout.document_ids.max()) if step is not None else int(local["document_ids"].max())
    values = scores[0, :, 0] * last_token[0].to(scores.dtype)
    return per_document_sum(values, local["document_ids"], count, None if step is None else step.group)


class BlockdiagCPRewardTrainer(PreferenceCPMixin, RewardTrainer):
    """`trl.RewardTrainer` whose packed pairs train and evaluate sharded over a CP group.

    Arguments: those of `RewardTrainer` (as keywords; no `data_collator`), plus `cp_size`, `batching`
    ("pairs", the default: `RewardConfig.per_device_train_batch_size` pairs per micro-batch of each CP group,
    as TRL batches them; "tokens": one pack of as many pairs as fit per micro-batch, with
    per_device_train_batch_size=1), `max_tokens` (the pack size; default 2 * RewardConfig.max_length, times
    per_device_train_batch_size with batching="pairs", rounded up to a multiple of 2*cp_size), `cp_config`
    and `cp_mesh`, as for `BlockdiagCPDPOTrainer`.
    """

    def __init__(self, model, args: RewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, *, cp_size: int = 1, batching: str = "pairs",
                 max_tokens: int | None = None, cp_config=None, cp_mesh=None, **kwargs):
        warn_if_unverified_trl()
        if not isinstance(args, RewardConfig):
            raise ValueError(f"args must be a trl.RewardConfig; got {type(args).__name__}")
        self.batching = check_batching(batching)
        self.pair_metrics = PairMetrics(REWARD_SUMS, REWARD_EXTREMES)
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, cp_size=cp_size,
            max_tokens=pack_size(max_tokens, args.max_length, cp_size, self._default_pack_pairs(args), "RewardConfig"),
            pad_token_id=pad_token_of(processing_class),
            cp_config=cp_config, cp_mesh=cp_mesh, **kwargs)
        score_module(self.model)
        classifier_pad_token_id(self.model)
        self._check_pairs()

    @overrides("RewardTrainer")
    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        require_pair_columns(dataset, dataset_name, ("chosen_ids", "rejected_ids"))
        prepared = super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        return self._count_prepared(dataset_name, dataset, prepared)

    def _dropped_by(self) -> str:
        return ("it drops a pair whose chosen or rejected sequence is longer than "
                f"RewardConfig.max_length={self.args.max_length}")

    def _pair_reader(self):
        return WholePairs()

    def _pair_collator_options(self) -> dict:
        return dict(labels=False, pair_columns=("margin",), last_token=True,
                    classifier_pad_token_id=classifier_pad_token_id(self.model))

    def _pair_losses(self, model, local: dict, pairs, mode: str, counted: bool) -> torch.Tensor:
        rewards = sequence_rewards(model, local, pairs.streams["last_token"]).view(pairs.pairs, 2)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        margin = pairs.values.get("margin")
        difference = chosen - rejected - (0.0 if margin is None else margin.to(rewards))
        losses = -F.logsigmoid(difference)
        if self.args.center_rewards_coefficient is not None:
            losses = losses + self.args.center_rewards_coefficient * (chosen + rejected) ** 2
        with torch.no_grad():
            sums = {"pairs": rewards.new_tensor(float(pairs.pairs)), "rewards": rewards,
                    "accuracy": (chosen > rejected).float(), "margin": chosen - rejected}
            extremes = {"neg_min_reward": -rewards.min(), "max_reward": rewards.max()}
        self.pair_metrics.add(mode, sums, extremes, counted=counted and self.cp_coordinates.cp_rank == 0)
        return losses

    def _finish_metrics(self, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        """TRL's per-micro-batch values (the round's rewards gathered: their min, mean and max; the mean accuracy
        and margin of its pairs), averaged over the rounds."""
        counted = rows["pairs"] > 0
        one = torch.ones_like(rows["pairs"])
        return {"min_reward": row_mean(-rows["neg_min_reward"], one, counted),
                "mean_reward": row_mean(rows["rewards"], 2 * rows["pairs"], counted),
                "max_reward": row_mean(rows["max_reward"], one, counted),
                "accuracy": row_mean(rows["accuracy"], rows["pairs"], counted),
                "margin": row_mean(rows["margin"], rows["pairs"], counted)}
