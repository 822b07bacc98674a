"""Everything of TRL's that is not public API and that the TRL trainers (`integrations.trl`) rely on, in
one place, with the TRL releases it was verified on (`VERIFIED`):
- `OVERRIDDEN`: TRL's private methods our trainers replace, with TRL's parameters; each override is
  marked `@overrides(...)`, which refuses a name not listed here;
- `CALLED`: TRL's private methods we call, with their parameters;
- `ATTRIBUTES`: the instance attributes of TRL's trainers (not config fields) that we read;
- the helpers imported from TRL's submodules (not from `trl`'s top level), and the arity of the
  result of `_get_per_token_logps_and_entropies` (`LOGPS_RESULT`; it changed between TRL releases).
`tests/unit/test_trl_compat.py` checks each name, signature and attribute against the installed TRL;
under a TRL outside `VERIFIED` constructing a trainer logs one line naming the verified releases
(`unverified_message`)."""

from __future__ import annotations

from collections.abc import Callable

import trl
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: F401 (not exported by `trl`)
from trl.trainer.utils import entropy_from_logits, use_adapter  # noqa: F401 (helpers of TRL's trainer modules)

VERIFIED = ("1.16.0",)  # the TRL releases the test suite ran on; pyproject.toml's [trl] extra pins their range
TESTED = "trl " + ", ".join(VERIFIED)

_LOGPS_PARAMETERS = ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                     "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
                     "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids",
                     "image_position_ids")
_PREFERENCE_PREPARE = ("dataset", "processing_class", "args", "dataset_name")

# {TRL trainer class: {private method our trainer overrides: its parameters after self, as TRL declares them}}.
OVERRIDDEN: dict[str, dict[str, tuple[str, ...]]] = {
    "GRPOTrainer": {"_get_per_token_logps_and_entropies": _LOGPS_PARAMETERS},
    "RLOOTrainer": {"_get_per_token_logps_and_entropies": _LOGPS_PARAMETERS},
    "DPOTrainer": {"_prepare_dataset": _PREFERENCE_PREPARE, "_precompute_ref_logps": ("dataset", "name", "batch_size")},
    "RewardTrainer": {"_prepare_dataset": _PREFERENCE_PREPARE},
}
# {TRL trainer class: {private method we call (not overridden): its parameters after self}}.
CALLED: dict[str, dict[str, tuple[str, ...]]] = {
    "SFTTrainer": {
        "_prepare_dataset": ("dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"),
        "_reject_skip_prepare_without_labels": ("datasets", "data_collator"),
    },
}
# {TRL trainer class: instance attributes its __init__ sets that our trainers read (no config field holds them)}.
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "SFTTrainer": ("_skip_prepare_dataset", "_formatting_func", "aux_loss_enabled", "router_aux_loss_coef"),
    "DPOTrainer": ("aux_loss_enabled", "beta", "ld_alpha", "precompute_ref_logps", "ref_model", "router_aux_loss_coef",
                   "use_weighting"),
    "RewardTrainer": (),
    "GRPOTrainer": ("aux_loss_enabled", "ref_model", "temperature"),
    "RLOOTrainer": ("aux_loss_enabled", "ref_model", "temperature"),
}
# What `_get_per_token_logps_and_entropies` returns, in order.
LOGPS_RESULT = ("logps", "entropies", "aux_loss")


def overrides(*trl_classes: str) -> Callable:
    """Mark a method as our override of the private method of the same name of each of `trl_classes`;
    raises TypeError at import for a method `OVERRIDDEN` does not list (list it there, with TRL's
    parameters, so that the compat test checks it against every TRL the library runs on)."""

    def mark(method: Callable) -> Callable:
        missing = [name for name in trl_classes if method.__name__ not in OVERRIDDEN.get(name, {})]
        if missing or not trl_classes:
            raise TypeError(f"{method.__qualname__} overrides a private method of {missing or 'TRL'} that "
                            "hf_blockdiag_cp/compat/trl.py's OVERRIDDEN does not list")
        method.__trl_overrides__ = trl_classes
        return method

    return mark


def logps_result(logps, entropies, aux_loss=None) -> tuple:
    """`_get_per_token_logps_and_entropies`'s result as the installed TRL returns it (`LOGPS_RESULT`)."""
    return logps, entropies, aux_loss


def unverified_message(version: str | None = None) -> str | None:
    """One line saying that TRL `version` (default: the installed one) is not a release the TRL
    trainers were verified on, naming those; None for a verified release."""
    version = trl.__version__ if version is None else version
    if version in VERIFIED:
        return None
    return (f"hf_blockdiag_cp's TRL trainers were verified with TRL {', '.join(VERIFIED)}; TRL {version} is installed, "
            "whose private methods they override may differ (hf_blockdiag_cp/compat/trl.py lists them; "
            "tests/unit/test_trl_compat.py checks them)")


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
