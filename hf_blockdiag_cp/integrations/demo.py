"""Offline pieces for trying a setup without downloading anything (the example scripts use them): a
tiny random-init config of each architecture family the examples train, and a character-level
tokenizer. Nothing here is needed to train a real model."""

from __future__ import annotations

TINY_ARCHS = ("llama", "qwen3_5", "nemotron_h", "lfm2")
CHAR_SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")  # the character tokenizer's first ids: 0, 1, 2


def tiny_config(arch: str, vocab_size: int, max_tokens: int):
    """A tiny config of `arch` (one of `TINY_ARCHS`): 64 hidden, 4 heads (2 K/V heads) of dim 64, a size
    every kernel runs (FA4 too); `llama` has 2 layers, the hybrids 4: `qwen3_5` 2 gated delta-rule then
    2 full-attention layers, `nemotron_h` Mamba2, attention, Mamba2 and MLP layers, `lfm2` short gated
    convolutions and full attention, alternating. Positions up to max(`max_tokens`, 2048)."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max(max_tokens, 2048), tie_word_embeddings=False)
    if arch == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**common, head_dim=64, num_hidden_layers=4,
                                 layer_types=["linear_attention"] * 2 + ["full_attention"] * 2,
                                 linear_num_key_heads=4, linear_num_value_heads=8,
                                 linear_key_head_dim=16, linear_value_head_dim=16)
    if arch == "nemotron_h":  # 4 Mamba2 heads of 16 in 2 groups
        from transformers import NemotronHConfig

        return NemotronHConfig(**common, head_dim=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
                               mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=64)
    if arch == "lfm2":  # convolution kernel 3
        from transformers import Lfm2Config

        return Lfm2Config(**common, num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2, conv_L_cache=3,
                          block_auto_adjust_ff_dim=False)
    if arch != "llama":
        raise ValueError(f"arch is {arch!r}; expected one of {TINY_ARCHS}")
    from transformers import LlamaConfig

    return LlamaConfig(**common, head_dim=64, num_hidden_layers=2)


def char_tokenizer():
    """One token per printable ASCII character (and newline, tab) after `CHAR_SPECIAL_TOKENS` (<pad>,
    <eos>, <unk>): a `PreTrainedTokenizerFast` built in memory."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {token: i for i, token in enumerate(list(CHAR_SPECIAL_TOKENS) + chars)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
