"""What a training script launched on every rank needs to fail well (the example scripts build on it).

Every rank sees the same command line and world size, so every rank reaches the same verdict: a bad
argument ends the run on every rank with one `error: <reason>` line and exit status 2, before any
process group, model or data exists, never a hang (`check_launch`, `OneLineParser`, `fail`). Also:
the `CPConfig` fields as command-line flags and their checks, `--dataset` files read by suffix, a
tokenizer without a vocabulary refused, the run's outputs (`metrics.json` from a trainer's log history,
`loss.png`), and the Trainer's activation-checkpointing fields as the installed Transformers spells them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from ..config import OVERLAP_SPLITS, CPConfig
from ..kernels import kernel_names
from ..kernels.attention.registry import KernelUnavailableError
from ..planning import exchange_names, layout_strategies
from .accelerate import launch_error, launched_world_size


@contextlib.contextmanager
def process_group_closed():
    """Destroy the default process group when the block ends, also on an error: a gloo group left to the
    interpreter's exit can abort a finished rank there ("terminate called without an active exception")."""
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def one_line_errors():
    """End the rank with `fail`'s one line for an error the user fixes on the command line or in the
    installation that shows only once the run started: a kernel that cannot run here (its package
    does not import, or the device or dtype is not one it runs) or a model type or feature the
    library refuses. Every rank meets it at the same step, so every rank ends alike."""
    try:
        yield
    except (KernelUnavailableError, NotImplementedError) as exc:
        fail(" ".join(str(exc).split()), during_run=True)


def fail(reason: str, during_run: bool = False) -> NoReturn:
    """End this rank with `error: <reason>` as one line on stderr and exit status 2. Every rank
    prints it: a rank that waited for rank 0 to print could be killed by the launcher first.
    `during_run`: the line starts on a new line (rank 0's progress bar may hold an unfinished one),
    and the process exits at once: tearing down a gloo group while the peers fail at the same
    moment can abort a process (status -6 instead of 2)."""
    sys.stdout.flush()
    newline = "\n" if during_run else ""
    # One write call: ranks share the launcher's pipe, and an unbuffered print writes the text
    # and its newline separately, so two ranks' lines could interleave.
    sys.stderr.write(f"{newline}error: {reason}\n")
    sys.stderr.flush()
    if during_run:
        os._exit(2)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad argument as `error: <reason>` alone (no usage block)."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def check_ranges(parser, args, positive=(), non_negative=()) -> None:
    """`parser.error` naming the first flag in `positive` that is <= 0 or in `non_negative` that is < 0."""
    for names, ok, expected in ((positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, ">= 0")):
        for name in names:
            if not ok(getattr(args, name)):
                parser.error(f"--{name.replace('_', '-')} must be {expected}; got {getattr(args, name)}")


# --------------------------------------------------------------------------- the CPConfig flags


def add_cp_config_arguments(parser) -> None:
    """--attn-backend, --kv-exchange, --layout, --overlap: the fields of the run's `CPConfig`
    (`cp_config_from_args`)."""
    parser.add_argument("--attn-backend", default="auto", help="blockdiag_cp kernel: auto, dense, flex, varlen, fa4, "
                        "flash, te")
    parser.add_argument("--kv-exchange", default="allgather", help="K/V exchange: allgather, halo, a2a, auto")
    parser.add_argument("--layout", default="contiguous", help="how packs are sharded: contiguous, balanced")
    parser.add_argument("--overlap", nargs="?", const="queries", default=False, choices=OVERLAP_SPLITS,
                        help="attend over what the rank holds while the K/V exchange runs, split by queries (the "
                        "default of a bare --overlap) or by keys (CPConfig.overlap)")


# The CPConfig fields set from the command line: (field, what a valid value is, its accepted names).
CONFIG_FIELDS = (
    ("attn_backend", "a kernel", lambda: ("auto", *kernel_names())),
    ("kv_exchange", "a K/V exchange", lambda: ("auto", *exchange_names())),
    ("layout", "a layout", layout_strategies),
)


