"""The tiny Llama the Trainer tests train (the parity config of helpers/reference.py, no cache), their
training arguments, and how a gloo pool worker runs a Trainer: accelerate's view of the rank, no
console callbacks, the attention calls of a CP step counted; a one-process stock reference run in the
test's process while the pool works (`run_beside`)."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, PrinterCallback, ProgressCallback

import hf_blockdiag_cp  # noqa: F401 - registers "blockdiag_cp"
from helpers.reference import tiny_config


def tiny_model(attn: str = "blockdiag_cp", **overrides):
    torch.manual_seed(0)
    config = tiny_config("llama", **{"use_cache": False, **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)


def checkpointing_settings(use_reentrant: bool) -> dict:
    """TrainingArguments fields that turn activation checkpointing on, in this transformers' spelling:
    `activation_checkpointing*` (5.23 on) or `gradient_checkpointing*` (the 5.17 floor)."""
    from transformers import TrainingArguments

    prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"use_reentrant": use_reentrant}}


def trainer_settings(output_dir: str, accumulation: int, steps: int) -> dict:
    """The Trainer tests' arguments: plain SGD without clipping (a gradient scale error shows in the
    weights; Adam would hide it), one pack per micro-batch, a log per step, CPU, no checkpoints."""
    return dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=accumulation,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )


@contextlib.contextmanager
def accelerate_env(rank: int, world_size: int, local_rank: int | None = None):
    """Make accelerate treat this pool worker as rank `rank` of a `world_size` CPU run; undo it afterwards.
    `local_rank` (default `rank`): the LOCAL_RANK accelerate sees; GPU tests put every rank on GPU 0.

    The Trainers run inside the shared gloo pool: accelerate's PartialState joins the already
    initialised process group when RANK/WORLD_SIZE/LOCAL_RANK are set and `use_cpu=True`.
    Yields a temporary output directory.
    """
    from accelerate.state import AcceleratorState

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    if world_size > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank if local_rank is None else local_rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with tempfile.TemporaryDirectory() as out:
            yield out
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def quiet(trainer):
    """The trainer without its console callbacks (the pool's workers share one terminal)."""
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


@contextlib.contextmanager
def counting_attention():
    """Register a `blockdiag_cp` attention that records the query rows of every call inside a CP
    step (each rank's share of the pack); yields that list; restores the library's function after."""
    from transformers import AttentionInterface

    from hf_blockdiag_cp.attention import blockdiag_cp_attention_forward

    query_rows: list[int] = []

    def counting(module, query, *args, **kwargs):
        if kwargs.get("blockdiag_cp_step") is not None:
            query_rows.append(query.shape[2])
        return blockdiag_cp_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("blockdiag_cp", counting)
    try:
        yield query_rows
    finally:
        AttentionInterface.register("blockdiag_cp", blockdiag_cp_attention_forward)


@contextlib.contextmanager
def counting_lm_head_rows(model):
    """Record the rows of every call of `model`'s output embedding (the logits it builds: [1, rows, vocab]);
    yields that list. Under CP the trainers' loss runs the chunked head instead, which builds none."""
    rows: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _args, out: rows.append(out.shape[-2]))
    try:
        yield rows
    finally:
        handle.remove()


def run_beside(pool, fn, reference, timeout: float = 300.0, **kwargs):
    """`pool.run(fn, **kwargs)` while this process computes `reference()` (a stock one-process run):
    a one-rank pool leaves the second core idle otherwise. Returns `(runs by rank, reference())`."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as executor:
        runs = executor.submit(pool.run, fn, timeout, **kwargs)
        want = reference()  # on an error, leaving the block still waits for the pool's answer
        return runs.result(), want
