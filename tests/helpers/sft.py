"""Data and reference of the TRL SFT tests: a character tokenizer built in-process (no downloads),
pre-tokenized, text and prompt/completion datasets, and the stock model's token-weighted loss on
every document alone (the reference the packed, CP-sharded SFT runs must equal)."""

from __future__ import annotations

import random
import string

import torch
import torch.nn.functional as F

from helpers.reference import VOCAB
from helpers.trainer import tiny_model, trainer_settings

SPECIALS = ("<pad>", "<eos>", "<unk>")  # ids 0, 1, 2
CHARS = string.ascii_lowercase + " .,?!'"
CHAR_IDS = {c: i for i, c in enumerate(CHARS, start=len(SPECIALS))}
EOS_ID = SPECIALS.index("<eos>")
MAX_LENGTH = 256  # SFTConfig.max_length: the pack size
STEPS = 3
ACCUMULATION = 16  # micro-batches per optimizer step: more than the packs of an epoch
WORDS = ("the", "cat", "sat", "on", "a", "mat", "why", "not", "dogs", "run", "far", "and", "fast", "it's", "over")


# Chat template with generation markers: TRL's assistant_only_loss masks everything outside them.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
    "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)


def char_tokenizer(pad_token: str | None = "<pad>"):
    """A character-level fast tokenizer (one token per character of CHARS), pad and eos as TRL needs them;
    `pad_token=None` leaves it without a pad token, as Llama-3-style tokenizers are (TRL's trainers then
    set pad = eos: padding and the appended EOS are the same token)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{t: i for i, t in enumerate(SPECIALS)}, **CHAR_IDS}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=pad_token, eos_token="<eos>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


def encode(text: str) -> list[int]:
    """The token ids of `text` without the tokenizer object: one id per character."""
    return [CHAR_IDS[c] for c in text]


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + rng.choice(".?!")


def token_documents() -> list[list[int]]:
    """Pre-tokenized documents of heavy-tailed lengths (2 to 200 tokens)."""
    g = torch.Generator().manual_seed(5)
    lengths = [2, 7, 200, 31, 64, 5, 120, 18, 90, 3, 150, 44, 11, 77, 9, 25, 160, 60, 13, 38]
    return [torch.randint(len(SPECIALS), VOCAB, (n,), generator=g).tolist() for n in lengths]


def texts() -> list[str]:
    rng = random.Random(7)
    return [_sentence(rng, rng.randint(1, 30)) for _ in range(24)]


def prompt_completions() -> list[tuple[str, str]]:
    rng = random.Random(9)
    return [(_sentence(rng, rng.randint(1, 12)) + " ", _sentence(rng, rng.randint(1, 10))) for _ in range(24)]


def conversations() -> list[list[dict]]:
    rng = random.Random(11)
    chats = []
    for _ in range(16):
        turns = rng.randint(1, 3)
        chats.append([{"role": role, "content": _sentence(rng, rng.randint(1, 8))}
                      for _ in range(turns) for role in ("user", "assistant")])
    return chats


def sft_dataset(kind: str):
    """The `datasets.Dataset` given to the trainer: `tokens` (input_ids), `text` or `prompt_completion`."""
    from datasets import Dataset

    if kind == "tokens":
        return Dataset.from_dict({"input_ids": token_documents()})
    if kind == "text":
        return Dataset.from_dict({"text": texts()})
    if kind == "prompt_completion":
        pairs = prompt_completions()
        return Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    if kind == "conversation":
        return Dataset.from_dict({"messages": conversations()})
    raise ValueError(kind)


def _conversation_tokens(chat: list[dict]) -> tuple[list[int], list[bool]]:
    """CHAT_TEMPLATE rendered by hand: ids and, per token, whether it is an assistant token."""
    ids, assistant = [], []
    for message in chat:
        if message["role"] == "assistant":
            part, mine = encode(message["content"]) + [EOS_ID], True
        else:
            part, mine = encode(message["content"] + " "), False
        ids += part
        assistant += [mine] * len(part)
    return ids, assistant


def reference_documents(kind: str, masked: bool = True) -> list[tuple[list[int], list[int]]]:
    """Per document: its token ids and the positions t whose token is a target (predicted from
    the tokens before it). Unmasked: every t >= 1; `masked`: only completion / assistant tokens.
    Text and completions get the eos TRL appends."""
    docs: list[tuple[list[int], list[bool]]]
    if kind == "tokens":
        docs = [(ids, [True] * len(ids)) for ids in token_documents()]
    elif kind == "text":
        docs = [(encode(t) + [EOS_ID], [True] * (len(t) + 1)) for t in texts()]
    elif kind == "prompt_completion":
        docs = [(encode(p) + encode(c) + [EOS_ID], [False] * len(p) + [True] * (len(c) + 1))
                for p, c in prompt_completions()]
    else:
        docs = [_conversation_tokens(chat) for chat in conversations()]
    return [(ids, [t for t in range(1, len(ids)) if keep[t] or not masked]) for ids, keep in docs]


def stock_loss(kind: str, masked: bool = True) -> tuple[float, int]:
    """(token-weighted mean loss, target count) of the stock eager model (tiny_model's weights) on every document alone."""
    model = tiny_model("eager").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, targets in reference_documents(kind, masked):
            tokens, where = torch.tensor(ids), torch.tensor(targets)
            logits = model(input_ids=tokens[None]).logits[0].double()
            total += float(F.cross_entropy(logits[where - 1], tokens[where], reduction="sum"))
            count += len(targets)
    return total / count, count


def sft_config(output_dir: str, **overrides):
    """The tests' SFTConfig: the Trainer tests' settings (plain SGD, no clipping), packs of MAX_LENGTH,
    fp32 (SFTConfig's default bf16=True would autocast on the CPU), one optimizer step per epoch."""
    from trl import SFTConfig

    settings = {**trainer_settings(output_dir, ACCUMULATION, STEPS), "packing": True, "max_length": MAX_LENGTH,
                "bf16": False}
    return SFTConfig(**{**settings, **overrides})


def stock_document_metrics(kind: str, weights: dict | None = None) -> dict[tuple, tuple[int, int, float, float]]:
    """Per document (keyed by its token ids), the stock eager model (tiny_model's weights, or `weights`)
    on it alone: (targets, targets whose token is the argmax of the logits, entropy of the next-token
    distribution summed over the targets, the smallest gap between the two largest logits of a target)."""
    model = tiny_model("eager").eval()
    if weights is not None:
        model.load_state_dict(weights)
    stats = {}
    with torch.no_grad():
        for ids, targets in reference_documents(kind):
            tokens, where = torch.tensor(ids), torch.tensor(targets, dtype=torch.long)
            logits = model(input_ids=tokens[None]).logits[0].double()[where - 1]
            logp = F.log_softmax(logits, dim=-1)
            top2 = logits.topk(2, dim=-1).values
            gap = float((top2[:, 0] - top2[:, 1]).min()) if len(targets) else float("inf")
            stats[tuple(ids)] = (len(targets), int((logits.argmax(-1) == tokens[where]).sum()),
                                 float(-(logp.exp() * logp).sum()), gap)
    return stats


def stock_token_metrics(rows: list[dict], kind: str, dp_size: int = 1, weights: dict | None = None) -> dict[str, float]:
    """TRL's `mean_token_accuracy` and `entropy` for TRL's packed `rows` (`input_ids`, `seq_lengths`) in
    epoch order, from the stock model on every document alone: per round of `dp_size` rows (row i on
    replica i % dp_size) correct / targets and entropy / targets over the round, then the mean over the
    rounds; `min_gap`: the closest top-2 logits of any target (a tie would make the accuracy ambiguous)."""
    stats = stock_document_metrics(kind, weights)
    accuracy, entropy = [], []
    for start in range(0, len(rows), dp_size):
        targets = correct = ent = 0.0
        for row in rows[start:start + dp_size]:
            for doc in torch.tensor(row["input_ids"]).split(list(row["seq_lengths"])):
                n, c, e, _ = stats[tuple(doc.tolist())]
                targets, correct, ent = targets + n, correct + c, ent + e
        accuracy.append(correct / targets if targets else 0.0)
        entropy.append(ent / targets if targets else 0.0)
    return {"mean_token_accuracy": sum(accuracy) / len(accuracy), "entropy": sum(entropy) / len(entropy),
            "min_gap": min(s[3] for s in stats.values())}
