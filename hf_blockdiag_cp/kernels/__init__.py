"""Local kernels, by kind: `attention` (one record per local attention kernel: dense, flex, varlen,
fa4, flash, te) and `mixers` (one record per kernel of each recurrent token-mixer operation: torch
and, where verified, fla). Both kinds keep their records in a `hf_blockdiag_cp.registry.Registry`;
`calibration.json` holds the attention kernels' fitted cost constants.
"""

from . import attention, mixers
from .attention import *  # noqa: F403  (the attention kernels' names, `attention.__all__`)
from .mixers import *  # noqa: F403  (the mixer kernels' names, `mixers.__all__`)

__all__ = ["attention", "mixers", *attention.__all__, *mixers.__all__]
