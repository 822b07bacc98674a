"""The chunked head's tile functions compiled (`logprobs.tiles`, torch.compile with inductor on CPU: the
code path CUDA takes by default) against the same functions run eagerly and against float64.

- `token_log_probs(tiles="compiled")` and `tiles="eager"`, fp32 and bf16 inputs, a transform with a
  scale, a softcap and a temperature, a bias, every statistic, two tile sizes with a ragged last tile:
  log-probs, statistics and the gradients of hidden, weight and bias against each other (the same
  tile, fp32 math in another order) and against float64 computed from the tile the head projects
  (fp32: from the fp32 inputs; bf16: from the bf16 tile, gradients through the bf16 cast of the
  tile's gradient); the second tile size compiles nothing.
- `CPConfig.head_tiles` reaches the head through a step: a whole-model `compile_model` (aot_eager)
  with the compiled tiles inside it gives the eager model's per-document sums and gradients.
- Bad values of the switch are refused by name.
The eager tiles against float64 for every transform and chunk size: test_logprobs.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.torch import compile_counters
from hf_blockdiag_cp.integrations.compile import compile_model
from hf_blockdiag_cp.logprobs import STATS, LogitTransform, document_log_probs, token_log_probs
from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.compile_probe import RecordingBackend
from helpers.reference import build_models, make_docs, rel_err

N, H, V = 37, 16, 50
TRANSFORM = LogitTransform(scale=2.5, softcap=3.0, temperature=0.7)
CHUNKS = (8, 5)  # tiles of 8, 8, 8, 8, 5 rows, then 5 x 7 and 2: no one-row tile (dynamo specialises size 1)
FP32_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 math against float64 or in another order
BF16_GRAD_TOL = dict(rtol=2e-2, atol=1e-2)  # the tile's gradient and the results are cast to bf16


def inputs(dtype: torch.dtype):
    """hidden [N, H], weight [V, H], bias [V] in `dtype` (leaves), targets [N] (half the argmax: is_top1
    sees both answers), upstream gradient [N] (fp32)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.5).to(dtype)  # raw logits of std ~2: the softcap bends them
    bias = torch.randn(V, generator=g).to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[::2] = (hidden.double() @ weight.double().t() + bias.double()).argmax(-1)[::2]
    upstream = torch.randn(N, generator=g)
    return hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_(), targets, upstream


def run_head(hidden, weight, bias, targets, upstream, chunk, tiles):
    """(log-probs, stats, grads of hidden, weight, bias) of the head."""
    for leaf in (hidden, weight, bias):
        leaf.grad = None
    log_probs, stats = token_log_probs(hidden, weight, bias, targets, TRANSFORM, chunk, STATS, tiles)
    (log_probs * upstream).sum().backward()
    return log_probs.detach(), stats, [leaf.grad for leaf in (hidden, weight, bias)]


def float64_reference(hidden, weight, bias, targets, upstream):
    """The same quantities in float64 from the tile the head projects (fp32: exact products; bf16: the
    bf16 tile), the hidden and weight gradients through the tile's gradient cast to the inputs' dtype."""
    h, w, b = (t.detach() for t in (hidden, weight, bias))
    if h.dtype == torch.float32:
        raw = h.double() @ w.double().t() + b.double()
    else:
        raw = (h @ w.t() + b).double()  # the head's bf16 tile, the tile functions' input
    raw.requires_grad_(True)
    z = raw * TRANSFORM.scale
    z = TRANSFORM.softcap * torch.tanh(z / TRANSFORM.softcap) / TRANSFORM.temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    log_probs = logp.gather(1, targets[:, None]).squeeze(1)
    stats = {"entropy": -(p * logp).sum(-1), "mean_logits": z.mean(-1), "is_top1": z.argmax(-1) == targets,
             "log_sum_sq_probs": torch.log((p * p).sum(-1))}
    (log_probs * upstream.double()).sum().backward()
    tile_grad = raw.grad.to(h.dtype).double()
    grads = [tile_grad @ w.double(), tile_grad.t() @ h.double(), raw.grad.sum(0)]
    return log_probs.detach(), {k: v.detach() for k, v in stats.items()}, grads


