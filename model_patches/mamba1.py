"""Mamba, FalconMamba and Jamba: exact packed Mamba1 (selective-scan) layers, at cp = 1 and under CP.

Why: these models mix tokens with Mamba1 layers that do not go through the attention interface
(Mamba and FalconMamba have no attention at all). On a packed row Transformers runs their causal
convolution and selective scan across document boundaries, and under CP each rank would see only
its shard. The patch replaces each Mamba1 mixer instance's `forward` (its parameters unchanged)
with one that projects as the stock forward does, runs the token mixer of
`hf_blockdiag_cp.mixers.selective_scan` (convolution and scan restarted at every document; the
layer's x_proj, its dt / B / C norms (Jamba, FalconMamba) and dt_proj between them; under CP by
state passing), then the SiLU gate and the output projection. Outputs, loss and gradients equal
the stock model run on each document alone.

When the packed path runs is `packed_mixer`'s rule: outside a CP step the layer is stock unless the
caller passes `cu_seq_lens_q`; a cache holding earlier state (generation) always runs the stock
forward; a fresh cache is left unwritten by the packed path.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hf_blockdiag_cp.mixers.selective_scan import SelectiveScanLayer, selective_scan_mix
from .packed_mixer import family_function, layer_name, register_mixer_patch

MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")
_ATTRIBUTES = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "intermediate_size",
               "ssm_state_size", "time_step_rank")


def is_selective_scan_mixer(module: torch.nn.Module) -> bool:
    """A Mamba1 mixer of a family with Transformers' torch `mamba_selective_scan`."""
    return (all(hasattr(module, a) for a in _ATTRIBUTES)
            and hasattr(sys.modules[type(module).__module__], "mamba_selective_scan"))


def mixer_layer(module) -> SelectiveScanLayer:
    """What the token mixer reads of a Mamba1 mixer module (its parameters, not copies)."""
    return SelectiveScanLayer(
        name=layer_name(module), channels=module.intermediate_size,
        state_size=module.ssm_state_size, conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias,
        activation=module.activation, A_log=module.A_log, D=module.D, dt_bias=module.dt_proj.bias,
        torch_scan=family_function(module, "mamba_selective_scan"),
    )


def _time_step_b_c(module, xc: torch.Tensor):
    """Convolved rows `[L, Dc]` -> raw dt `[L, Dc]`, B, C `[L, N]`, exactly as the stock forward builds them."""
    rank, state = module.time_step_rank, module.ssm_state_size
    time_step, B, C = torch.split(module.x_proj(xc[None]), [rank, state, state], dim=-1)
    if hasattr(module, "dt_layernorm"):  # Jamba, FalconMamba
        time_step, B, C = module.dt_layernorm(time_step), module.b_layernorm(B), module.c_layernorm(C)
    if hasattr(getattr(module, "config", None), "_is_quantized"):
        dt = module.dt_proj(time_step) - module.dt_proj.bias
    else:
        dt = (module.dt_proj.weight @ time_step.transpose(1, 2)).transpose(1, 2)
    return dt[0], B[0], C[0]


def _mix(layer: SelectiveScanLayer, x, module, context) -> torch.Tensor:
    """The convolution and selective scan of one layer over the pack's documents."""
    return selective_scan_mix(layer, x, lambda xc: _time_step_b_c(module, xc), context)


def forward_rows(self, x, mix, kwargs):
    """Mamba1 mixer on one packed row `x [L, D]`: the stock projection, the convolution and selective scan
    per document, the SiLU gate and the output projection."""
    dtype = x.dtype
    x, gate = self.in_proj(x[None])[0].chunk(2, dim=-1)
    scan = mix(x, self) * F.silu(gate)
    return self.out_proj(scan[None].to(dtype))


PATCH = register_mixer_patch(
    "mamba1_packed", MODEL_TYPES, layer_types=("linear_attention", "hybrid"), is_layer=is_selective_scan_mixer,
    layer=f"Mamba1 mixer with {', '.join(_ATTRIBUTES)}", mixer_layer=mixer_layer, mix=_mix, forward=forward_rows,
    torch_function="mamba_selective_scan",
    why="Mamba1 layers (convolution and selective scan) must restart at every document and see the whole pack",
)
apply = PATCH.apply
