"""TRL integration: `BlockdiagCPSFTTrainer`, TRL's `SFTTrainer` with packed SFT under exact
block-diagonal CP (`sft`, its loader `packs`, its token metrics `metrics`), and the preference
trainers on packed pairs (`preference`): `BlockdiagCPDPOTrainer` (`dpo`, its losses `dpo_loss`) and
`BlockdiagCPRewardTrainer` (`reward`); the RL trainers `BlockdiagCPGRPOTrainer` and
`BlockdiagCPRLOOTrainer` (`rl`), TRL's own with CP log-probs of the completions. Needs the `[trl]`
extra (TRL 1.16: `compat.trl`)."""

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - trl is optional
    raise ImportError(
        "hf_blockdiag_cp.integrations.trl needs TRL: pip install 'hf_blockdiag_cp[trl]' (TRL 1.16)"
    ) from exc

from .dpo import BlockdiagCPDPOTrainer
from .packs import PrepackedBatchSampler, SFTPackCollator, prepacked_dataloader
from .reward import BlockdiagCPRewardTrainer
from .rl import BlockdiagCPGRPOTrainer, BlockdiagCPRLOOTrainer
from .sft import BlockdiagCPSFTTrainer, check_sft_config

__all__ = ["BlockdiagCPDPOTrainer", "BlockdiagCPGRPOTrainer", "BlockdiagCPRLOOTrainer", "BlockdiagCPRewardTrainer",
           "BlockdiagCPSFTTrainer", "PrepackedBatchSampler", "SFTPackCollator", "check_sft_config", "prepacked_dataloader"]
