"""TRL integration: `BlockdiagCPSFTTrainer`, TRL's `SFTTrainer` with packed SFT under exact
block-diagonal CP (`sft`), the loader that turns TRL's packed rows into sharded packs
(`packs`), and TRL's token metrics combined over the CP group (`metrics`). Needs the `[trl]`
extra (trl >= 1.16)."""

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - trl is optional
    raise ImportError(
        "hf_blockdiag_cp.integrations.trl needs TRL: pip install 'hf_blockdiag_cp[trl]' (trl >= 1.16)"
    ) from exc

from .packs import PrepackedBatchSampler, SFTPackCollator, prepacked_dataloader
from .sft import BlockdiagCPSFTTrainer, check_sft_config

__all__ = ["BlockdiagCPSFTTrainer", "PrepackedBatchSampler", "SFTPackCollator", "check_sft_config", "prepacked_dataloader"]
