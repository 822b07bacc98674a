"""Where the reward trainer reads a sequence's reward: the token at which the model's own
sequence-classification forward pools it (its last token that is not `config.pad_token_id`), on the
edge cases of Transformers' rule: a pad token equal to EOS, pad tokens inside a sequence, a sequence of
pad tokens only, `pad_token_id=None`. The reference is the stock classifier's own forward on each
sequence alone and in a right-padded batch (as TRL's collator pads); ours is a cp = 1 pack of the same
sequences through `PairPackCollator` and `sequence_rewards`."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from helpers.preference import reward_classifier  # noqa: E402
from helpers.sft import EOS_ID  # noqa: E402
from hf_blockdiag_cp.data.pairs import PAIRS_KEY, PairPackCollator, WholePairs, pooled_position  # noqa: E402
from hf_blockdiag_cp.integrations.trl.reward import classifier_pad_token_id, sequence_rewards  # noqa: E402
from hf_blockdiag_cp.step import make_cp_blockdiag_batch_and_ctx  # noqa: E402

PAD = 0  # a distinct pad token of the tests' tokenizer
E = EOS_ID
SEQUENCES = (  # two pairs: each kind of position the rule can pick
    [5, 6, 7, E],  # ends in EOS
    [5, E, E, E],  # EOS repeated at the end
    [E, 8, 9],  # EOS first
    [E, E],  # EOS only: every token is padding when pad = EOS
    [5, E, 6, E, 7],  # EOS inside
    [9],  # one token
)


def _stock_rewards(model, pad: int | None) -> tuple[list[float], list[float] | None]:
    """The stock forward's reward of each sequence alone, and (with a pad token) in one right-padded batch."""
    alone = [float(model(input_ids=torch.tensor([seq])).logits[0, 0]) for seq in SEQUENCES]
    if pad is None:  # Transformers refuses a batch of more than one row without a pad token
        return alone, None
    longest = max(map(len, SEQUENCES))
    ids = torch.tensor([seq + [pad] * (longest - len(seq)) for seq in SEQUENCES])
    mask = torch.tensor([[1] * len(seq) + [0] * (longest - len(seq)) for seq in SEQUENCES])
    return alone, model(input_ids=ids, attention_mask=mask).logits[:, 0].tolist()


def _packed_rewards(model, pad: int | None) -> list[float]:
    """Our rewards: the sequences packed as pairs (cp = 1), read at the collator's `last_token` stream."""
    examples = [{"chosen_ids": SEQUENCES[i], "rejected_ids": SEQUENCES[i + 1]} for i in range(0, len(SEQUENCES), 2)]
    collator = PairPackCollator(WholePairs(), 32, PAD, 1, 0, labels=False, last_token=True,
                                classifier_pad_token_id=classifier_pad_token_id(model))
    batch = collator(list(enumerate(examples)))
    pairs = batch.pop(PAIRS_KEY)
    train_ctx, local, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, padding_token_id=PAD, model=model)
    with train_ctx():
        return sequence_rewards(model, local, pairs.streams["last_token"]).tolist()


@pytest.mark.parametrize("pad", [PAD, EOS_ID, None], ids=["distinct-pad", "pad-is-eos", "no-pad"])
def test_rewards_are_read_where_the_model_pools(pad):
    model = reward_classifier("llama", "blockdiag_cp").eval()
    model.config.pad_token_id = pad
    with torch.no_grad():
        alone, batched = _stock_rewards(model, pad)
        ours = _packed_rewards(model, pad)
    for i, seq in enumerate(SEQUENCES):
        assert abs(ours[i] - alone[i]) <= 1e-5, f"{seq} (pad {pad}): reward {ours[i]} vs the model's own {alone[i]}"
        if batched is not None:
            assert abs(ours[i] - batched[i]) <= 1e-5, f"{seq} (pad {pad}): reward {ours[i]} vs padded batch {batched[i]}"
    # the cases differ: pad = EOS reads [5, 6, 7, E] at 7, and [E, E] at its first token
    assert pooled_position(torch.tensor(SEQUENCES[0]), EOS_ID) == 2 and pooled_position(torch.tensor(SEQUENCES[3]), EOS_ID) == 0


def test_a_config_without_a_usable_pad_token_id_is_named():
    from transformers import PretrainedConfig

    holder = torch.nn.Linear(1, 1)
    holder.config = PretrainedConfig()  # Transformers 5's base config defines no pad_token_id
    with pytest.raises(ValueError, match=r"Linear's config has no pad_token_id; expected an int \(or None\)"):
        classifier_pad_token_id(holder)
    holder.config.pad_token_id = [0, 1]
    with pytest.raises(ValueError, match=r"config.pad_token_id is \[0, 1\]; expected an int \(or None\)"):
        classifier_pad_token_id(holder)
    with pytest.raises(ValueError, match=r"classifier_pad_token_id must be an int or None; got '0'"):
        PairPackCollator(WholePairs(), 32, PAD, 1, 0, last_token=True, classifier_pad_token_id="0")
