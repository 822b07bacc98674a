"""The kernels that return their log-sum-exp (`KernelRecord.returns_lse`, `kernels.attention.lse`), on a GPU:
the output, the lse and the gradients of q, k, v (and sinks) through both, for the two parts of a
split by keys (the local part causal, the remote part not), with a softcap and with sinks, against
the dense kernel in float64. The criterion is docs/testing.md's: the kernel's bf16 error at most
twice the dense kernel's own bf16 error (the stock computation in bf16), plus a small floor. Then the
merged split against the whole attention. Skipped without CUDA; fa4 also without flash-attn-4."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.attention.dispatch import needed_keys
from hf_blockdiag_cp.kernels import get_kernel, unsupported_reason
from hf_blockdiag_cp.kernels.attention.fa4 import VERIFIED_HEAD_DIMS
from hf_blockdiag_cp.planning import plan_layout
from hf_blockdiag_cp.step import build_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HEADS, KV_HEADS = 8, 2
FEATURES = {"plain": {}, "softcap": {"softcap": 30.0}, "sinks": {"sinks": True}}
FLOOR = 2e-3  # bf16 has 8 bits of mantissa: relative errors of ~4e-3 are one rounding


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run(kernel, target, q, k, v, sinks, softcap, g_out, g_lse):
    """out, lse and the gradients of sum(out * g_out) + sum(lse * g_lse) w.r.t. q, k, v (and sinks)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    extra = {"softcap": softcap} if softcap is not None else {}
    if sink_leaf is not None:
        extra["sinks"] = sink_leaf
    out, lse = kernel.fn(*leaves, target, scale=0.125, sliding_window=None, return_lse=True, **extra)
    assert lse.shape == out.shape[:2] and lse.dtype == torch.promote_types(q.dtype, torch.float32), (lse.shape, lse.dtype)
    ((out.float() * g_out).sum() + (lse * g_lse).sum()).backward()
    grads = [t.grad for t in leaves] + ([] if sink_leaf is None else [sink_leaf.grad])
    return out, lse, grads


