"""The step: the pure shard of one pack (`shard`), the step object that activates around forward
and backward (`state`), and the function that builds it for the CP group (`build`)."""

from .build import StepAgreement, build_step, make_cp_blockdiag_batch_and_ctx
from .shard import (
    IGNORE_INDEX,
    SHARD_KEY,
    PackFingerprint,
    ShardInfo,
    document_ids_of,
    local_rows,
    shard_batch,
    shifted_labels,
)
from .state import (
    STEP_KWARG,
    BlockdiagCPModelState,
    BlockdiagCpModelState,
    CPStep,
    DevicePlan,
    StepChoices,
    exchange_label,
    active_step,
    current_blockdiag_cp_state,
)

__all__ = [
    "IGNORE_INDEX",
    "SHARD_KEY",
    "STEP_KWARG",
    "BlockdiagCPModelState",
    "BlockdiagCpModelState",
    "CPStep",
    "DevicePlan",
    "PackFingerprint",
    "ShardInfo",
    "StepAgreement",
    "StepChoices",
    "exchange_label",
    "active_step",
    "build_step",
    "current_blockdiag_cp_state",
    "document_ids_of",
    "local_rows",
    "make_cp_blockdiag_batch_and_ctx",
    "shard_batch",
    "shifted_labels",
]
