"""Recurrent token mixers of hybrid models over packed rows, exact per document, at cp = 1 and under
CP: where a mixer runs (`context.MixerContext`), the state-passing transport (`state_passing`), and
one module per mixer kind (`gated_delta`). The pure planning is `planning.mixer_plan`, the kernels
are `kernels.mixer_registry` records; the model patches (`model_patches`) call in here.
"""

from .context import MixerContext
from .gated_delta import GatedDeltaLayer, gated_delta_mix

__all__ = ["GatedDeltaLayer", "MixerContext", "gated_delta_mix"]
