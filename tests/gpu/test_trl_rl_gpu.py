"""`BlockdiagCPGRPOTrainer` / `BlockdiagCPRLOOTrainer` in bf16 on one GPU (I1): the RL gradient per parameter
group, over seeds.

For every seed (policy weights; the reference is the policy moved by seeded noise), one step of TRL's own
`GRPOTrainer` / `RLOOTrainer` in fp32 (the stock `sdpa` model on padded rows, no TF32) is the reference;
TRL's trainer with the stock model in bf16 is the yardstick; ours runs the same completions packed in bf16
(attention `auto`: FA4 where installed; activation checkpointing). Each runs at G = 1 and at G = 2 (gloo
with CUDA tensors, both ranks on GPU 0; the stock runs at the same world size, each rank its own prompts as
TRL distributes them). The completions are injected (`helpers.rl`): 1 to 2,000 tokens, some truncated; the
KL term is on. Per parameter group (attention, MLP, the rest), the median over `SEEDS` of ours/stock (the
two gradient errors of one seed) must stay within 1.5x, and the loss within 1e-2 of the loss's scale (the
policy loss is ~0 on-policy: its scale is the rewards' spread, as in `helpers.rl.compare_rl_runs`).
`pytest -s` prints every group's medians.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.bf16_parity import GRAD_FACTOR, GROUPS, LOSS_TOL, group_errors, median_ratios  # noqa: E402
from helpers.reference import tiny_config  # noqa: E402
from helpers.rl import LastGrads, rl_config, rl_trainer  # noqa: E402
from helpers.trainer import accelerate_env, checkpointing_settings, quiet  # noqa: E402

DEVICE = os.environ.get("BDCP_BF16_DEVICE", "cuda")
SEEDS = tuple(range(int(os.environ.get("BDCP_BF16_SEEDS", "3"))))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_DIMS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, initializer_range=0.02)
RUNS = {"fp32": (False, "float32"), "stock_bf16": (False, "bfloat16"), "ours_bf16": (True, "bfloat16")}


def save_llama(seed: int, directory: str) -> str:
    """The tiny Llama at head dim 64 (FA4 verified there), Transformers' initialisation, seeded, saved in
    fp32 under `directory` (TRL loads the policy and its reference from the path)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", use_cache=False, **GPU_DIMS), dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def _one_step(kind: str, path: str, ours: bool, dtype: str, rank: int, world_size: int, group):
    """(logged loss, logged reward_std, {name: gradient}) of one step: ours, or TRL's stock trainer (sdpa)."""
    import hf_blockdiag_cp as bdcp

    with accelerate_env(rank, world_size, local_rank=0) as out:
        settings = {"beta": 0.04, "use_cpu": DEVICE == "cpu", "ddp_backend": "gloo" if world_size > 1 else None,
                    "model_init_kwargs": {"attn_implementation": "blockdiag_cp" if ours else "sdpa", "dtype": dtype},
                    **(checkpointing_settings(False) if ours else {})}
        args = rl_config(kind, out, **settings)
        capture = LastGrads()
        cp = {"cp_size": world_size, "cp_config": bdcp.CPConfig(attn_backend="auto"),
              "cp_mesh": group if world_size > 1 else None} if ours else {}
        trainer = quiet(rl_trainer(kind, path, args, ours, callbacks=[capture], **cp))
        trainer.train()
        log = next(h for h in trainer.state.log_history if "loss" in h)
        return log["loss"], log["reward_std"], capture.grads


def rl_step_case(rank, world_size, group, kind: str, seed: int) -> dict:
    """{run: (loss, reward_std, gradients)} of the three runs of `seed` (`RUNS`) on this rank."""
    import tempfile

    import torch.distributed as dist

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as directory:
        holder = [save_llama(seed, directory) if rank == 0 else None]  # Transformers saves on the main process only
        dist.broadcast_object_list(holder, src=0)  # rank 0's folder: every rank loads the same weights
        runs = {run: _one_step(kind, holder[0], ours, dtype, rank, world_size, group)
                for run, (ours, dtype) in RUNS.items()}
        dist.barrier()  # rank 0's folder stays until every rank has loaded from it
        return runs


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_rl_bf16_gradient_per_group_within_the_stock_error(gloo, kind, world_size):
    stock, ours, losses = [], [], []
    for seed in SEEDS:
        runs = gloo(world_size).run(rl_step_case, timeout=600, kind=kind, seed=seed)
        (loss32, spread, grads32), (_, _, grads16), (loss_ours, _, grads_ours) = (runs[0][r] for r in RUNS)
        stock.append(group_errors(grads16, grads32))
        ours.append(group_errors(grads_ours, grads32))
        losses.append(abs(loss_ours - loss32) / max(abs(loss32), spread))
    ratio = median_ratios(ours, stock)
    print(f"\n{kind} G={world_size}: median over {len(SEEDS)} seeds of ours/stock bf16 gradient error: "
          + ", ".join(f"{g} {ratio[g]:.2f}x ({statistics.median(o[g] for o in ours):.2e}/"
                      f"{statistics.median(s[g] for s in stock):.2e})" for g in GROUPS)
          + f"; loss {statistics.median(losses):.1e} of its scale")
    assert all(ratio[g] <= GRAD_FACTOR for g in GROUPS), ratio
    assert statistics.median(losses) <= LOSS_TOL, losses
