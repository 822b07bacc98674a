"""Qwen2-VL / Qwen2.5-VL: run embeddings, the vision tower and 3-D mRoPE positions on the
full pack, and shard only the text decoder stack.

Why: the model merges image features into the token embeddings by position
(`masked_scatter` over image placeholder tokens) and computes 3-D mRoPE position ids from
the whole sequence (`get_rope_index`: image grids shift every later position). Neither can
be done on a shard. So the batch is sharded with `shard_primary=False` (every rank gets the
full padded pack: input ids and position ids; images pass through, they are not
sequence-aligned) and this patch slices the text model's inputs (`inputs_embeds` and the
3-D / 4-row `position_ids`) to this rank's rows just before the decoder layers; labels are
already sharded. With images or videos, pass the pack's 3-D position ids (every document's
`get_rope_index`, concatenated) and `document_ids`: the shard step would otherwise supply
1-D text positions, so the patch refuses that case. The vision tower runs unsharded on every rank,
with bidirectional attention that `blockdiag_cp` passes to stock SDPA. Each rank's loss
depends on its own rows only, so gradients reaching the embeddings and the vision tower are
this rank's share, and their mean over the CP group is the non-CP gradient (invariant I2).
"""

from __future__ import annotations

import torch

from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .registry import ModelPatch, register_patch


def _step(kwargs):
    return kwargs.get(STEP_KWARG) or active_step()


_VISION_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_encoder_outputs")


def _require_full_pack(module, args, kwargs):
    """Outer VL model: under CP it must receive the full padded pack (shard_primary=False), and
    with images or videos the 3-D mRoPE positions of that pack."""
    step = _step(kwargs)
    if step is None:
        return None
    pos = kwargs.get("position_ids")
    if any(kwargs.get(k) is not None for k in _VISION_INPUTS) and (pos is None or pos.ndim != 3):
        # The shard step supplies 1-D text positions when none are given; with vision tokens the
        # model would silently rotate them as text.
        raise ValueError(
            f"blockdiag_cp ({type(module).__name__}): a CP step with images or videos needs position_ids [3,1,S] "
            "(mRoPE) for the whole pack, given with document_ids: concatenate model.model.get_rope_index(...) of "
            "every document (got "
            f"{'none' if pos is None else tuple(pos.shape)})"
        )
    if step.world_size == 1:
        return None
    padded, local = step.layout.padded_seq_len, step.local_len
    for key in ("input_ids", "inputs_embeds", "position_ids"):
        t = kwargs.get(key)
        if t is None:
            continue
        length = t.shape[-1] if key == "position_ids" else t.shape[1]
        if length != padded:
            hint = (
                "build the batch with make_cp_blockdiag_batch_and_ctx(..., shard_primary=False) so that embeddings, "
                "image features and mRoPE positions are computed on the full pack"
                if length == local
                else "feed the local batch returned by make_cp_blockdiag_batch_and_ctx"
            )
            raise ValueError(
                f"blockdiag_cp ({type(module).__name__}): {key} has sequence length {length}, expected the full "
                f"padded pack ({padded} tokens) under CP; {hint}"
            )
    return None


def _shard_text_inputs(module, args, kwargs):
    """Text model: keep only this rank's rows of the full-pack embeddings and positions."""
    step = _step(kwargs)
    if step is None or step.world_size == 1:
        return None
    padded, rows = step.layout.padded_seq_len, step.layout.slot_positions[step.rank]
    for key in ("inputs_embeds", "input_ids"):
        t = kwargs.get(key)
        if t is not None and t.shape[1] == padded:
            kwargs[key] = t.index_select(1, rows.to(t.device))
    pos = kwargs.get("position_ids")
    if pos is not None and pos.shape[-1] == padded:
        kwargs["position_ids"] = pos.index_select(pos.ndim - 1, rows.to(pos.device))
    return args, kwargs


def apply(model: torch.nn.Module) -> None:
    hooked = 0
    for module in model.modules():
        if hasattr(module, "language_model") and hasattr(module, "visual"):
            module.register_forward_pre_hook(_require_full_pack, with_kwargs=True)
            module.language_model.register_forward_pre_hook(_shard_text_inputs, with_kwargs=True)
            hooked += 1
    if hooked == 0:
        raise RuntimeError(
            f"model_patches.qwen2_vl: no module with .visual and .language_model found in {type(model).__name__}; "
            "apply the patch to the Qwen2-VL model itself"
        )


PATCH = register_patch(
    ModelPatch(
        name="qwen2_vl_text_stack",
        model_types=("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"),
        needed=lambda config: True,
        apply=apply,
        why="embeddings, image features and 3-D mRoPE positions need the full pack; only the text stack is sharded",
    )
)