def _inputs(target, rows: int, head_dim_k: int, head_dim_v: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n_q = target.plan.q_positions.numel()
    q = torch.randn((n_q, HEADS, head_dim_k), generator=gen, device="cuda", dtype=torch.float64)
    k = torch.randn((rows, KV_HEADS, head_dim_k), generator=gen, device="cuda", dtype=torch.float64)
    v = torch.randn((rows, KV_HEADS, head_dim_v), generator=gen, device="cuda", dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dims", sorted(VERIFIED_HEAD_DIMS))  # those outside LSE_VERIFIED_HEAD_DIMS skip
def test_fa4_lse_and_its_backward_match_float64(feature, head_dims):
    reason = unsupported_reason("fa4", torch.device("cuda"), torch.bfloat16, *head_dims, needs_lse=True)
    if reason is not None:
        pytest.skip(reason)
    head_dim_k, head_dim_v = head_dims
    dense, fa4 = get_kernel("dense"), get_kernel("fa4")
    layout = plan_layout([300, 1000, 77, 500, 1, 180], 2)
    softcap = FEATURES[feature].get("softcap")
    report = []
    for rank in range(2):
        step = build_step(layout, rank, None, torch.device("cuda"), "fa4", "allgather", overlap="keys")
        for name, part in (("local", step.overlap.local), ("remote", step.overlap.remote)):
            if part is None:
                continue
            assert part.plan.causal == (name == "local")
            q, k, v = _inputs(part, part.plan.k_positions.numel(), head_dim_k, head_dim_v, seed=rank)
            # The kernels get the part's needed keys in order (as `local_attention` gives them).
            sinks = torch.randn(HEADS, device="cuda", dtype=torch.float64) if FEATURES[feature].get("sinks") else None
            g_out = torch.randn(q.shape[0], HEADS, head_dim_v, device="cuda")
            g_lse = torch.randn(q.shape[0], HEADS, device="cuda")
            want = _run(dense, part, q, k, v, sinks, softcap, g_out, g_lse)
            half = [t.bfloat16() for t in (q, k, v)]
            stock = _run(dense, part, *half, None if sinks is None else sinks.bfloat16(), softcap, g_out, g_lse)
            got = _run(fa4, part, *half, None if sinks is None else sinks.bfloat16(), softcap, g_out, g_lse)
            names = ["out", "lse", "dq", "dk", "dv", "dsinks"]
            flat = lambda r: [r[0], r[1], *r[2]]  # noqa: E731
            for what, w, s, g in zip(names, flat(want), flat(stock), flat(got)):
                err, stock_err = _rel(g, w), _rel(s, w)
                report.append(f"rank {rank} {name} {what}: fa4 {err:.2e}, dense bf16 {stock_err:.2e}")
                assert err <= 2 * stock_err + FLOOR, report[-1]
    print("\n".join(report))


@pytest.mark.parametrize("kernel", ["fa4", "dense"])
def test_the_merged_split_equals_the_whole_attention(kernel):
    """Both parts of every rank, merged by `StepOverlap.merge_by_keys` (`kernels.attention.lse.merge_into`),
    against the float64 dense attention of the whole plan: outputs and q, k, v gradients."""
    head_dim = 64
    reason = unsupported_reason(kernel, torch.device("cuda"), torch.bfloat16, head_dim, head_dim, needs_lse=True)
    if reason is not None:
        pytest.skip(reason)
    layout = plan_layout([300, 1000, 77, 500, 1, 180], 2)
    record, dense = get_kernel(kernel), get_kernel("dense")
    for rank in range(2):
        step = build_step(layout, rank, None, torch.device("cuda"), kernel, "allgather", overlap="keys")
        split, rows = step.overlap, layout.cp_size * layout.local_len
        gen = torch.Generator(device="cuda").manual_seed(rank)
        q = torch.randn((layout.local_len, HEADS, head_dim), generator=gen, device="cuda", dtype=torch.float64)
        k_all = torch.randn((rows, KV_HEADS, head_dim), generator=gen, device="cuda", dtype=torch.float64)
        v_all = torch.randn((rows, KV_HEADS, head_dim), generator=gen, device="cuda", dtype=torch.float64)
        g = torch.randn(layout.local_len, HEADS, head_dim, device="cuda", dtype=torch.float64)

        def attend(fn, q, k_all, v_all):
            own = slice(rank * layout.local_len, (rank + 1) * layout.local_len)
            local = fn(split.local, q, k_all[own], v_all[own])
            if split.remote is None:
                return local[0]
            remote = fn(split.remote, split.remote.take(q), k_all, v_all)
            return split.merge_by_keys(local[0], local[1], remote[0], remote[1])

        def with_kernel(rec):
            def fn(part, q, k, v):
                kk, vv = needed_keys(part.plan, k, v)
                return rec.fn(q, kk, vv, part, scale=0.125, sliding_window=None, return_lse=True)
            return fn

        results = {}
        for name, rec, dtype in (("want", dense, torch.float64), ("got", record, torch.bfloat16),
                                 ("stock", dense, torch.bfloat16)):
            leaves = [t.detach().to(dtype).clone().requires_grad_(True) for t in (q, k_all, v_all)]
            out = attend(with_kernel(rec), *leaves)
            (out.double() * g).sum().backward()
            results[name] = [out] + [t.grad for t in leaves]
        # The whole attention of the step's full plan, float64, no split.
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k_all, v_all)]
        kk, vv = needed_keys(step.plan, leaves[1], leaves[2])
        whole = dense.fn(leaves[0], kk, vv, step, scale=0.125, sliding_window=None)
        (whole * g).sum().backward()
        whole_results = [whole] + [t.grad for t in leaves]
        for what, w, s, got, exact in zip(("out", "dq", "dk", "dv"), whole_results, results["stock"], results["got"],
                                          results["want"]):
            assert _rel(exact, w) <= 1e-10, (rank, what, "the float64 split is the whole attention")
            assert _rel(got, w) <= 2 * _rel(s, w) + FLOOR, (rank, what, _rel(got, w), _rel(s, w))
