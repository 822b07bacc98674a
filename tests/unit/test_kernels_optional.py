"""The optional flash-attn and Transformer Engine kernels (experimental).

Always run (CPU): the registration (never chosen by `auto`, refused with the reason when the
package is missing), and the whole flash kernel against the dense kernel with a float64 CPU
stand-in for flash-attn (bottom-right causal alignment, as flash-attn >= 2.1), forward and
backward. The real kernels on a CUDA machine are in gpu/test_kernels_optional_gpu.py.
"""

from __future__ import annotations

import types

import pytest
import torch

from hf_blockdiag_cp.kernels import choose_kernel, kernel_names, unsupported_reason
from hf_blockdiag_cp.kernels.attention import flash as flash_mod
from hf_blockdiag_cp.kernels.attention.dense import dense_attention
from hf_blockdiag_cp.planning import plan_layout
from hf_blockdiag_cp.step import build_step
from helpers.layouts import make_layout, pack_ids

CPU = torch.device("cpu")

# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize("name", ["flash", "te"])
def test_registered_but_never_auto(name, monkeypatch):
    assert name in kernel_names()
    for device in ("cpu", "cuda"):
        assert choose_kernel("auto", torch.device(device), torch.bfloat16, 64, 64).name != name
    reason = unsupported_reason(name, torch.device("cuda"), torch.bfloat16, 64, 64, frozenset({"softcap"}))
    assert reason is not None and "softcap" in reason


@pytest.mark.parametrize("name", ["flash", "te"])
def test_missing_package_is_refused_with_the_reason(name):
    module = flash_mod if name == "flash" else __import__("hf_blockdiag_cp.kernels.attention.te", fromlist=["available"])
    if module.available():
        pytest.skip(f"{name} imports here")
    with pytest.raises(ValueError, match="does not import"):
        choose_kernel(name, torch.device("cuda"), torch.bfloat16, 64, 64)


# --------------------------------------------------------------------------- the flash kernel on a CPU stand-in


def _reference_segment(q, k, v, scale, bottom_right, window):
    """q [lq,H,D], k/v [lk,Hkv,D] -> [lq,H,D]: causal (aligned as asked) softmax attention in the inputs' dtype."""
    lq, lk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    shift = lk - lq if bottom_right else 0
    i = torch.arange(lq)[:, None] + shift
    j = torch.arange(lk)[None, :]
    allowed = j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # top-left with lk > lq leaves no row empty; kept safe
    return torch.einsum("hqk,khd->qhd", probs, v)


def fake_flash():
    """A float64 CPU stand-in with flash-attn's varlen call signature (bottom-right causal alignment)."""

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, window_size=(-1, -1)):
        assert causal and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        cq, ck = cu_q.tolist(), cu_k.tolist()
        assert max_q == max(b - a for a, b in zip(cq, cq[1:])) and max_k == max(b - a for a, b in zip(ck, ck[1:]))
        outs = [
            _reference_segment(q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]], softmax_scale, True, window_size)
            for i in range(len(cq) - 1)
        ]
        return torch.cat(outs)

    return types.SimpleNamespace(__version__="2.7.0", flash_attn_varlen_func=varlen)


@pytest.fixture
def stand_in(monkeypatch):
    def install():
        fake = fake_flash()
        monkeypatch.setattr(flash_mod, "_flash_module", lambda: fake)
        monkeypatch.setattr(flash_mod, "_accepts_window", lambda: True)
        return fake

    return install


LENGTHS = [5, 23, 3, 9, 1, 14]


@pytest.mark.parametrize("strategy, exchange", [("contiguous", "allgather"), ("balanced", "allgather"), ("balanced", "a2a"), ("headtail", "allgather")])
@pytest.mark.parametrize("window", [None, 4])
def test_flash_kernel_matches_dense_on_a_stand_in(stand_in, strategy, exchange, window):
    stand_in()
    cp_size, heads, kv_heads, dim = 3, 4, 2, 8
    layout = make_layout(pack_ids([(False, n) for n in LENGTHS]), cp_size, strategy)
    gen = torch.Generator().manual_seed(0)
    asymmetric_seen = False
    for rank in range(cp_size):
        step = build_step(layout, rank, None, CPU, "dense", exchange)
        rp = step.rank_plan
        q_lens = rp.cu_seqlens_q[1:] - rp.cu_seqlens_q[:-1]
        k_lens = rp.cu_seqlens_k[1:] - rp.cu_seqlens_k[:-1]
        asymmetric_seen |= bool((k_lens > q_lens).any())
        n_q, n_k = layout.local_len, rp.num_keys
        q = torch.randn(n_q, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(n_k, kv_heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(n_k, kv_heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
        # Padding rows carry no label, and under a needed-only exchange a padding run may see padding keys
        # that are not consecutive positions (varlen windows count rows): compare real rows, and give
        # padding rows no gradient, as the loss does.
        real = (layout.document_ids[rp.q_positions] > 0)[:, None, None]
        grad = torch.randn(n_q, heads, dim, generator=gen, dtype=torch.float64) * real
        want = dense_attention(q, k, v, step, scale=dim**-0.5, sliding_window=window)
        got = flash_mod.flash_attention_kernel(q, k, v, step, scale=dim**-0.5, sliding_window=window)
        torch.testing.assert_close(got * real, want * real, rtol=1e-10, atol=1e-10)
        if window is None:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    assert asymmetric_seen  # the layouts exercise the alignment that the guard is for


# --------------------------------------------------------------------------- the te kernel on a CPU stand-in


class _FakeDotProductAttention(torch.nn.Module):
    """Transformer Engine's constructor and forward keywords, float64 CPU math, `thd` in and `[T, H*D]` out."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0, qkv_format="sbhd",
                 attn_mask_type="causal", softmax_scale=None):
        super().__init__()
        assert qkv_format == "thd" and attn_mask_type == "padding_causal_bottom_right" and attention_dropout == 0.0
        self.heads, self.scale = num_attention_heads, softmax_scale

    def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, window_size=None):
        assert q.shape[1] == self.heads
        out = fake_flash().flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, softmax_scale=self.scale, causal=True,
            window_size=window_size or (-1, 0),
        )
        return out.reshape(out.shape[0], -1)


@pytest.mark.parametrize("window", [None, 3])
def test_te_kernel_plumbing_on_a_stand_in(monkeypatch, window):
    from hf_blockdiag_cp.kernels.attention import te as te_mod

    fake = types.SimpleNamespace(DotProductAttention=_FakeDotProductAttention)
    monkeypatch.setattr(te_mod, "_te_module", lambda: fake)
    monkeypatch.setattr(te_mod, "_forward_accepts_window", lambda: True)
    te_mod._attention.cache_clear()
    try:
        layout = plan_layout(LENGTHS, 3)
        gen = torch.Generator().manual_seed(2)
        for rank in range(3):
            step = build_step(layout, rank, None, CPU, "dense", "allgather")
            n_k = step.rank_plan.num_keys
            q = torch.randn(layout.local_len, 4, 8, generator=gen, dtype=torch.float64)
            k = torch.randn(n_k, 2, 8, generator=gen, dtype=torch.float64)
            v = torch.randn(n_k, 2, 8, generator=gen, dtype=torch.float64)
            want = dense_attention(q, k, v, step, scale=0.3, sliding_window=window)
            got = te_mod.te_attention_kernel(q, k, v, step, scale=0.3, sliding_window=window)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    finally:
        te_mod._attention.cache_clear()