def assert_stats_close(got: dict, want: dict, what: str):
    assert set(got) == set(STATS), what
    assert torch.equal(got["is_top1"], want["is_top1"]), what
    for name in ("entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(got[name], want[name].float(), **FP32_TOL, msg=f"{what}: {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_tiles_match_eager_and_float64(dtype):
    hidden, weight, bias, targets, upstream = inputs(dtype)
    want, want_stats, want_grads = float64_reference(hidden, weight, bias, targets, upstream)
    assert 0 < int(want_stats["is_top1"].sum()) < N
    grad_tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    compiled_after = []
    for chunk in CHUNKS:
        eager = run_head(hidden, weight, bias, targets, upstream, chunk, "eager")
        compiled = run_head(hidden, weight, bias, targets, upstream, chunk, "compiled")
        compiled_after.append(compile_counters())
        for what, (log_probs, stats, grads) in (("eager", eager), ("compiled", compiled)):
            what = f"{what}, chunk {chunk}"
            torch.testing.assert_close(log_probs, want.float(), **FP32_TOL, msg=what)
            assert_stats_close(stats, want_stats, what)
            for name, got, ref in zip(("hidden", "weight", "bias"), grads, want_grads):
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), ref.float(), **grad_tol, msg=f"{what}: grad {name}")
        # compiled against eager: the same tile, fp32 math in another order; bf16 results within one rounding
        torch.testing.assert_close(compiled[0], eager[0], **FP32_TOL)
        assert_stats_close(compiled[1], eager[1], f"compiled against eager, chunk {chunk}")
        for got, ref in zip(compiled[2], eager[2]):
            torch.testing.assert_close(got, ref, **(FP32_TOL if dtype == torch.float32 else {}))
    assert compiled_after[1] == compiled_after[0], f"another tile size compiled again: {compiled_after}"


def test_head_tiles_switch_refuses_unknown_values():
    with pytest.raises(ValueError, match=r"head_tiles='fast' is not supported; accepted values: auto, compiled, eager"):
        bdcp.CPConfig(head_tiles="fast")
    hidden, weight, bias, targets, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"tiles='fast' is not supported"):
        token_log_probs(hidden, weight, bias, targets, tiles="fast")


def pack_log_probs(model, batch, config):
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model, config=config)
    with train_ctx():
        result = document_log_probs(model, local, stats=("entropy",))
        weights = torch.randn(result.num_documents, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        (weights * result.sums).sum().backward()
    return result


def test_compiled_tiles_inside_a_compiled_model():
    """`CPConfig(head_tiles="compiled")` on a step of a model under `compile_model(..., "model")`
    (aot_eager): the head stays outside the model's graphs and runs its inductor-compiled tiles; sums,
    entropy sums and every parameter gradient equal the eager model's with eager tiles."""
    torch.compiler.reset()
    recording = RecordingBackend("aot_eager")
    _, eager = build_models("llama")
    compiled = copy.deepcopy(eager)
    compile_model(compiled, "model", backend=recording)
    lengths = [6, 9, 4, 7]
    ids = torch.cat(make_docs(lengths, 1))[None]
    batch = {"input_ids": ids, "labels": ids.clone(),
             "document_ids": document_ids_from_lengths(lengths, ids.shape[1])[None]}
    want = pack_log_probs(eager, batch, bdcp.CPConfig(head_tiles="eager"))
    before = compile_counters()["graphs_compiled"] - len(recording.graphs)
    got = pack_log_probs(compiled, batch, bdcp.CPConfig(head_tiles="compiled"))
    assert recording.graphs, "the model did not compile"
    tile_graphs = compile_counters()["graphs_compiled"] - len(recording.graphs) - before
    assert tile_graphs >= 2, f"the tile functions did not compile (forward and backward): {tile_graphs} graphs"
    assert rel_err(got.sums.detach(), want.sums.detach()) <= 1e-5
    assert rel_err(got.stat_sums["entropy"], want.stat_sums["entropy"]) <= 1e-5
    grads = {n: p.grad for n, p in compiled.named_parameters() if p.grad is not None}
    want_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert set(grads) == set(want_grads) and want_grads
    for name, g in want_grads.items():
        assert rel_err(grads[name], g) <= 1e-5, name
