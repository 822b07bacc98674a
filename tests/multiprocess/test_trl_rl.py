"""`BlockdiagCPGRPOTrainer` / `BlockdiagCPRLOOTrainer` on real gloo groups against TRL's own trainers
run the stock way at the same world size (`helpers.rl`): the same prompts on each rank, the same
injected completions (1 to 1,000 tokens at G = 1 and 2, up to 500 beyond, some truncated), the stock
model with Transformers' `sdpa` attention on padded rows (as fast as eager is slow on the padded
1,000-token rows; it agrees with eager to fp32 rounding, far inside these bounds). Every step's loss and grad norm ≤ 1e-4 relative, every
logged metric ≤ 1e-5, the last step's every parameter gradient ≤ 1e-4 relative. A micro-batch whose
completions are all truncated and masked trains on as in TRL, on every rank or on one.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.rl import (  # noqa: E402
    LastGrads, LengthSchedule, compare_rl_runs, model_kwargs, rl_config, rl_trainer, saved_policy,
)
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, run_beside  # noqa: E402

STOCK_ATTN = "sdpa"  # the stock runs' attention (module docstring)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


# Up to 1,000 tokens at G = 1 and 2: the truncated ones fill both shards of a G = 2 pack (4 per rank).
LONG = {"lengths": (1, 7, 60, 1000, 3, 200, 15, 1000), "max_completion_length": 1000}
SHORT = {"lengths": (1, 7, 60, 200, 3, 15), "max_completion_length": 200}  # completions up to 200 tokens
# Up to 500 tokens: at G >= 3 and dp x cp a truncated completion still spans two or three shards, at a
# quarter of the padded reference's attention cost of 1,000 (G = 1 and 2 run those).
MEDIUM = {"lengths": (1, 7, 60, 500, 3, 200, 15, 500), "max_completion_length": 500}


def _run(kind: str, path: str, ours: bool, rank: int, world_size: int, settings: dict, **kwargs) -> dict:
    settings = dict(settings)
    lengths = settings.pop("lengths", None)
    with accelerate_env(rank, world_size) as out:
        args = rl_config(kind, out, **model_kwargs("blockdiag_cp" if ours else STOCK_ATTN), **settings)
        capture = LastGrads()
        trainer = quiet(rl_trainer(kind, path, args, ours, callbacks=[capture],
                                   **({"lengths": lengths} if lengths else {}), **kwargs))
        trainer.train()
        return {"logs": [h for h in trainer.state.log_history if "loss" in h], "grads": capture.grads,
                "with_grad": capture.with_grad, "steps": args.max_steps}


def rl_case(rank, world_size, group, kind, families, cp_size, variants, ours_only=None, stock=True):
    """For each family and settings: TRL's trainer (stock; not with `stock=False`) and ours with `ours_only`
    added (activation checkpointing: the stock run computes the same without it), on this rank; the
    policy saved once."""
    import tempfile

    import torch.distributed as dist

    results = {}
    for family in families:
        with tempfile.TemporaryDirectory() as directory:
            holder = [saved_policy(family, directory) if rank == 0 else None]
            dist.broadcast_object_list(holder, src=0)  # rank 0's folder: every rank loads the same weights
            for name, settings in variants.items():
                settings = dict(settings)
                size = settings.pop("cp_size", cp_size)  # a variant may run its own CP size
                want = _run(kind, holder[0], False, rank, world_size, settings) if stock else None
                got = _run(kind, holder[0], True, rank, world_size, {**settings, **(ours_only or {})}, cp_size=size)
                results[family, name] = (got, want)
            dist.barrier()
    return results


def stock_runs(kind, families, variants) -> dict:
    """TRL's trainer the stock way at world size 1, in the test's process, for each family and settings."""
    import tempfile

    results = {}
    for family in families:
        with tempfile.TemporaryDirectory() as directory:
            path = saved_policy(family, directory)
            for name, settings in variants.items():
                settings = {k: v for k, v in settings.items() if k != "cp_size"}
                results[family, name] = _run(kind, path, False, 0, 1, settings)
    return results


def run_rl(gloo, world_size: int, timeout: float = 900, **kwargs) -> list[dict]:
    """`rl_case` on a pool of `world_size` ranks; at world size 1 TRL's stock runs take this process meanwhile
    (`run_beside`: the pool's one rank would leave the second core idle)."""
    if world_size > 1:
        return gloo(world_size).run(rl_case, timeout=timeout, **kwargs)
    stock = lambda: stock_runs(kwargs["kind"], kwargs["families"], kwargs["variants"])  # noqa: E731
    runs, want = run_beside(gloo(1), rl_case, stock, timeout=timeout, stock=False, **kwargs)
    return [{key: (got, want[key]) for key, (got, _) in runs[0].items()}]


def _check(runs, what: str) -> None:
    for rank, result in enumerate(runs):
        for (family, name), (ours, stock) in result.items():
            compare_rl_runs(ours, stock, f"{what} {family} {name} rank {rank}")


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_grpo_matches_trl_per_family(gloo, cp_size):
    """llama and qwen3_5 at G = 1..4: the KL term (beta > 0) at odd G, activation checkpointing (ours) at even G,
    two iterations over the same completions (the old policy's log-probs, a clipped ratio) at G = 3;
    completions up to 1,000 tokens at G = 1 and 2, up to 500 at G = 3 and 4."""
    settings = {"beta": 0.04 if cp_size % 2 else 0.0, **(MEDIUM if cp_size >= 3 else LONG)}
    if cp_size == 3:
        settings.update(num_iterations=2, max_steps=2)
    runs = run_rl(gloo, cp_size, kind="grpo", families=("llama", "qwen3_5"), cp_size=cp_size,
                  variants={"grpo": settings}, ours_only=checkpointing_settings(False) if cp_size % 2 == 0 else None)
    _check(runs, f"GRPO G={cp_size}")


def test_every_grpo_loss_type_matches_trl(gloo):
    """Every loss_type of TRL 1.16 at G = 2, with the KL term and two-sided clipping (delta); completions
    up to 200 tokens (the 1,000-token ones run in the per-family tests)."""
    variants = {loss: {"loss_type": loss, "beta": 0.04, "delta": 1.5 if loss == "grpo" else None, **SHORT}
                for loss in GRPO_LOSS_TYPES}
    runs = gloo(2).run(rl_case, timeout=900, kind="grpo", families=("llama",), cp_size=2, variants=variants)
    _check(runs, "GRPO loss types G=2")


def test_grpo_dp_x_cp_matches_trl(gloo):
    """Two CP groups of two ranks (dp 2 x cp 2): each rank its own prompts, as TRL at world size 4."""
    runs = gloo(4).run(rl_case, timeout=900, kind="grpo", families=("qwen3_5",), cp_size=2,
                       variants={"grpo": {"beta": 0.04, "scale_rewards": "batch", **MEDIUM}})
    _check(runs, "GRPO dp2xcp2")


def test_rloo_matches_trl(gloo):
    """RLOO (its KL in the reward) at G = 2 (cp = 1 is the path the GRPO tests take at G = 1): llama over
    two iterations on completions up to 500 tokens; qwen3_5 one step on completions up to 200. RLOO's
    loss is ~0 at each step (its leave-one-out advantages cancel), and for qwen3_5 the second
    iteration's difference of the two fp32 runs (the stock model's and ours, both off float64 by the
    recurrence's rounding) reaches 1e-4 of the loss's scale; the GRPO tests run qwen3_5 at 1,000
    tokens (G = 1, 2) and over two iterations (G = 3)."""
    pool = gloo(2)
    for family, extra in (("llama", {"num_iterations": 2, "max_steps": 2, **MEDIUM}), ("qwen3_5", SHORT)):
        runs = pool.run(rl_case, timeout=900, kind="rloo", families=(family,), cp_size=2,
                        variants={"rloo": {"beta": 0.04, **extra}})
        _check(runs, "RLOO G=2")


TRUNCATED = 24  # max_completion_length of the empty micro-batch tests: a completion this long is truncated
EMPTY, MIXED = (TRUNCATED,), (1, 7, TRUNCATED, 3, 15, 20)  # all truncated (masked: nothing left) / some tokens left


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_an_empty_micro_batch_trains_on_like_trl(gloo, kind, world_size):
    """mask_truncated_completions with every completion of a micro-batch truncated: step 1 leaves no
    completion token on any rank (the whole CP group, the whole world), step 2 none on rank 0 only (one
    rank's rows of its CP group; at dp 2 x cp 1, one whole CP group); at G = world size, and at world 2
    also dp 2 x cp 1. Both steps run; loss, grad norm, every metric (None where TRL logs None), which
    parameters have a gradient at each step and the last step's gradients equal TRL's own trainer's,
    the KL term on (a reference forward without targets). At G = 2 with activation checkpointing, so
    that DDP finds no unused parameter: a parameter left without a gradient would fail there."""
    schedule = LengthSchedule(((EMPTY,), (EMPTY,) + (MIXED,) * (world_size - 1) if world_size > 1 else (MIXED,)))
    settings = {"lengths": schedule, "max_completion_length": TRUNCATED, "mask_truncated_completions": True,
                "beta": 0.04, "max_steps": 2}
    variants = {f"cp{world_size}": settings}
    if world_size == 2:
        variants = {"cp2": {**settings, **checkpointing_settings(False)}, "dp2xcp1": {**settings, "cp_size": 1}}
    runs = run_rl(gloo, world_size, timeout=600, kind=kind, families=("llama",), cp_size=world_size, variants=variants)
    _check(runs, f"{kind.upper()} empty micro-batch, world {world_size}")


def eos_pad_case(rank, world_size, group, kinds, settings):
    """GRPO and RLOO (stock and ours, llama) with a tokenizer without a pad token: TRL pads prompts and
    completions with EOS, so only the attention mask tells padding from a real EOS."""
    import tempfile

    import torch.distributed as dist

    results = {}
    with tempfile.TemporaryDirectory() as directory:
        holder = [saved_policy("llama", directory) if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        for kind in kinds:
            stock = _run(kind, holder[0], False, rank, world_size, settings, pad_token=None)
            ours = _run(kind, holder[0], True, rank, world_size, settings, cp_size=world_size, pad_token=None)
            results["llama", kind] = (ours, stock)
        dist.barrier()
    return results


def test_eos_as_pad_token_matches_trl(gloo):
    """G = 2, GRPO and RLOO with the KL term, completions up to 200 tokens (EOS-padded after the shorter
    ones, left-padded prompts): every step's loss, grad norm and metric and the gradients equal TRL's."""
    runs = gloo(2).run(eos_pad_case, timeout=600, kinds=("grpo", "rloo"), settings={"beta": 0.04, **SHORT})
    _check(runs, "pad = EOS G=2")
