"""Data, models and the stock-TRL reference of the preference tests (DPO, reward models).

The reference is TRL's own `DPOTrainer` / `RewardTrainer` run the stock way: one process, every
pair in one padded batch, the stock model with `attn_implementation="eager"`, no CP. The
BlockdiagCP trainers run the same pairs packed (one or more packs, any dp x cp), with the same
initial weights, and one optimizer step of plain SGD: their loss, every parameter gradient
(captured before the optimizer step) and every logged metric must equal the reference's.
"""

from __future__ import annotations

import copy
import functools
import random

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback

from helpers.reference import tiny_config as llama_config
from helpers.sft import _sentence, char_tokenizer  # noqa: F401 (re-exported)
from helpers.trainer import trainer_settings

FAMILIES = ("llama", "qwen3", "gemma2", "qwen3_5", "nemotron_h")
LOSS_TOL = 1e-4  # relative, loss and every parameter gradient
METRIC_TOL = 1e-5  # every logged metric: absolute, relative to its magnitude where that is above 1 (fp32 sums)
ROWS = dict(count=6, long_chars=400)  # 803 tokens; the long chosen sequence (411) is the pack's first
PACK = 816  # a multiple of 2*G for G = 1..4 holding every pair of ROWS; at G = 4 the long sequence spans 3 shards of 204



def first_sequence_tokens(rows: list[dict]) -> int:
    """Tokens of the pack's first sequence (the first pair's chosen: prompt, completion, EOS)."""
    from helpers.sft import encode

    return len(encode(rows[0]["prompt"])) + len(encode(rows[0]["chosen"])) + 1


def tiny_config(family: str):
    """The parity tests' tiny configs (helpers.reference / helpers.model_zoo), no KV cache."""
    from helpers import model_zoo

    if family == "llama":
        config = llama_config("llama")
    elif family in ("qwen3_5", "nemotron_h"):
        config = model_zoo.tiny_hybrid_config(family)
    else:
        config = model_zoo.tiny_config(family)
    config.use_cache = False
    return config


def policy_model(family: str, attn: str, seed: int = 0, head: str = "causal_lm"):
    """The family's tiny model (causal LM, or a 1-label sequence classifier) with the seed's weights;
    decays slowed as the hybrid parity tests slow them (a state then lasts many tokens)."""
    from helpers.model_zoo import slow_decays

    torch.manual_seed(seed)
    config = tiny_config(family)
    if head == "causal_lm":
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    else:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation=attn, dtype=torch.float32)
    slow_decays(model)
    return model


def reference_model(policy, scale: float = 0.05, seed: int = 1):
    """A reference that differs from the policy (so the rewards and their gradients are not zero)."""
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return ref


def preference_rows(count: int = 8, seed: int = 3, long_chars: int = 0) -> list[dict]:
    """Text pairs whose lengths differ more than 10x (a one-word completion beside a long one); with
    `long_chars`, the first pair's chosen completion has about that many characters."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        words = (1, 14) if i % 2 else (1, 3)
        rows.append({"prompt": _sentence(rng, rng.randint(1, 5)) + " ", "chosen": _sentence(rng, rng.randint(*words)),
                     "rejected": _sentence(rng, rng.randint(*words))})
    if long_chars:
        long = ""
        while len(long) < long_chars:
            long += _sentence(rng, 8) + " "
        rows[0]["chosen"] = long[:long_chars]
    return rows


def equal_length_rows(count: int = 4, seed: int = 6, prompt_chars: int = 9, completion_chars: int = 23) -> list[dict]:
    """Text pairs whose sequences all have the same length (prompt, completion, EOS): a stock padded batch of
    them holds no padding, so only the model's own pooling rule picks the token it scores."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        prompt, chosen, rejected = (_sentence(rng, 12)[:n] for n in (prompt_chars, completion_chars, completion_chars))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


PAD_TOKENS = {"distinct": "<pad>", "eos": None}  # the tokenizer variants: a pad token of its own, or none (pad = EOS)


def pad_tokenizer(pad: str):
    """The character tokenizer with a distinct pad token (`"distinct"`) or without one (`"eos"`: the trainers pad
    with EOS, so a sequence classifier's last non-pad token is the one before the appended EOS)."""
    return char_tokenizer(PAD_TOKENS[pad])


def preference_dataset(rows: list[dict]):
    """`rows` as a `datasets.Dataset`, its fingerprint given (a hash of the rows): datasets then never
    hashes the table itself, which fails with some wheel sets on the GPU machine (docs/testing.md)."""
    import hashlib
    import json

    from datasets import Dataset
    from datasets.table import InMemoryTable

    fingerprint = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=fingerprint)


