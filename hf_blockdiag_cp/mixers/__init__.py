"""Recurrent token mixers of hybrid models over packed rows, exact per document, at cp = 1 and under
CP: where a mixer runs (`context.MixerContext`), the state-passing transport (`state_passing`), and
one module per mixer kind (`gated_delta`: the gated delta rule and KDA; `gated_conv`: LFM2's short
gated convolution; `ssd`: Mamba2's convolution and SSD scan; `selective_scan`: Mamba1's convolution
and selective scan; `lightning`: MiniMax's lightning attention). The pure planning is
`planning.mixer_plan`, the kernels are `kernels.mixers` records; the model patches (`model_patches`)
call in here.
"""

from .context import MixerContext
from .gated_conv import GatedConvLayer, gated_conv_mix
from .gated_delta import GatedDeltaLayer, HeadDecay, gated_delta_mix
from .lightning import LightningLayer, lightning_mix

__all__ = ["GatedConvLayer", "GatedDeltaLayer", "HeadDecay", "LightningLayer", "MixerContext", "gated_conv_mix",
           "gated_delta_mix", "lightning_mix"]