def cp_config_from_args(args) -> CPConfig:
    """The `CPConfig` of `add_cp_config_arguments`' flags."""
    return CPConfig(attn_backend=args.attn_backend, kv_exchange=args.kv_exchange, layout=args.layout,
                    overlap=args.overlap)


def config_error(args) -> str | None:
    """Why --attn-backend, --kv-exchange or --layout names nothing this installation has, or the flags
    cannot go together (--overlap with an exchange that cannot overlap, or by keys with a kernel
    without a log-sum-exp output), or None."""
    for field, what, accepted in CONFIG_FIELDS:
        value = getattr(args, field)
        try:
            CPConfig(**{field: value})
        except (TypeError, ValueError):
            return f"--{field.replace('_', '-')}={value!r} is not {what}; accepted: {', '.join(accepted())}"
    try:
        cp_config_from_args(args)
    except ValueError as exc:
        return f"--overlap={args.overlap} with --kv-exchange={args.kv_exchange!r} --attn-backend={args.attn_backend!r}: {exc}"
    return None


def layout_error(args, world_size: int, pack_flag: str = "max_tokens") -> str | None:
    """Why `args` (`cp_size`, `packs_per_step` and the pack size `pack_flag`) cannot run on `world_size`
    processes (dp x cp), or None."""
    cp = world_size if args.cp_size is None else args.cp_size
    if cp <= 0 or world_size % cp:
        return f"--cp-size={cp} must be a positive divisor of the number of processes ({world_size})"
    dp = world_size // cp
    if args.packs_per_step % dp:
        return f"--packs-per-step={args.packs_per_step} must be divisible by dp={dp} (processes {world_size} / cp {cp})"
    pack = getattr(args, pack_flag)
    if pack % (2 * cp):
        return f"--{pack_flag.replace('_', '-')}={pack} must be a multiple of 2*cp={2 * cp}"
    return None


# --------------------------------------------------------------------------- data and tokenizer


# Local data files `--dataset` takes, by suffix: the `datasets` builder that reads each.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".text": "text"}


def dataset_error(args) -> str | None:
    """Why `args.dataset` cannot load, where that is known without loading it, or None: a name with a
    data-file suffix is a local path (never a Hub id), so a missing one fails here at once instead of
    after `datasets` has tried the network; a file of another type is refused by name."""
    value = getattr(args, "dataset", None)
    if value is None:
        return None
    path = Path(value)
    if path.suffix in DATA_FILE_BUILDERS and not path.exists():
        return f"--dataset {value!r}: no such file"
    if path.is_file() and path.suffix not in DATA_FILE_BUILDERS:
        return f"--dataset {value!r}: unknown file type {path.suffix!r}; expected one of {sorted(DATA_FILE_BUILDERS)}"
    if path.is_file() and path.stat().st_size == 0:  # `datasets` itself would stop at a bare StopIteration
        return f"--dataset {value!r}: the file is empty (no document to train on)"
    return None


def load_raw_dataset(value: str, split: str = "train", config: str | None = None):
    """`--dataset` as a `datasets.Dataset`: a local data file by its suffix, else a folder or Hub name."""
    from datasets import load_dataset

    path = Path(value)
    if path.is_file():
        return load_dataset(DATA_FILE_BUILDERS[path.suffix], data_files=str(path), split=split)
    return load_dataset(value, config, split=split)


TOKENIZER_PROBE = "def main():\n    return 'The quick brown fox'"


