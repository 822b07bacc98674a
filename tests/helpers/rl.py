"""Data, injected completions and the stock-TRL reference of the RL tests (GRPO, RLOO).

Generation is taken out of the comparison: both TRL's own trainer and ours get the same completions,
a deterministic function of each prompt and its place in the batch (`InjectedCompletions`), from 1
to `LONGEST` tokens (or the lengths a test names), some cut at `max_completion_length` without EOS
(truncated). The reference is TRL's own `GRPOTrainer` / `RLOOTrainer` run the stock way: the stock
model with a stock attention (`model_kwargs`: eager, or sdpa in test_trl_rl.py), the completions
padded, no CP, at the same world size (each rank its own prompts, as TRL distributes
them). Ours runs the same ranks as CP groups; one optimizer step of plain SGD: the loss, every
parameter gradient (before the optimizer step) and every logged metric must equal the reference's.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from helpers.preference import (  # noqa: F401 (re-exported)
    GradCapture, char_tokenizer, compare_runs, policy_model, preference_dataset, training_logs,
)
from helpers.sft import CHARS, CHAR_IDS, EOS_ID, _sentence
from helpers.trainer import trainer_settings
from transformers import TrainerCallback

LONGEST = 2000  # max_completion_length: the longest completion, cut there without EOS (truncated)
LENGTHS = (1, 7, 60, LONGEST, 3, 200, 15, LONGEST)  # completion tokens by place in the batch (EOS included)
NUM_GENERATIONS = 4


def prompt_rows(count: int = 8, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, rng.randint(2, 6)) + " "} for _ in range(count)]


def completion_ids(prompt: list[int], place: int, lengths: tuple[int, ...] = LENGTHS, longest: int = LONGEST) -> list[int]:
    """The completion of `prompt` at `place` in a rank's batch: one of `lengths` (chosen by the prompt
    and the place), tokens drawn from a seed of both; EOS last, but for `longest` ones (truncated)."""
    length = lengths[(sum(prompt) + place) % len(lengths)]
    rng = random.Random(hash((tuple(prompt), place)) & 0xFFFFFFFF)
    ids = [CHAR_IDS[rng.choice(CHARS)] for _ in range(length)]
    if length < longest:
        ids[-1] = EOS_ID
    return ids


@dataclass(frozen=True)
class LengthSchedule:
    """Completion lengths by generation and rank: `steps[g][r % len(steps[g])]` at the g-th generation
    (the last entry repeats). A rank whose lengths all equal `max_completion_length` gets only truncated
    completions: with `mask_truncated_completions` its micro-batch holds no completion token."""

    steps: tuple[tuple[tuple[int, ...], ...], ...]

    def at(self, generation: int, rank: int) -> tuple[int, ...]:
        step = self.steps[min(generation, len(self.steps) - 1)]
        return step[rank % len(step)]


class InjectedCompletions:
    """Mix in before a TRL RL trainer: its generation returns `completion_ids` (GRPO's `(ids, logprobs)`,
    RLOO's ids) instead of sampling; `lengths` sets the completion lengths by place (a tuple), or by
    generation, rank and place (a `LengthSchedule`)."""

    completion_lengths: "tuple[int, ...] | LengthSchedule" = LENGTHS

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        longest = self.args.max_completion_length
        lengths = self.completion_lengths
        if isinstance(lengths, LengthSchedule):
            generation = getattr(self, "_injected_generations", 0)
            self._injected_generations = generation + 1
            lengths = lengths.at(generation, self.accelerator.process_index)
        ids = [completion_ids(list(p), place, lengths, longest) for place, p in enumerate(prompt_ids)]
        return (ids, None) if self._returns_logprobs else ids


def count_a(completions, **kwargs) -> list[float]:
    """A toy reward from the text: the share of the letter a."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def count_vowels(completions, **kwargs) -> list[float]:
    """A second toy reward, also in [0, 1] (RLOO does not scale its advantages: large rewards would make
    its steps, and so the second step's comparison, chaotic)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


class LastGrads(TrainerCallback):
    """Every parameter's gradient right before the last optimizer step, by parameter name, and at every
    step the names of the parameters that have a gradient (`with_grad`)."""

    def __init__(self):
        self.grads: dict = {}
        self.with_grad: list[list[str]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        inner = getattr(model, "module", model)
        self.grads = {n: p.grad.detach().cpu().clone() for n, p in inner.named_parameters() if p.grad is not None}
        self.with_grad.append(sorted(self.grads))


RELATIVE = ("loss", "grad_norm")  # compared relative (LOSS_TOL); every other logged value absolute (METRIC_TOL)
NOT_COMPARED = ("step_time", "epoch", "step", "learning_rate")


def compare_rl_runs(got: dict, want: dict, what: str) -> None:
    """Every training log (each step's loss, grad norm and TRL's metrics) and the last step's gradients."""
    from helpers.preference import LOSS_TOL, METRIC_TOL

    steps = want["steps"]
    assert len(got["logs"]) == len(want["logs"]) == steps, f"{what}: {len(got['logs'])} and {len(want['logs'])} logs, not {steps}"
    for step, (glog, wlog) in enumerate(zip(got["logs"], want["logs"])):
        assert set(glog) == set(wlog), f"{what}: logged {sorted(set(glog) ^ set(wlog))} in one run only"
        for name, value in wlog.items():
            if name in NOT_COMPARED:
                continue
            if value is None or math.isnan(value):  # TRL logs None (nan) where no completion token was left
                mine = glog[name]
                assert mine is None or math.isnan(mine), f"{what} step {step + 1}: {name} {mine} vs {value}"
                continue
            # The policy loss is a mean of advantage-weighted ratios, 0 on-policy up to rounding: relative
            # to its terms' scale (the rewards' spread), not to its own value
            scale = max(abs(value), wlog.get("reward_std", 0.0)) if name == "loss" else abs(value)
            bound = LOSS_TOL * scale if name in RELATIVE else METRIC_TOL * max(1.0, abs(value))
            assert abs(glog[name] - value) <= bound, f"{what} step {step + 1}: {name} {glog[name]} vs {value}"
    assert got.get("with_grad") == want.get("with_grad"), f"{what}: the parameters with a gradient differ at some step"
    assert set(got["grads"]) == set(want["grads"]), f"{what}: gradients of {set(got['grads']) ^ set(want['grads'])}"
    for name, ref in want["grads"].items():
        err = float((got["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err <= LOSS_TOL or float(ref.norm()) < 1e-9, f"{what}: gradient of {name} off by {err:.2e} (relative)"


def rl_config(kind: str, output_dir: str, **overrides):
    """SGD, one optimizer step, fp32, the completions injected; `kind` "grpo" or "rloo"."""
    from trl import GRPOConfig, RLOOConfig

    settings = {**trainer_settings(output_dir, 1, 1), "bf16": False, "gradient_checkpointing": False,
                "per_device_train_batch_size": NUM_GENERATIONS, "num_generations": NUM_GENERATIONS,
                "max_completion_length": LONGEST, "disable_dropout": True, "learning_rate": 0.005}
    config = GRPOConfig if kind == "grpo" else RLOOConfig
    return config(**{**settings, **overrides})


def saved_policy(family: str, directory: str) -> str:
    """The family's tiny policy saved under `directory` (TRL builds its reference from a model's path)."""
    policy_model(family, "eager").save_pretrained(directory)
    return directory


def model_kwargs(attn: str) -> dict:
    """GRPOConfig / RLOOConfig model_init_kwargs loading a saved policy with `attn`, in fp32."""
    return {"model_init_kwargs": {"attn_implementation": attn, "dtype": "float32"}}


def perturb(model, scale: float = 0.05, seed: int = 1) -> None:
    """Move `model`'s weights by seeded noise (a reference that differs from the policy)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def rl_trainer(kind: str, model, args, ours: bool, lengths: tuple[int, ...] = LENGTHS, **kwargs):
    """TRL's trainer (ours=False) or ours, with the completions injected and two reward functions; `pad_token`
    (a kwarg) is the character tokenizer's (None: none, so TRL pads with EOS)."""
    from trl import GRPOTrainer, RLOOTrainer

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPGRPOTrainer, BlockdiagCPRLOOTrainer

    base = {("grpo", False): GRPOTrainer, ("rloo", False): RLOOTrainer, ("grpo", True): BlockdiagCPGRPOTrainer,
            ("rloo", True): BlockdiagCPRLOOTrainer}[kind, ours]
    cls = type(f"Injected{base.__name__}", (InjectedCompletions, base),
               {"_returns_logprobs": kind == "grpo", "completion_lengths": lengths})
    trainer = cls(model=model, reward_funcs=[count_a, count_vowels], args=args,
                  train_dataset=preference_dataset(kwargs.pop("rows", prompt_rows())),
                  processing_class=char_tokenizer(kwargs.pop("pad_token", "<pad>")), **kwargs)
    if trainer.ref_model is not None:
        perturb(trainer.ref_model)
    return trainer
