"""The chunked log-prob head on a GPU in bf16 (`logprobs.head.token_log_probs`), against float64.

Under bf16 autocast the head projects in bf16 and reduces in fp32; the yardstick is the dense
computation a model does in bf16 (the full `[tokens, vocab]` logits in bf16, then an fp32
log-softmax). Against the float64 computation, the head's log-probs and its gradients of the hidden
states and the weight must stay within 1.5x the dense bf16 error (docs/testing.md, "The reference"),
and its peak memory (`torch.cuda.max_memory_allocated`) must not grow with the tokens' logits: from
TOKENS to 4 x TOKENS tokens it grows by the hidden states and their gradient, not by the logits.
"""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.logprobs import LogitTransform, token_log_probs
from helpers.reference import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOKENS, HIDDEN, VOCAB, CHUNK = 8192, 1024, 32000, 512


def _inputs(seed: int = 0, tokens: int = TOKENS):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=g)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5
    targets = torch.randint(VOCAB, (tokens,), device="cuda", generator=g)
    upstream = torch.randn(tokens, device="cuda", generator=g)
    return hidden, weight, targets, upstream


def _dense(hidden, weight, targets, transform, dtype):
    logits = transform.apply((hidden.to(dtype) @ weight.to(dtype).t()).float())
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).squeeze(1)


def _run(fn, hidden, weight, upstream):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(h, w)
    (out * upstream).sum().backward()
    return out.detach().double(), h.grad.double(), w.grad.double()


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=30.0, temperature=0.7)],
                         ids=["plain", "scale-softcap-temperature"])
def test_chunked_head_bf16_within_the_dense_bf16_error(transform):
    hidden, weight, targets, upstream = _inputs()
    exact = _run(lambda h, w: _dense(h.double(), w.double(), targets, transform, torch.float64), hidden, weight, upstream)
    dense = _run(lambda h, w: _dense(h, w, targets, transform, torch.bfloat16), hidden, weight, upstream)
    ours = _ours(hidden, weight, targets, upstream, transform)
    names = ("log-probs", "d hidden", "d weight")
    errors = {n: (rel_err(o, e), rel_err(d, e)) for n, o, d, e in zip(names, ours, dense, exact)}
    print("\n" + ", ".join(f"{n}: ours {o:.2e} dense bf16 {d:.2e}" for n, (o, d) in errors.items()))
    for name, (o, d) in errors.items():
        assert o <= 1.5 * d, f"{name}: ours {o:.2e} > 1.5x the dense bf16 error {d:.2e}"


def _ours(hidden, weight, targets, upstream, transform):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return _run(lambda h, w: token_log_probs(h, w, None, targets, transform, CHUNK)[0], hidden, weight, upstream)


def _peak(tokens: int) -> int:
    """Bytes the head allocates at most, forward and backward, beyond its inputs, for `tokens` rows."""
    inputs = _inputs(tokens=tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    _ours(*inputs[:3], inputs[3], LogitTransform())
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_head_memory_does_not_grow_with_the_logits():
    """Per row the test and the head keep four fp32 hidden-sized rows (the input, its copy, its
    gradient and the head's fp32 gradient accumulator); the growth from TOKENS to 4 x TOKENS rows must
    be those (within 25 %), far below the logits of the extra rows."""
    small, large = _peak(TOKENS), _peak(4 * TOKENS)
    rows = 4 * 3 * TOKENS * HIDDEN * 4
    extra_logits = 3 * TOKENS * VOCAB * 4  # the fp32 logits of the 3 x TOKENS extra rows
    print(f"\npeak {small / 2**20:.0f} MiB at {TOKENS} tokens, {large / 2**20:.0f} MiB at {4 * TOKENS}; the extra rows' "
          f"hidden-sized buffers {rows / 2**20:.0f} MiB, their logits would add {extra_logits / 2**20:.0f} MiB")
    assert large - small <= 1.25 * rows < extra_logits
