"""Every rank trains against the same reference model: one built from each rank's own seed (DDP
synchronises the policy, never the reference) is refused at construction on every rank, naming the
model and the ranks that differ; the same reference everywhere constructs. DPO at world 2, with two
data-parallel ranks (cp = 1) and with one CP group (cp = 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    PACK, ROWS, char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows, reference_model,
)
from helpers.trainer import accelerate_env, quiet  # noqa: E402

pytestmark = pytest.mark.multiprocess


def reference_case(rank, world_size, group, cp_size: int, per_rank_reference: bool):
    """The construction error on this rank (None: it constructed)."""
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference_rows(**ROWS)
    with accelerate_env(rank, world_size) as out:
        policy = policy_model("llama", "blockdiag_cp")  # seed 0 on every rank
        ref = reference_model(policy, seed=1 + (rank if per_rank_reference else 0))
        try:
            quiet(BlockdiagCPDPOTrainer(model=policy, ref_model=ref, args=dpo_config(out, len(rows)),
                                        train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                        cp_size=cp_size, max_tokens=PACK))
        except ValueError as exc:
            return str(exc)
        return None


@pytest.mark.parametrize("cp_size", [1, 2])
def test_a_reference_that_differs_between_ranks_is_refused_on_every_rank(gloo, cp_size):
    pool = gloo(2)
    errors = pool.run(reference_case, cp_size=cp_size, per_rank_reference=True)
    expected = "ref_model differs between ranks: ranks [1] hold other weights than rank 0"
    assert all(e is not None and e.startswith(expected) for e in errors), errors
    assert all("the same path, or the same seed" in e for e in errors), errors
    assert pool.run(reference_case, cp_size=cp_size, per_rank_reference=False) == [None, None]