def dpo_config(output_dir: str, pairs: int, **overrides):
    """SGD, one optimizer step, fp32, `pairs` pairs per micro-batch: every pair of a test's rows in one batch,
    for TRL's stock trainer and for ours (`batching="pairs"`, in as few packs as its max_tokens allows)."""
    from trl import DPOConfig

    settings = {**trainer_settings(output_dir, 1, 1), "bf16": False, "max_length": 1024, "gradient_checkpointing": False,
                "per_device_train_batch_size": pairs, "per_device_eval_batch_size": pairs, "disable_dropout": True}
    return DPOConfig(**{**settings, **overrides})


def reward_config(output_dir: str, pairs: int, **overrides):
    """As `dpo_config`, for reward models."""
    from trl import RewardConfig

    settings = {**trainer_settings(output_dir, 1, 1), "bf16": False, "max_length": 1024, "gradient_checkpointing": False,
                "per_device_train_batch_size": pairs, "per_device_eval_batch_size": pairs, "disable_dropout": True}
    return RewardConfig(**{**settings, **overrides})


class GradCapture(TrainerCallback):
    """Every parameter's gradient right before the optimizer step (the first one), by parameter name."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            inner = getattr(model, "module", model)
            self.grads = {n: p.grad.detach().cpu().clone() for n, p in inner.named_parameters() if p.grad is not None}


def training_logs(trainer) -> dict:
    """The first training log (the step's loss and TRL's metrics)."""
    return next(h for h in trainer.state.log_history if "loss" in h)


def compare_runs(got: dict, want: dict, what: str, metrics: tuple[str, ...]) -> None:
    """Loss and gradients relative (LOSS_TOL), `metrics` absolute (METRIC_TOL); `got` / `want`: `{"logs", "grads"}`."""
    glog, wlog = got["logs"], want["logs"]
    assert abs(glog["loss"] - wlog["loss"]) <= LOSS_TOL * abs(wlog["loss"]), f"{what}: loss {glog['loss']} vs {wlog['loss']}"
    for name in metrics:
        assert name in glog, f"{what}: {name} not logged (logged: {sorted(glog)})"
        bound = METRIC_TOL * max(1.0, abs(wlog[name]))
        assert abs(glog[name] - wlog[name]) <= bound, f"{what}: {name} {glog[name]} vs {wlog[name]}"
    assert set(got["grads"]) == set(want["grads"]), f"{what}: gradients of {set(got['grads']) ^ set(want['grads'])}"
    for name, ref in want["grads"].items():
        err = float((got["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err <= LOSS_TOL or float(ref.norm()) < 1e-9, f"{what}: gradient of {name} off by {err:.2e} (relative)"


def stock_dpo(family: str, loss_type: tuple = ("sigmoid",)) -> dict:
    """TRL's DPOTrainer, stock: the eager model, every pair of ROWS in one padded batch, one process, one step
    (`{"logs", "grads"}`; cached: the DPO and the FSDP2 tests compare against the same runs)."""
    return _stock_dpo(family, tuple(loss_type))


@functools.cache
def _stock_dpo(family: str, loss_type: tuple) -> dict:
    import tempfile

    from trl import DPOTrainer

    from helpers.trainer import quiet

    rows = preference_rows(**ROWS)
    with tempfile.TemporaryDirectory() as out:
        policy = policy_model(family, "eager")
        args = dpo_config(out, len(rows), loss_type=list(loss_type), per_device_train_batch_size=len(rows))
        capture = GradCapture()
        trainer = quiet(DPOTrainer(model=policy, ref_model=reference_model(policy), args=args,
                                   train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                   callbacks=[capture]))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


def reward_classifier(family: str, attn: str, seed: int = 0):
    """`policy_model(..., head="sequence_classifier")`; NemotronH, which Transformers gives no sequence
    classifier, gets Transformers' generic one on its backbone (what a user would write)."""
    if family != "nemotron_h":
        return policy_model(family, attn, seed, head="sequence_classifier")
    from helpers.model_zoo import slow_decays
    from transformers.modeling_layers import GenericForSequenceClassification
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHPreTrainedModel

    class NemotronHForSequenceClassification(GenericForSequenceClassification, NemotronHPreTrainedModel):
        pass

    torch.manual_seed(seed)
    config = tiny_config(family)
    config.num_labels = 1
    config._attn_implementation = attn
    model = NemotronHForSequenceClassification(config).float()
    slow_decays(model)
    return model
