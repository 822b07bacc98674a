"""The per-tile math of the chunked log-prob head: one `[c, V]` tile of raw logits in, per-row results out.

`tile_forward` and `tile_backward` are pure functions of a raw tile in the compute dtype (the matmul's
output, already rounded to it): each reads the tile in that dtype and does its math in fp32, so that
`torch.compile` (inductor) fuses each into one or two kernels that hold no fp32 copy of the tile and no
tile-sized temporaries; the one-hot of the targets is a comparison against a column index, which fuses
where a scatter would not. Run eagerly, the same functions build those temporaries one op at a time.

`tile_functions(mode, device)` picks the pair: `"compiled"` (`torch.compile(dynamic=True)`, created once
per process: tiles of any row count above one share a graph, the ragged last tile included; a new
dtype, transform, set of statistics or a one-row tile compiles once more; past dynamo's recompile
limit, a new variant runs eagerly), `"eager"`, or `"auto"`: compiled on CUDA where torch.compile
and Triton are available, eager elsewhere (`CPConfig.head_tiles`). The head calls them outside any
graph of the model (its hook is `torch.compiler.disable`d), so a compiled model keeps them too.
"""

from __future__ import annotations

import functools

import torch

from ..compat.torch import compile_available
from ..config import HEAD_TILES as TILE_MODES


def tile_forward(raw: torch.Tensor, targets: torch.Tensor, transform,
                 stats: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """(log-sum-exp [c], target logit [c], *the requested `stats` [c]) of the raw tile `raw` [c, V]
    after `transform` (a `head.LogitTransform`), in fp32 (`is_top1` bool); `stats` in `head.STATS` order."""
    z = transform.apply(raw.float())
    lse = torch.logsumexp(z, dim=-1)
    target = transform.apply(raw.gather(1, targets[:, None]).squeeze(1).float())  # elementwise: z's entries
    out = [lse, target]
    if "entropy" in stats:
        out.append(lse - (torch.exp(z - lse[:, None]) * z).sum(-1))
    if "mean_logits" in stats:
        out.append(z.mean(-1))
    if "is_top1" in stats:  # the first maximal logit is the target's (TRL's `is_top1`)
        out.append(z.argmax(-1) == targets)
    if "log_sum_sq_probs" in stats:
        out.append(torch.logsumexp(2 * z, dim=-1) - 2 * lse)
    return tuple(out)


def tile_backward(raw: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, transform,
                  bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d loss / d raw [c, V] in `raw`'s dtype, its fp32 column sum [V] when `bias_grad`, else None),
    given `grad` [c] = d loss / d log p(target): `grad · (onehot(target) - softmax)` through the
    transform's backward, in fp32 until the final cast."""
    raw32 = raw.float()
    columns = torch.arange(raw.shape[1], device=raw.device)
    g = torch.sub(transform.apply(raw32), lse[:, None]).exp_().neg_()  # -softmax
    g.add_(columns[None, :] == targets[:, None])  # + onehot(target)
    g.mul_(grad[:, None].float())
    g = transform.backward(raw32, g)
    return g.to(raw.dtype), (g.sum(0) if bias_grad else None)


@functools.cache
def _compiled() -> tuple:
    return torch.compile(tile_forward, dynamic=True), torch.compile(tile_backward, dynamic=True)


def tile_functions(mode: str, device: torch.device) -> tuple:
    """(forward, backward) per `mode` (module docstring) for tiles on `device`."""
    if mode not in TILE_MODES:
        raise ValueError(f"tiles={mode!r} is not supported; accepted values: {', '.join(TILE_MODES)}")
    if mode == "eager" or (mode == "auto" and not (device.type == "cuda" and compile_available(device))):
        return tile_forward, tile_backward
    return _compiled()