def tokenizer_error(tokenizer) -> str | None:
    """Why `tokenizer` cannot tokenize training text, or None. A model folder without tokenizer files
    loads as an empty tokenizer (GPT-2, Qwen2: one special token) that turns every text into `[]`, or
    into unknown tokens alone; every document would then be empty or noise."""
    ids = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    unk = getattr(tokenizer, "unk_token_id", None)
    if ids and not all(i == unk for i in ids):
        return None
    said = "no token" if not ids else "only unknown tokens"
    return (f"its tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) has no vocabulary: it turns text into "
            f"{said} (are tokenizer.json / the vocabulary files missing from the model folder?)")


def loaded(what: str, load, *args):
    """`load(*args)`, or `fail` with one line naming `what` (the flag) when the model or data named on
    the command line cannot be loaded (every rank loads the same, so every rank fails alike)."""
    try:
        return load(*args)
    except (ValueError, OSError) as exc:
        fail(f"{what}: {exc}")


# --------------------------------------------------------------------------- the launch check


def argument_error(args, world_size: int) -> str | None:
    """Why `args` cannot run on `world_size` processes (sizes, then kernel, exchange and layout names,
    then a local `--dataset` file), or None."""
    return layout_error(args, world_size) or config_error(args) or dataset_error(args)


def check_launch(args, errors=argument_error) -> int:
    """The world size, after checking the launch and `args` against it (`errors(args, world_size)`
    gives the reason a value cannot run, or None); on a problem, `fail`.

    Runs in every worker before any process group exists, any model or data is loaded, and needs
    no collective: every rank sees the same command line and world size, so every rank reaches the
    same verdict and a bad argument ends the run at once instead of one rank hanging in a collective.
    Then the main rank shows the library's INFO lines (which kernel, exchange and layout run).
    """
    world_size = launched_world_size()
    reason = launch_error(sys.argv) or errors(args, world_size)
    if reason is not None:
        fail(reason)
    if int(os.environ.get("RANK", "0")) == 0:
        logging.basicConfig(format="%(message)s")
        logging.getLogger("hf_blockdiag_cp").setLevel(logging.INFO)
    return world_size


# --------------------------------------------------------------------------- Trainer fields and outputs


def checkpointing_arguments(enabled: bool) -> dict:
    """Non-reentrant activation checkpointing as `TrainingArguments` (and TRL's configs) spell it:
    `activation_checkpointing` in recent Transformers, `gradient_checkpointing` before (e.g. 5.17)."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: enabled, f"{name}_kwargs": {"use_reentrant": False} if enabled else None}


def trainer_metrics(trainer, world_size: int, cp_size: int) -> dict:
    """`metrics.json` of a finished `BlockdiagCPTrainer` / TRL trainer run, from its log history: loss,
    gradient norm and packing efficiency per logged step, real tokens per second over the run."""
    steps = [h for h in trainer.state.log_history if "loss" in h]
    final = next(h for h in reversed(trainer.state.log_history) if "train_runtime" in h)
    real = sum(v for h in steps for k, v in h.items() if k.startswith("cp_real_tokens_rank"))
    return {
        "losses": [h["loss"] for h in steps],
        "grad_norms": [h["grad_norm"] for h in steps],
        "tokens_per_second": real / final["train_runtime"],
        "cp_size": cp_size,
        "dp_size": world_size // cp_size,
        "world_size": world_size,
        "packing_efficiency": [h["cp_packing_efficiency"] for h in steps],
        "real_tokens": real,
        "train_runtime_s": final["train_runtime"],
    }


def write_outputs(output_dir: Path, metrics: dict, title: str) -> None:
    """`metrics.json`, and `loss.png` (`metrics["losses"]` per optimizer step, `metrics["tokens_per_second"]`
    in the title) when matplotlib (the [bench] extra) is installed."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (the [bench] extra): loss.png not written", file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(metrics["losses"]) + 1), metrics["losses"], marker="o", markersize=3)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(metrics.get("loss_label", "loss (token-weighted mean)"))
    ax.set_title(f"{title}, {metrics['tokens_per_second']:.0f} tokens/s")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(output_dir / "loss.png", dpi=120)
    plt.close(fig)
