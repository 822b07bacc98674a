"""A reference model loaded with another attention implementation than `blockdiag_cp` is switched to it
by the trainer, on real gloo groups at cp = 2: DPO with a `ref_model` loaded with "eager", and GRPO whose
reference TRL loads with "eager" (`GRPOConfig.model_init_kwargs`, a policy passed as a model). One
optimizer step of each equals, bit for bit (loss, every logged metric, every parameter gradient), the
same step with the reference loaded with "blockdiag_cp"; rank 0 logs the switch in one INFO line, the
other rank nothing, and a reference loaded with "blockdiag_cp" logs nothing.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    GradCapture, char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows, reference_model,
    training_logs,
)
from helpers.rl import LastGrads, model_kwargs, rl_config, rl_trainer, saved_policy  # noqa: E402
from helpers.trainer import accelerate_env, quiet  # noqa: E402

SWITCHED = "the reference model was loaded with attn_implementation="
TIMINGS = ("cp_tokens_per_second", "step_time")  # wall-clock figures, not compared


def _logged(logs: dict) -> dict:
    return {name: value for name, value in logs.items() if name not in TIMINGS}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if SWITCHED in record.getMessage():
            self.lines.append(record.getMessage())


def _dpo(rank, world_size, ref_attn):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference_rows(count=4)
    with accelerate_env(rank, world_size) as out:
        policy = policy_model("llama", "blockdiag_cp")
        ref = reference_model(policy_model("llama", ref_attn))  # the policy's weights, perturbed, loaded with ref_attn
        capture = GradCapture()
        trainer = quiet(BlockdiagCPDPOTrainer(
            model=policy, ref_model=ref, args=dpo_config(out, len(rows)), train_dataset=preference_dataset(rows),
            processing_class=char_tokenizer(), cp_size=world_size, max_tokens=512, callbacks=[capture]))
        trainer.train()
        return {"logs": [_logged(training_logs(trainer))], "grads": capture.grads, "ref": ref.config._attn_implementation}


def _grpo(rank, world_size, ref_attn, path):
    from transformers import AutoModelForCausalLM

    with accelerate_env(rank, world_size) as out:
        policy = AutoModelForCausalLM.from_pretrained(path, attn_implementation="blockdiag_cp", dtype="float32")
        # TRL loads the reference from the policy's path with model_init_kwargs: here with `ref_attn`
        args = rl_config("grpo", out, **model_kwargs(ref_attn), max_completion_length=16, beta=0.1)
        capture = LastGrads()
        trainer = quiet(rl_trainer("grpo", policy, args, True, lengths=(5, 16, 9, 2), cp_size=world_size,
                                   callbacks=[capture]))
        trainer.train()
        logs = [_logged(h) for h in trainer.state.log_history if "loss" in h]
        return {"logs": logs, "grads": capture.grads, "ref": trainer.ref_model.config._attn_implementation}


def reference_case(rank, world_size, group, trainer):
    """Both reference attentions for `trainer` ("dpo" or "grpo"), with the switch lines each logged."""
    import tempfile

    import torch.distributed as dist

    from hf_blockdiag_cp.comm.notice import forget

    results = {}
    with tempfile.TemporaryDirectory() as directory:
        holder = [saved_policy("llama", directory) if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        for attn in ("blockdiag_cp", "eager"):
            forget(("reference attention", attn))
            handler, library = Lines(), logging.getLogger("hf_blockdiag_cp")
            level = library.level
            library.addHandler(handler)
            library.setLevel(logging.INFO)
            try:
                results[attn] = _dpo(rank, world_size, attn) if trainer == "dpo" else _grpo(rank, world_size, attn,
                                                                                          holder[0])
            finally:
                library.removeHandler(handler)
                library.setLevel(level)
            results[attn]["lines"] = handler.lines
        dist.barrier()
    return results


@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_an_eager_reference_trains_as_a_blockdiag_cp_one(gloo, trainer):
    runs = gloo(2).run(reference_case, timeout=600, trainer=trainer)
    for rank, run in enumerate(runs):
        same, eager = run["blockdiag_cp"], run["eager"]
        assert same["ref"] == eager["ref"] == "blockdiag_cp", (same["ref"], eager["ref"])
        assert same["lines"] == [], same["lines"]
        assert len(eager["lines"]) == (1 if rank == 0 else 0), eager["lines"]
        if rank == 0:
            assert "attn_implementation='eager'; it now runs on 'blockdiag_cp'" in eager["lines"][0]
        used = "kl" if trainer == "grpo" else "rewards/margins"  # a figure the reference's log-probs enter
        assert all(log.get(used) for log in same["logs"]), f"rank {rank}: no {used} logged: {same['logs']}"
        assert eager["logs"] == same["logs"], f"rank {rank}: {eager['logs']} vs {same['logs']}"
        assert set(eager["grads"]) == set(same["grads"]) and eager["grads"], f"rank {rank}: gradients differ in names"
        for name, grad in same["grads"].items():
            assert eager["grads"][name].equal(grad), f"rank {rank}: the gradient of {name} differs"
