"""FSDP2's CPU offload (`CPUOffloadPolicy`: sharded parameters, gradients and the optimizer's step on
the host) composes with `BlockdiagCPTrainer` through the Trainer's own settings,
`TrainingArguments(fsdp=True, fsdp_config={"version": 2, "cpu_offload": True})`, with activation
checkpointing, at cp = 1 (one process, and two DP replicas) and at cp = 2: the logged loss and every
full gradient before the optimizer step equal those of the same run without offload (fp32, 1e-6) and
the stock eager model run on each document alone (1e-4), and after the step the sharded parameters
and AdamW's state live on the CPU under the offload policy.

accelerate runs FSDP only on accelerator devices: `helpers.fsdp.fsdp_on_cpu` keeps its plugin for CPU
processes (test_mixer_families_trainer.py says why); a single process joins FSDP only when launched
(LOCAL_RANK set, as `torchrun --nproc-per-node 1` does), which `accelerate_env` does here.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from transformers import TrainingArguments

from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.data import PackedBatchSampler
from hf_blockdiag_cp.integrations.memory import enable_checkpoint_offload, enable_tiled_mlp, offloaded_layers
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.fsdp import FullGradsBeforeStep, fsdp_on_cpu
from helpers.reference import make_docs, reference_loss_and_grads, rel_err
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, tiny_model, trainer_settings

EXACT = 1e-6  # offload against no offload: the same arithmetic
TILED = 1e-5  # with the tiled MLP too: its tiles sum the weight gradients in another order
TOL = 1e-4  # against the per-document reference
MAX_TOKENS = 32
LENGTHS = [21, 9, 6, 3, 12, 5]


def _offloaded(model) -> bool:
    """Whether every FSDP2 unit of `model` runs under CPUOffloadPolicy with its parameters on the CPU."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = [m._get_fsdp_state()._fsdp_param_group for m in units]
    return bool(units) and all(g is None or isinstance(g.offload_policy, CPUOffloadPolicy) for g in policies)


def _model(switches: bool):
    """The tiny Llama; with `switches`, checkpointing on the model, its MLP tiled and its checkpoints offloaded."""
    model = tiny_model()
    if switches:
        enable_activation_checkpointing(model, use_reentrant=False)
        enable_tiled_mlp(model, tile_tokens=3)
        enable_checkpoint_offload(model)
    return model


def _train(rank, world_size, docs, cp_size: int, offload: bool, switches: bool = False) -> dict:
    """One optimizer step (AdamW, every pack of the epoch) under FSDP2: loss, full gradients, where things live.
    Checkpointing through the TrainingArguments, or (`switches`) on the model with the memory helpers."""
    grads = FullGradsBeforeStep()
    packs = len(PackedBatchSampler([len(d) for d in docs], MAX_TOKENS).epoch_packs()) // (world_size // cp_size)
    fields = {**({} if switches else checkpointing_settings(use_reentrant=False)), "fsdp": True,
              "fsdp_config": {"version": 2, "cpu_offload": offload}}
    settings = {**trainer_settings("", packs, 1), "optim": "adamw_torch", "learning_rate": 1e-2}
    with accelerate_env(rank, world_size, local_rank=rank) as out, fsdp_on_cpu():
        if world_size == 1:  # launched alone, as torchrun --nproc-per-node 1 does (accelerate_env restores these)
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
        args = TrainingArguments(**{**settings, "output_dir": out}, **fields)
        if offload:  # accelerate's policy for cpu_offload=True pins host memory, which needs CUDA
            args.fsdp_plugin_args["cpu_offload"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        trainer = quiet(BlockdiagCPTrainer(model=_model(switches), args=args, max_tokens=MAX_TOKENS, cp_size=cp_size,
                                           train_dataset=[{"input_ids": d.tolist()} for d in docs], callbacks=[grads]))
        trainer.train()
        (log,) = [h for h in trainer.state.log_history if "loss" in h]
        model = trainer.model_wrapped
        states = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        return {"loss": log["loss"], "grads": grads.grads, "fsdp": trainer.is_fsdp_enabled, "offloaded": _offloaded(model),
                "devices": {t.device.type for t in [*model.parameters(), *states]},
                "checkpoints_offloaded": offloaded_layers(model)}


def offload_case(rank, world_size, group, cp_size, switches):
    docs = make_docs(LENGTHS, seed=3)
    ref_loss, ref_grads = reference_loss_and_grads(tiny_model(attn="eager"), docs, group=group)
    on, off = _train(rank, world_size, docs, cp_size, True, switches), _train(rank, world_size, docs, cp_size, False)
    against_off = {"loss": rel_err(torch.tensor(on["loss"]), torch.tensor(off["loss"]))}
    against_off |= {n: rel_err(g, off["grads"][n]) for n, g in on["grads"].items()}
    against_ref = {"loss": rel_err(torch.tensor(on["loss"]), ref_loss)}
    against_ref |= {n: rel_err(on["grads"][n], g) if n in on["grads"] else 1.0 for n, g in ref_grads.items()}
    placed = {k: on[k] for k in ("fsdp", "offloaded", "devices", "checkpoints_offloaded")}
    return against_off, against_ref, placed, off["offloaded"]


@pytest.mark.parametrize("world_size,cp_size,switches", [(1, 1, False), (2, 1, False), (2, 2, False), (2, 2, True)])
def test_fsdp2_cpu_offload_trains_like_no_offload(gloo, world_size, cp_size, switches):
    layers = tiny_model().config.num_hidden_layers
    for rank, (against_off, against_ref, placed, off_offloaded) in enumerate(
            gloo(world_size).run(offload_case, timeout=180, cp_size=cp_size, switches=switches)):
        what = f"world {world_size} cp {cp_size} rank {rank}{' tiled MLP, checkpoints offloaded' if switches else ''}"
        assert placed["fsdp"] and placed["offloaded"] and not off_offloaded, f"{what}: {placed}"
        assert placed["devices"] == {"cpu"}, f"{what}: parameters or optimizer state on {placed['devices']}"
        assert placed["checkpoints_offloaded"] == (layers if switches else 0), f"{what}: {placed}"
        worst = max(against_off, key=against_off.get)
        limit = TILED if switches else EXACT
        assert against_off[worst] <= limit, f"{what}: {worst} differs from the run without offload by {against_off[worst]:.2e}"
        worst = max(against_ref, key=against_ref.get)
        assert against_ref[worst] <= TOL, f"{what}: {worst} relative error {against_ref[worst]:.2e} against the reference"


def test_trainer_refuses_to_drop_the_checkpoint_offload():
    """Checkpointing in the TrainingArguments too: the Trainer would enable it again at train() and put the
    stock checkpoint back on every layer, so it refuses, naming the field."""
    settings = {**trainer_settings("", 1, 1), **checkpointing_settings(use_reentrant=False)}
    field = next(k for k in settings if k.endswith("_checkpointing"))
    with accelerate_env(0, 1) as out:
        args = TrainingArguments(**{**settings, "output_dir": out})
        with pytest.raises(ValueError, match=f"TrainingArguments.{field} is True; expected False"):
            BlockdiagCPTrainer(model=_model(switches=True), args=args, max_tokens=MAX_TOKENS,
                               train_dataset=[{"input_ids": d.tolist()} for d in make_docs(LENGTHS)])
