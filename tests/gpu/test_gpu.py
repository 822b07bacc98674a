"""GPU kernels: exactness in fp32, bf16 parity (the criterion in docs/testing.md, "The
reference"), multi-rank runs through gloo with CUDA tensors on one GPU, and no host syncs inside
attention (invariant I4, docs/design.md). Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.kernels import get_kernel, unsupported_reason
from helpers.bf16_parity import assert_bf16, bf16_errors, cp_loss_and_grads
from helpers.packs import make_pack
from helpers.reference import build_models, reference_loss_and_grads, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILIES = (("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 7}))


def _config(backend: str, exchange: str = "allgather", overlap: bool | str = False) -> bdcp.CPConfig:
    return bdcp.CPConfig(attn_backend=backend, kv_exchange=exchange, overlap=overlap)


def bf16_parity_case(rank, world_size, group, backend, layout="straddle", families=FAMILIES, exchange="allgather",
                     overlap=False, head_dim=GPU_MODEL["head_dim"]):
    """Errors vs the fp32 unpacked reference: CP in bf16 and the stock model in bf16 (eager, per document)."""
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for family, overrides in families:
        ref32, model = build_models(family, **{**GPU_MODEL, "head_dim": head_dim}, **overrides)
        ref32 = ref32.cuda()
        docs, batch = make_pack(layout, world_size)
        docs_cuda = [d.cuda() for d in docs]
        loss32, grads32 = reference_loss_and_grads(ref32, docs_cuda)
        stock16 = copy.deepcopy(ref32).to(torch.bfloat16)
        loss_s, grads_s = reference_loss_and_grads(stock16, docs_cuda)
        model = model.cuda().to(torch.bfloat16)
        loss_cp, grads_cp, _ = cp_loss_and_grads(model, batch, group, world_size, _config(backend, exchange, overlap))
        out[family] = bf16_errors((loss32, grads32), (loss_s, grads_s), (loss_cp, grads_cp))
    return out


def fp32_parity_case(rank, world_size, group, backend, layout="straddle", families=FAMILIES):
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    worst = 0.0
    for family, overrides in families:
        ref, model = build_models(family, **GPU_MODEL, **overrides)
        ref, model = ref.cuda(), model.cuda()
        docs, batch = make_pack(layout, world_size)
        loss_ref, grads_ref = reference_loss_and_grads(ref, [d.cuda() for d in docs])
        loss, grads, _ = cp_loss_and_grads(model, batch, group, world_size, _config(backend))
        worst = max([worst, rel_err(loss.cpu(), loss_ref.cpu())] + [rel_err(grads[n].cpu(), grads_ref[n].cpu()) for n in grads_ref])
    return worst


@pytest.mark.parametrize("backend", ["flex", "dense"])
def test_fp32_parity_cp1(gloo, backend):
    assert gloo(1).run(fp32_parity_case, backend=backend, layout="single_tokens")[0] <= 1e-4


@pytest.mark.parametrize("backend", ["varlen", "flex", "dense"])
@pytest.mark.parametrize("layout", ["straddle", "single_tokens", "single_doc"])
def test_bf16_parity_cp1(gloo, backend, layout):
    assert_bf16(gloo(1).run(bf16_parity_case, backend=backend, layout=layout))


@pytest.mark.parametrize("backend", ["varlen", "flex", "dense"])
@pytest.mark.parametrize("world_size,layout", [(2, "straddle"), (2, "padding_rank"), (4, "span_all"), (4, "padding_rank")])
def test_bf16_parity_gloo_on_gpu(gloo, backend, world_size, layout):
    assert_bf16(gloo(world_size).run(bf16_parity_case, timeout=900, backend=backend, layout=layout))


def _verified_head_dim(backend: str) -> int:
    """The tiny models' head dim, or 64 for fa4 (the dim it was verified at); skip a kernel that cannot run."""
    head_dim = 64 if backend == "fa4" else GPU_MODEL["head_dim"]
    reason = unsupported_reason(backend, torch.device("cuda"), torch.bfloat16, head_dim, head_dim)
    if reason is not None:
        pytest.skip(reason)
    return head_dim


@pytest.mark.parametrize("backend", ["fa4", "varlen", "flex"])
@pytest.mark.parametrize("world_size,layout", [(2, "straddle"), (4, "padding_rank")])
def test_bf16_parity_heads_exchange_on_gpu(gloo, backend, world_size, layout):
    """The head-parallel exchange: the kernel over the whole pack for H/G heads (kv heads < G at G = 4)."""
    assert_bf16(gloo(world_size).run(bf16_parity_case, timeout=900, backend=backend, layout=layout, exchange="heads",
                                     head_dim=_verified_head_dim(backend)))


@pytest.mark.parametrize("split", ["queries", "keys"])
@pytest.mark.parametrize("backend", ["fa4", "varlen", "flex", "dense"])
@pytest.mark.parametrize("world_size,layout", [(2, "straddle"), (4, "span_all"), (4, "padding_rank")])
def test_bf16_parity_overlap_on_gpu(gloo, backend, world_size, layout, split):
    """CPConfig(overlap=split): by queries, each kernel on both query parts (local keys during the
    all-gather, the gathered rows after it); by keys (the kernels that return their log-sum-exp),
    every query over its rank's keys, then over the gathered ones, merged; mistral's windowed layers
    attend in order. fa4 at head dim 64, the dim it was verified at."""
    head_dim = _verified_head_dim(backend)
    if split == "keys" and not get_kernel(backend).returns_lse:
        pytest.skip(f"{backend} returns no log-sum-exp: overlap='keys' refuses it")
    assert_bf16(gloo(world_size).run(bf16_parity_case, timeout=900, backend=backend, layout=layout, overlap=split,
                                     head_dim=head_dim))


@pytest.mark.parametrize("world_size", [2])
def test_fp32_flex_gloo_on_gpu(gloo, world_size):
    assert max(gloo(world_size).run(fp32_parity_case, timeout=900, backend="flex", layout="span_all")) <= 1e-4


def sync_free_case(rank, world_size, group, backend, head_dim=GPU_MODEL["head_dim"]):
    """A full forward+backward with host syncs turned into errors inside every attention call."""
    from transformers import AttentionInterface

    from hf_blockdiag_cp.attention import blockdiag_cp_attention_forward

    torch.cuda.set_device(0)
    config = _config(backend)
    original = blockdiag_cp_attention_forward
    armed = []

    def guarded(*args, **kwargs):
        if not armed:  # warm-up steps compile kernels, which may sync
            return original(*args, **kwargs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    AttentionInterface.register("blockdiag_cp", guarded)
    try:
        _, model = build_models("llama", **{**GPU_MODEL, "head_dim": head_dim})
        model = model.cuda().to(torch.bfloat16)
        for _ in range(2):  # the first step compiles and builds the step's masks
            _, batch = make_pack("straddle", world_size)
            cp_loss_and_grads(model, batch, group, world_size, config)
        model.zero_grad(set_to_none=True)
        batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_pack("straddle", world_size)[1].items()}
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)  # host planning: may sync
        armed.append(True)
        with train_ctx():
            loss = model(**local).loss  # every attention call runs with syncs as errors
            torch.cuda.set_sync_debug_mode("error")  # and the whole backward, recompute included
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        AttentionInterface.register("blockdiag_cp", original)
    return True


@pytest.mark.parametrize("backend", ["varlen", "flex", "dense", "fa4"])
def test_no_host_sync_in_attention(gloo, backend):
    assert gloo(1).run(sync_free_case, backend=backend, head_dim=_verified_head_dim(backend)) == [True]
