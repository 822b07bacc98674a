"""Input embeddings whose weight gradient is summed in float32 and rounded once.

Why: CUDA's embedding backward (`embedding_dense_backward`) sums a token's gradient rows in the
weight's dtype, one `+=` per chunk of 32 indices, when a call sees at most 3,072 indices, and in
float32 with a single rounding above that. CP shards the pack, so each rank's embedding sees a 1/cp
share of the tokens and falls under that threshold where the unsharded step would not: in bf16 the
input embedding's gradient of a frequent token picks up one rounding per chunk it appears in. The
step installs `Fp32GradEmbedding` on the input embeddings of the model it prepares
(`fp32_embedding_grads`); it sums each row's gradient in float32 (`index_add_`) and rounds once to
the weight's dtype, on every device and at every shard size. Float32 weights, frozen weights and
embeddings with `max_norm`, `sparse` or `scale_grad_by_freq` keep the stock path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.bfloat16, torch.float16)


class _Fp32Accumulated(torch.autograd.Function):
    """`F.embedding(ids, weight, padding_idx)` whose weight gradient is summed in float32; the
    padding row gets no gradient, as in the stock backward."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None):
        ctx.save_for_backward(ids)
        ctx.weight_shape, ctx.weight_dtype, ctx.padding_idx = weight.shape, weight.dtype, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        total = grad.new_zeros(ctx.weight_shape, dtype=torch.float32)
        total.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).float())
        if ctx.padding_idx is not None:
            total[ctx.padding_idx] = 0
        return None, total.to(ctx.weight_dtype), None


def fp32_grad_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """`F.embedding(ids, weight, padding_idx)`, with the weight gradient summed in float32 where the weight
    is half precision and trains (otherwise the stock call)."""
    if weight.dtype in HALF_DTYPES and weight.requires_grad and torch.is_grad_enabled():
        return _Fp32Accumulated.apply(ids, weight, padding_idx)
    return F.embedding(ids, weight, padding_idx)


class Fp32GradEmbedding(torch.nn.Embedding):
    """`nn.Embedding` whose forward is `fp32_grad_embedding`. Installed by changing an instance's class
    (`fp32_embedding_grads`); a subclass that calls `super().forward` (scaled embeddings) reaches it too."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Embedding's name)
        if self.max_norm is not None or self.sparse or self.scale_grad_by_freq:
            return super().forward(input)
        return fp32_grad_embedding(input, self.weight, self.padding_idx)


_CLASSES: dict[type, type] = {torch.nn.Embedding: Fp32GradEmbedding}


def fp32_embedding_grads(module) -> bool:
    """Make `module` (an `nn.Embedding` or subclass) an `Fp32GradEmbedding`, keeping its own class first
    in the method order (same name). Idempotent; False (nothing done) for anything else."""
    if isinstance(module, Fp32GradEmbedding):
        return True
    cls = type(module)
    if not isinstance(module, torch.nn.Embedding):
        return False
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls, Fp32GradEmbedding),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    module.__class__ = _CLASSES[cls]
    return True
