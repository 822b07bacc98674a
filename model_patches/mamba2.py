"""Mamba2, NemotronH, GraniteMoeHybrid, Bamba, FalconH1 and Zamba2: exact packed Mamba2 (SSD)
layers, at cp = 1 and under CP.

Why: these models mix tokens with Mamba2 layers that do not go through the attention interface.
On a packed row Transformers' torch path runs their causal convolution and their SSD scan across
document boundaries (its mamba-ssm path takes `seq_idx`, its torch path ignores it), and under CP
each rank would see only its shard. The patch replaces each Mamba2 mixer instance's `forward` (its
parameters unchanged) with one that projects as the stock forward does (FalconH1's input and μP
multipliers included), runs the token mixer of `hf_blockdiag_cp.mixers.ssd` (convolution and scan
restarted at every document; under CP by state passing), then the gated norm (or FalconH1's plain
SiLU gate) and the output projection. Outputs, loss and gradients equal the stock model run on each
document alone.

When the packed path runs is `packed_mixer`'s rule: outside a CP step the layer is stock unless the
caller passes `cu_seq_lens_q`; a cache holding earlier state (generation) always runs the stock
forward; a fresh cache is left unwritten by the packed path.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from hf_blockdiag_cp.mixers.ssd import SsdLayer, ssd_mix

from .packed_mixer import family_function, layer_name, register_mixer_patch

MODEL_TYPES = ("mamba2", "nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2")
_ATTRIBUTES = ("in_proj", "conv1d", "A_log", "dt_bias", "D", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
               "ssm_state_size", "chunk_size", "time_step_limit", "intermediate_size", "conv_dim")
MAMBA_LAYER_TYPES = ("linear_attention", "hybrid")  # config.layer_types entries with a Mamba (1 or 2) mixer


def is_ssd_mixer(module: torch.nn.Module) -> bool:
    """A Mamba2 mixer of a family with Transformers' torch `mamba2_chunk_scan`."""
    return all(hasattr(module, a) for a in _ATTRIBUTES) and hasattr(sys.modules[type(module).__module__], "mamba2_chunk_scan")


def mixer_layer(module) -> SsdLayer:
    """What the token mixer reads of a Mamba2 mixer module (its parameters, not copies)."""
    return SsdLayer(
        name=layer_name(module), heads=module.num_heads, head_dim=module.head_dim,
        groups=module.n_groups, state_size=module.ssm_state_size, chunk_size=module.chunk_size,
        conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=module.activation,
        A_log=module.A_log, dt_bias=module.dt_bias, D=module.D, time_step_limit=tuple(module.time_step_limit),
        torch_scan=family_function(module, "mamba2_chunk_scan"),
    )


def input_projections(module, hidden: torch.Tensor):
    """Rows `[L, D]` -> gate `[L, I]`, pre-convolution x|B|C `[L, I + 2·G·N]` and raw dt `[L, H]`,
    exactly as the stock forward builds them (FalconH1: times its input and μP multipliers)."""
    x = hidden[None]
    if hasattr(module, "ssm_in_multiplier"):
        x = x * module.ssm_in_multiplier
    projected = module.in_proj(x)
    if hasattr(module, "mup_vector"):
        projected = projected * module.mup_vector
    return projected[0].split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)


def forward_rows(self, x, mix, kwargs):
    """Mamba2 mixer on one packed row `x [L, D]`: the stock projections, the convolution and SSD scan per
    document, the gated norm (or FalconH1's plain SiLU gate) and the output projection."""
    rows, dtype = x.shape[0], x.dtype
    gate, xbc, dt = input_projections(self, x)
    scan = mix(xbc, dt).reshape(1, rows, -1)
    if getattr(self, "mamba_rms_norm", True):
        scan = self.norm(scan, gate[None])
    else:  # FalconH1 without its gated norm
        scan = scan * F.silu(gate[None])
    return self.out_proj(scan.to(dtype))


PATCH = register_mixer_patch(
    "mamba2_packed", MODEL_TYPES, layer_types=MAMBA_LAYER_TYPES, is_layer=is_ssd_mixer,
    layer=f"Mamba2 mixer with {', '.join(_ATTRIBUTES)}", mixer_layer=mixer_layer, mix=ssd_mix, forward=forward_rows,
    torch_function="mamba2_chunk_scan",
    why="Mamba2 layers (convolution and SSD scan) must restart at every document and see the whole pack",
)
apply = PATCH.apply
