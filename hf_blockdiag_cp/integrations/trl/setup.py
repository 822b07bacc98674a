"""Setup of the TRL trainers: the pack size, the datasets' columns, the reference model (switched to
`blockdiag_cp`), the TRL release. Each check raises ValueError naming the field, on every rank alike."""

from __future__ import annotations

import copy
import logging

from ...comm.notice import warn_once
from ...compat.transformers import attn_implementation
from ...compat.trl import unverified_message
from ...logprobs.fsdp import unsharded_class
from ...model_patches import apply_model_patches
from ...step.model_support import configured_model
from ..transformers import ATTN_IMPLEMENTATION

logger = logging.getLogger(__name__)


def pack_size(max_tokens: int | None, max_length: int | None, cp_size: int, pairs: int = 1, config: str = "") -> int:
    """`max_tokens`, or by default 2 * `pairs` * `max_length` (`pairs` whole pairs at the longest: a micro-batch in
    one pack) rounded up to a multiple of 2*cp_size. `config`: the config's name, for the error."""
    if max_tokens is not None:
        return max_tokens
    if max_length is None:
        raise ValueError(f"max_tokens is required when {config + '.' if config else ''}max_length is None: it is the "
                         "pack size (a multiple of 2*cp_size)")
    step = 2 * cp_size
    return -(-2 * pairs * max_length // step) * step


def column_names(dataset) -> set[str]:
    names = getattr(dataset, "column_names", None)
    if names is None:
        first = next(iter(dataset), None)
        names = list(first.keys()) if hasattr(first, "keys") else []
    return set(names)


def require_pair_columns(dataset, name: str, tokenized: tuple[str, ...]) -> set[str]:
    """The dataset's columns; raise unless it holds preference pairs (text `chosen` / `rejected`, with or
    without `prompt`, or the pre-tokenized `tokenized` columns)."""
    columns = column_names(dataset)
    if {"chosen", "rejected"} <= columns or set(tokenized) <= columns:
        return columns
    raise ValueError(
        f"the {name} dataset has columns {sorted(columns)}; expected preference pairs: 'chosen' and 'rejected' (text or "
        f"conversational, with or without 'prompt') or pre-tokenized {list(tokenized)}. A prompt-only dataset is for "
        "GRPO / RLOO, not for preference training"
    )


def is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is optional
        return False
    inner = getattr(model, "module", model)
    return isinstance(inner, PeftModel)


def _base(model):
    inner = configured_model(model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) and is_peft(inner) else inner


def prepare_reference(model, ref_model) -> None:
    """Raise unless `ref_model` is the policy's architecture with its vocabulary; then run it as the policy
    runs: on `blockdiag_cp` attention (switched here, logged once at INFO, when it was loaded with another
    implementation) with the policy's model patches."""
    policy, ref = _base(model), configured_model(ref_model)
    classes = [unsharded_class(m).__name__ for m in (policy, ref)]  # FSDP2 renames a sharded model's class
    if classes[1] != classes[0] or ref.config.model_type != policy.config.model_type:
        raise ValueError(
            f"ref_model is a {classes[1]} ({ref.config.model_type}); expected the policy's architecture, "
            f"{classes[0]} ({policy.config.model_type}): the reference runs on the same shard step"
        )
    vocab = [m.get_output_embeddings().weight.shape[0] for m in (policy, ref)]
    if vocab[0] != vocab[1]:
        raise ValueError(
            f"ref_model has a vocabulary of {vocab[1]} tokens; expected the policy's {vocab[0]}: the log-prob ratios "
            "compare the same tokens"
        )
    impl = attn_implementation(ref.config)
    if impl != ATTN_IMPLEMENTATION:
        ref.set_attn_implementation(ATTN_IMPLEMENTATION)
        warn_once(logger, ("reference attention", impl),
                  f"blockdiag_cp: the reference model was loaded with attn_implementation={impl!r}; it now runs on "
                  f"{ATTN_IMPLEMENTATION!r}, as the policy does, on the policy's CP shards", level=logging.INFO)
    apply_model_patches(ref)


def policy_load_args(model, args, name: str):
    """The config TRL loads a policy given by path with (`args.model_init_kwargs`, also used for the
    reference it loads): without an attention there, a copy that asks for `blockdiag_cp` (one INFO line;
    the user's config is unchanged); with another attention, ValueError naming the field. A model object
    is checked where it is (`check_model_setup`)."""
    if not isinstance(model, str):
        return args
    init = dict(args.model_init_kwargs or {})
    impl = init.get("attn_implementation")
    if impl == ATTN_IMPLEMENTATION:
        return args
    if impl is not None:
        raise ValueError(
            f'{name}.model_init_kwargs["attn_implementation"] is {impl!r}; expected {ATTN_IMPLEMENTATION!r} (or unset): '
            f"TRL loads the policy {model!r} and its reference with it, and any other attention attends only inside "
            "each rank's shard"
        )
    warn_once(logger, ("policy attention", name, model),
              f'blockdiag_cp: {name} loads {model!r} with model_init_kwargs["attn_implementation"]='
              f"{ATTN_IMPLEMENTATION!r} (from a copy of your {name}, which is unchanged)", level=logging.INFO)
    args = copy.copy(args)
    args.model_init_kwargs = {**init, "attn_implementation": ATTN_IMPLEMENTATION}
    return args


def check_reference_source(model, args, name: str, peft_config=None) -> None:
    """Raise where TRL would load the reference model (`beta` > 0, no PEFT) from a policy object that has
    no path to load it from (`config._name_or_path` empty: built in memory); TRL's own error names an
    empty repo id."""
    if model is None or isinstance(model, str) or not getattr(args, "beta", 0.0) or peft_config is not None \
            or is_peft(model):
        return
    config = getattr(configured_model(model), "config", None)
    if config is not None and not getattr(config, "_name_or_path", ""):
        raise ValueError(
            f"{name}.beta={args.beta} needs a reference model, which TRL loads from the policy's path "
            "(config._name_or_path), and this policy was built in memory: pass the policy by path (model=\"<folder>\" "
            f"after save_pretrained), or set {name}.beta=0.0"
        )


def warn_if_unverified_trl() -> None:
    """Log, once per process on rank 0, one line when the installed TRL is not a release the trainers
    were verified on (`compat.trl.VERIFIED`)."""
    message = unverified_message()
    if message is not None:
        warn_once(logger, ("trl version", message), message)


def pad_token_of(processing_class) -> int:
    """The pack's padding token: the tokenizer's pad token, else its EOS (as TRL pads), else 0."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return 0 if pad is None else int(pad)
