"""Model types known to bypass the attention interface raise a clear error (I7), never train silently wrong.

Every entry of `UNSUPPORTED_MODEL_TYPES` is built from its stock config (on the meta device:
no weights, no downloads) and `apply_model_patches` must refuse it by name. Hybrids that do
call the attention interface for some layers are also refused by the runtime itself at the
first attention call of a CP step, when nobody called `apply_model_patches`; a pure SSM
without its patch never calls attention, which the step's own check reports.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.model_patches import UNSUPPORTED_MODEL_TYPES, apply_model_patches
from helpers.model_zoo import build_pair

# Stock defaults that do not build as they are.
_CONFIG_FIXES: dict[str, dict] = {}

_SMALL = dict(
    vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# Tiny real hybrids (attention + SSM / linear attention / convolution) that run on CPU.
_HYBRIDS = {
    "recurrent_gemma": dict(head_dim=8, lru_width=32, block_types=["recurrent", "attention"]),
}


def _meta_model(model_type: str):
    config = AutoConfig.for_model(model_type, **_CONFIG_FIXES.get(model_type, {}))
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal-LM head registered for this type
            return AutoModel.from_config(config)


@pytest.mark.parametrize("model_type", sorted(UNSUPPORTED_MODEL_TYPES))
def test_apply_model_patches_refuses(model_type):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type!r} config (added after it)")
    model = _meta_model(model_type)
    with pytest.raises(NotImplementedError) as info:
        apply_model_patches(model)
    message = str(info.value)
    named = {model_type, f"{model_type}_text", model.config.model_type}
    assert any(f"model_type {t!r} is not supported" in message for t in named), message
    assert "AttentionInterface" in message


def _packed_batch():
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}


@pytest.mark.parametrize("model_type", sorted(_HYBRIDS))
def test_hybrid_refused_at_first_attention_call(model_type):
    """Without apply_model_patches: the CP step itself raises, naming the model type."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **_SMALL, **_HYBRIDS[model_type])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, _packed_batch())
    with pytest.raises(NotImplementedError, match=rf"model_type '{model_type}' is not supported"):
        with train_ctx():
            model(**local).loss.backward()


def test_pure_ssm_without_its_patch_reports_no_attention_call():
    config = AutoConfig.for_model("mamba", **{k: _SMALL[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")},
                                  state_size=4, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, _packed_batch())
    with pytest.raises(RuntimeError, match="no attention call"):
        with train_ctx():
            model(**local).loss.backward()


@pytest.mark.parametrize("family", ["phi3", "qwen2_vl"])
def test_missing_patch_is_refused(family):
    """A model that needs a patch (Phi-3 LongRoPE, Qwen2-VL) but did not get it cannot run a CP step."""
    from helpers.model_zoo import tiny_config
    from transformers import Qwen2VLForConditionalGeneration

    config = tiny_config(family)
    cls = Qwen2VLForConditionalGeneration if family == "qwen2_vl" else AutoModelForCausalLM
    model = (cls._from_config if family == "qwen2_vl" else cls.from_config)(config, attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    batch = _packed_batch()
    if family == "qwen2_vl":
        batch["document_ids"] = torch.tensor([[1] * 5 + [2] * 7])
        batch["position_ids"] = batch["position_ids"][None].expand(3, 1, 12)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, shard_primary=family != "qwen2_vl")
    with pytest.raises(RuntimeError, match=r"apply_model_patches\(model\)"):
        with train_ctx():
            model(**local).loss.backward()
    assert build_pair(family)[1]._blockdiag_cp_patches  # with the patch it is marked as applied
