"""Per-token log-probs of target tokens from hidden states, in token chunks: no `[tokens, vocab]` logits.

`token_log_probs(hidden [N, H], weight [V, H], bias, targets [N], transform)` projects `chunk_size`
rows at a time through the output embedding, turns each `[chunk, V]` tile into the log-prob of its
targets (and, on request, per-token statistics), and keeps nothing of the tile: the forward holds one
tile at a time and saves the hidden rows and one log-sum-exp per row. The backward recomputes each
tile and accumulates the gradients of the hidden rows, the weight and the bias in fp32: next to one
tile it holds an fp32 `[V, H]` buffer for the weight's gradient (4 bytes per weight element, twice a
bf16 gradient) and an fp32 `[N, H]` one for the rows', each cast to its tensor's dtype at the end (a
copy unless fp32). Both passes also hold the weight in the compute dtype when autocast computes in
another.

A tile stays in the compute dtype (the matmul's rounding); its softmax math is fp32 in the tile
functions (`tiles`), which `tiles="auto"` (`CPConfig.head_tiles` for the trainers) runs through
`torch.compile` on CUDA, fused into kernels that read the tile once and hold no fp32 copy of it, and
eagerly elsewhere (fp32 temporaries of the tile, op by op); "compiled" and "eager" (the default)
force either.

`LogitTransform` is what the model's forward does to the output embedding's result before the
softmax (a scale, Gemma's final soft-capping) and a sampling temperature; `capture.py` checks it
against the model's own logits once per model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tiles import TILE_MODES, tile_functions

# Per-token statistics the head computes on request (no gradient), next to the log-probs.
STATS = ("entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
DEFAULT_TILE_ELEMENTS = 1 << 26  # logits per tile (256 MiB in fp32), when no chunk size is given
MAX_CHUNK = 1 << 16


@dataclass(frozen=True)
class LogitTransform:
    """logits = softcap(scale · (h·Wᵀ + b)) / temperature, softcap(z) = cap · tanh(z / cap)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive; got {self.temperature!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive or None; got {self.softcap!r}")

    @staticmethod
    def of_config(config, temperature: float = 1.0) -> "LogitTransform":
        """The transform a Transformers causal LM applies after its output embedding, read from its
        (text) config: Gemma's `final_logit_softcapping`, Cohere's `logit_scale`, Granite's
        `logits_scaling` (a divisor), Falcon-H1's `lm_head_multiplier`."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = 1.0
        for name in ("logit_scale", "lm_head_multiplier"):
            if getattr(text, name, None) is not None:
                scale *= float(getattr(text, name))
        if getattr(text, "logits_scaling", None) is not None:
            scale /= float(text.logits_scaling)
        softcap = getattr(text, "final_logit_softcapping", None)
        return LogitTransform(scale, None if softcap is None else float(softcap), float(temperature))

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        z = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature if self.temperature != 1.0 else z

    def backward(self, raw: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """d loss / d raw from d loss / d logits (`grad`), in place on `grad`."""
        if self.temperature != 1.0:
            grad.div_(self.temperature)
        if self.softcap is not None:
            t = torch.tanh(raw * (self.scale / self.softcap))
            grad.mul_(1 - t * t)
        return grad.mul_(self.scale) if self.scale != 1.0 else grad


def default_chunk_size(vocab: int) -> int:
    """Rows per tile: about `DEFAULT_TILE_ELEMENTS` logits, at least 1, at most `MAX_CHUNK`."""
    return max(1, min(MAX_CHUNK, DEFAULT_TILE_ELEMENTS // max(vocab, 1)))


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    kind = hidden.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc += a @ b` into an fp32 `acc` without rounding `a @ b` to the inputs' dtype first: summing
    chunk products rounded to bf16 would bias the weight gradient. CUDA multiplies bf16 / fp16 into
    fp32 directly (torch >= 2.8, the floor being 2.11); elsewhere the inputs are upcast."""
    if acc.device.type == "cuda" and a.dtype in (torch.bfloat16, torch.float16):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.float(), b.float())


def _tile(hidden, weight, bias, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """The raw logits of rows [start, stop), h·Wᵀ + b, in `dtype` (the tile functions read it as it is)."""
    raw = hidden[start:stop].to(dtype) @ weight.to(dtype).t()
    return raw if bias is None else raw + bias.to(dtype)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform: LogitTransform, chunk: int, stats: tuple[str, ...],
                tiles: str):
        ctx.set_materialize_grads(False)
        dtype = _compute_dtype(hidden)
        forward_tile, backward_tile = tile_functions(tiles, hidden.device)
        n = hidden.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty_like(log_probs)
        extra = {name: torch.empty(n, dtype=torch.bool if name == "is_top1" else torch.float32, device=hidden.device)
                 for name in stats}
        w = weight.to(dtype)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            raw = _tile(hidden, w, bias, start, stop, dtype)
            with torch.autocast(hidden.device.type, enabled=False):  # fp32 math, whatever the caller's autocast
                lse, target, *values = forward_tile(raw, targets[start:stop], transform, stats)
            log_probs[start:stop] = target - lse
            lse_all[start:stop] = lse
            for name, value in zip(stats, values):
                extra[name][start:stop] = value
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        ctx.transform, ctx.chunk, ctx.dtype, ctx.backward_tile = transform, chunk, dtype, backward_tile
        ctx.mark_non_differentiable(*extra.values())
        return (log_probs, *extra.values())

    @staticmethod
    def backward(ctx, grad_log_probs, *_):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if grad_log_probs is None:
            return None, None, None, None, None, None, None, None
        dtype, transform = ctx.dtype, ctx.transform
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            raw = _tile(hidden, w, bias, start, stop, dtype)
            with torch.autocast(hidden.device.type, enabled=False):
                grad, bias_sum = ctx.backward_tile(raw, lse_all[start:stop], targets[start:stop],
                                                   grad_log_probs[start:stop], transform, grad_bias is not None)
            if grad_bias is not None:
                grad_bias += bias_sum
            if grad_hidden is not None:
                _addmm_fp32(grad_hidden[start:stop], grad, w)
            if grad_weight is not None:
                _addmm_fp32(grad_weight, grad.t(), hidden[start:stop].to(dtype))
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None, None,
        )


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    chunk_size: int | None = None,
    stats: tuple[str, ...] = (),
    tiles: str = "eager",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """log p(targets[i] | hidden[i]) for each of the N rows (fp32 `[N]`, differentiable in `hidden`,
    `weight` and `bias`), and the requested per-token `stats` (`STATS`: entropy, mean logit, whether
    the target is the first argmax, log Σ p²; fp32 or bool `[N]`, no gradient). At most
    `chunk_size` rows (default: `default_chunk_size(V)`) are projected at a time. `tiles`: how each
    tile's math runs, "eager" (default), "auto" (compiled on CUDA) or "compiled" (`tiles.tile_functions`)."""
    unknown = [name for name in stats if name not in STATS]
    if unknown:
        raise ValueError(f"stats {unknown} are not known; expected names from {STATS}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected; got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N] = [{hidden.shape[0]}]; got {tuple(targets.shape)}")
    chunk = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk_size must be a positive integer or None; got {chunk_size!r}")
    if tiles not in TILE_MODES:
        raise ValueError(f"tiles={tiles!r} is not supported; accepted values: {', '.join(TILE_MODES)}")
    ordered = tuple(name for name in STATS if name in stats)
    out = _ChunkedLogProbs.apply(hidden, weight, bias, targets.long(), transform, chunk, ordered, tiles)
    return out[0], dict(zip(ordered, out[1:]))
