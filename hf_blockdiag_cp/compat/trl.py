"""TRL internals that have no public equivalent (checked with TRL 1.16, `tests/unit/test_compat.py`)."""

from __future__ import annotations

TESTED = "trl 1.16"


def prepare_like_trl(trainer, dataset, name: str):
    """`dataset` prepared as `SFTTrainer.__init__` prepares its eval data (tokenized, labels masked,
    packed unless `eval_packing=False`), or as given when the trainer skips preparation; refuses, as
    TRL does, a dataset with mask columns but no labels that would skip it. TRL's own `evaluate`
    does this too, but not `predict`, and the CP trainers' sharded evaluation replaces both."""
    trainer._reject_skip_prepare_without_labels({name: dataset}, trainer.data_collator)
    if trainer._skip_prepare_dataset:
        return dataset
    args = trainer.args
    packing = args.packing if args.eval_packing is None else args.eval_packing
    return trainer._prepare_dataset(dataset, trainer.processing_class, args, packing, trainer._formatting_func, name)
