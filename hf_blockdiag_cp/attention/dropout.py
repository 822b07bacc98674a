"""Which config attribute holds a model's attention dropout, for the error that refuses it in a CP step.

No kernel of a CP step applies attention dropout, so a call that asks for it raises (I7). The error
must name the field the user can change, and families spell it differently: `attention_dropout`
(Llama, Mistral, Qwen, OPT, GPT-NeoX, ...), `attn_pdrop` (GPT-2, GPT-J, CodeGen, GPT-BigCode;
DBRX and MPT under `attn_config`), `attention_probs_dropout_prob` (BERT-like), `attn_dropout`, ...
Setting `attention_dropout` on a GPT-2 config changes nothing: GPT-2 reads `attn_pdrop`.
"""

from __future__ import annotations

import math

# The attention-dropout attribute of Transformers' configs, most common first.
ATTENTION_DROPOUT_FIELDS = (
    "attention_dropout",
    "attn_pdrop",
    "attention_probs_dropout_prob",
    "attn_dropout",
    "attention_dropout_prob",
    "attention_dropout_rate",
    "attention_drop_rate",
    "attn_drop_rate",
)
# Sub-configs that hold the attention settings in some families (DBRX, MPT: `attn_config.attn_pdrop`).
NESTED_ATTENTION_CONFIGS = ("attn_config",)


def _rate(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _fields(config) -> list[tuple[str, float]]:
    """(name, rate) of every attention-dropout attribute `config` sets, nested ones as `attn_config.name`."""
    found = []
    for prefix, holder in [("", config)] + [(f"{n}.", getattr(config, n, None)) for n in NESTED_ATTENTION_CONFIGS]:
        if holder is None or isinstance(holder, (dict, str)):
            continue
        for name in ATTENTION_DROPOUT_FIELDS:
            rate = _rate(getattr(holder, name, None))
            if rate is not None:
                found.append((prefix + name, rate))
    return found


def attention_dropout_field(module, dropout: float | None = None) -> str | None:
    """The name of the attribute of `module.config` that holds the attention dropout of `module`'s
    family (`"attn_config.attn_pdrop"` for a nested one), or None when the config sets none.

    Of the attributes the config sets, the first that equals `dropout` (the rate the attention call
    received) wins, then the first that is not zero, then the first: a GPT-2 config with
    `attn_pdrop=0.1` and an unused `attention_dropout=0.0` gives `"attn_pdrop"`."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    found = _fields(config)
    if not found:
        return None
    if dropout:
        for name, rate in found:
            if math.isclose(rate, float(dropout), rel_tol=1e-6, abs_tol=1e-12):
                return name
    for name, rate in found:
        if rate != 0:
            return name
    return found[0][0]


def attention_dropout_message(module, dropout: float) -> str:
    """The one-line error for an attention call with dropout `dropout` during a CP step, naming the
    config attribute to set to 0 (`attention_dropout_field`). `module` None: an SDPA call
    (`cp_blockdiag_sdpa`), whose caller passes `dropout_p` itself."""
    head = f"blockdiag_cp: attention dropout ({dropout}) is not supported during a CP step"
    if module is None:
        return f"{head}; call cp_blockdiag_sdpa (or the F.scaled_dot_product_attention it replaces) with dropout_p=0.0"
    config = getattr(module, "config", None)
    field = attention_dropout_field(module, dropout)
    if field is None:
        where = f"{type(config).__name__} has none of {', '.join(ATTENTION_DROPOUT_FIELDS)}" if config is not None \
            else f"{type(module).__name__} has no config"
        return f"{head}; set the attention dropout of {type(module).__name__} to 0 ({where})"
    prefix, _, name = field.rpartition(".")
    holder = getattr(config, prefix) if prefix else config
    value = getattr(holder, name)
    how = (f"from_pretrained(path, {field}=0.0), or config.{field} = 0.0 then from_config" if not prefix
           else f"config.{field} = 0.0, then from_config or from_pretrained(path, config=config)")
    return f"{head}; {type(config).__name__}.{field} is {value}: set it to 0.0 before the model is built ({how})"


def attention_dropout_error(module, dropout: float) -> NotImplementedError:
    """`attention_dropout_message` as the NotImplementedError that the attention entry point raises."""
    return NotImplementedError(attention_dropout_message(module, dropout))
