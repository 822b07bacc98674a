"""The independent reference: the stock model with `attn_implementation="eager"` run on every
document separately, unpacked, and tiny models built from configs. One copy, in
`hf_blockdiag_cp.bench.reference`; re-exported here."""

from hf_blockdiag_cp.bench.reference import (  # noqa: F401 (re-exported)
    COMMON_CONFIG,
    VOCAB,
    build_models,
    compare_with_reference,
    make_docs,
    mean_over_group,
    reference_loss_and_grads,
    rel_err,
    tiny_config,
)
