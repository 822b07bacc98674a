"""`attention.dropout`: the config attribute that holds a family's attention dropout, read from real
Transformers configs and attention modules, and the one-line error that names it (GPT-2's field is
`attn_pdrop`: setting `attention_dropout` on its config changes nothing)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    CodeGenConfig,
    DbrxConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MptConfig,
)

from hf_blockdiag_cp.attention.dropout import (
    ATTENTION_DROPOUT_FIELDS,
    attention_dropout_error,
    attention_dropout_field,
    attention_dropout_message,
)

SMALL = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64)


def gpt2_attention(**config):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64,
                                       bos_token_id=0, eos_token_id=0, **config))
    return model.transformer.h[0].attn


class WithConfig:
    """An attention module stand-in: only its `config` is read."""

    def __init__(self, config):
        self.config = config


def test_gpt2_names_attn_pdrop_even_with_attention_dropout_set_to_zero():
    attention = gpt2_attention(attn_pdrop=0.1, attention_dropout=0.0)
    assert attention_dropout_field(attention, 0.1) == "attn_pdrop"
    assert attention_dropout_field(attention) == "attn_pdrop"  # without the call's rate: the one set non-zero
    message = attention_dropout_message(attention, 0.1)
    assert "GPT2Config.attn_pdrop is 0.1: set it to 0.0" in message, message
    assert "attention_dropout" not in message, message
    assert "\n" not in message


def test_each_family_names_its_own_field():
    llama = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, attention_dropout=0.2, **SMALL)).model.layers[0].self_attn
    bert = BertModel(BertConfig(num_hidden_layers=1, **SMALL)).encoder.layer[0].attention.self  # its 0.1 default
    assert attention_dropout_field(llama, 0.2) == "attention_dropout"
    assert "LlamaConfig.attention_dropout is 0.2" in attention_dropout_message(llama, 0.2)
    assert attention_dropout_field(bert, 0.1) == "attention_probs_dropout_prob"
    assert attention_dropout_field(WithConfig(GPTJConfig(attn_pdrop=0.3)), 0.3) == "attn_pdrop"
    assert attention_dropout_field(WithConfig(CodeGenConfig(attn_pdrop=0.3)), 0.3) == "attn_pdrop"


def test_nested_attention_configs_are_read():
    dbrx = WithConfig(DbrxConfig(attn_config={"attn_pdrop": 0.3}))
    assert attention_dropout_field(dbrx, 0.3) == "attn_config.attn_pdrop"
    assert "DbrxConfig.attn_config.attn_pdrop is 0.3" in attention_dropout_message(dbrx, 0.3)
    mpt = WithConfig(MptConfig())  # attn_config.attn_pdrop 0 (MPT's config types it as an int)
    assert attention_dropout_field(mpt, 0.2) == "attn_config.attn_pdrop"


def test_the_field_matching_the_calls_rate_wins_then_a_non_zero_one():
    config = LlamaConfig(**SMALL, attention_dropout=0.2)
    config.attn_pdrop = 0.1
    assert attention_dropout_field(WithConfig(config), 0.1) == "attn_pdrop"
    assert attention_dropout_field(WithConfig(config), 0.2) == "attention_dropout"
    zero = LlamaConfig(**SMALL)  # set, but zero: still the family's field
    assert attention_dropout_field(WithConfig(zero), 0.5) == "attention_dropout"


def test_without_a_known_field_or_config_the_message_says_so():
    module = torch.nn.Linear(2, 2)
    assert attention_dropout_field(module, 0.1) is None
    assert "Linear has no config" in attention_dropout_message(module, 0.1)
    bare = WithConfig(type("OddConfig", (), {})())
    message = attention_dropout_message(bare, 0.1)
    assert attention_dropout_field(bare, 0.1) is None
    assert "OddConfig has none of " + ", ".join(ATTENTION_DROPOUT_FIELDS) in message, message
    assert "dropout_p=0.0" in attention_dropout_message(None, 0.1)  # the SDPA drop-in: its caller passes the rate


def test_the_error_is_not_implemented_with_the_message():
    attention = gpt2_attention(attn_pdrop=0.1)
    error = attention_dropout_error(attention, 0.1)
    assert isinstance(error, NotImplementedError)
    with pytest.raises(NotImplementedError, match=r"GPT2Config\.attn_pdrop is 0\.1"):
        raise error
