"""The state-passing plans of recurrent token mixers (planning/mixer_plan.py), on one process.

Every rank of a random layout is simulated: a float64 affine recurrence s_t = A_t·s_{t-1} + b_t
(the shape of the gated delta rule's state update) and a causal convolution run per rank exactly as
the state-passing transport runs them (local runs from zero, transitions of carried runs, the
gathered blocks, chains composed in pack order; halos gathered from the pieces' tails), against the
same recurrence and convolution run on each document of the pack alone. Also: the transport choice.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.planning import PAIR_COUNT, document_ids_from_lengths, plan_layout
from hf_blockdiag_cp.planning.mixer_plan import (
    DEFAULT_MIXER_COST,
    MixerShape,
    choose_mixer_transport,
    mixer_cost_for,
    pack_runs,
    plan_conv_halo,
    plan_state_passing,
    transport_seconds,
)

DIM = 2


def _reference_states(ids: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """o_t = c_t · s_t with s restarted (zero) at every document start; padding rows 0."""
    out, s = torch.zeros(ids.numel(), dtype=torch.float64), torch.zeros(DIM, dtype=torch.float64)
    ids = ids.tolist()
    for t in range(len(ids)):
        if t == 0 or ids[t] != ids[t - 1]:
            s = torch.zeros(DIM, dtype=torch.float64)
        s = A[t] @ s + b[t]
        out[t] = c[t] @ s if ids[t] > 0 else 0.0
    return out


def _run(A, b, c, rows, start):
    """(outputs, final state) of the recurrence over `rows` from state `start`."""
    s, out = start, []
    for t in rows:
        s = A[t] @ s + b[t]
        out.append(c[t] @ s)
    return torch.stack(out), s


def _transition(A, c, rows):
    """(P, coefficients): s_end = P·s_start + F, and o_t = o_zero_t + coeff_t · s_start."""
    P, coeff = torch.eye(DIM, dtype=torch.float64), []
    for t in rows:
        P = A[t] @ P
        coeff.append(c[t] @ P)
    return P, torch.stack(coeff)


def _simulate_states(layout, A, b, c) -> torch.Tensor:
    """Every rank's outputs under state passing, put back in pack order."""
    g = layout.cp_size
    plans = [plan_state_passing(layout, r) for r in range(g)]
    zero = torch.zeros(DIM, dtype=torch.float64)
    local, blocks = [], torch.zeros(g * plans[0].slots, 2, DIM, DIM + 1, dtype=torch.float64)
    for r, plan in enumerate(plans):
        pos = layout.slot_positions[r]
        bounds = plan.runs.boundaries.tolist()
        outs, finals, transitions, coeffs = [], [], {}, {}
        for i, (a, z) in enumerate(zip(bounds[:-1], bounds[1:])):
            o, f = _run(A, b, c, pos[a:z].tolist(), zero)
            outs.append(o if plan.runs.is_document[i] else torch.zeros_like(o))
            finals.append(f)
        for j, i in enumerate(plan.carried.tolist()):
            transitions[j], coeffs[i] = _transition(A, c, pos[bounds[i] : bounds[i + 1]].tolist())
        for slot in range(plan.slots):
            if plan.export_final[slot] >= 0:
                blocks[r * plan.slots + slot, 1, :, 0] = finals[int(plan.export_final[slot])]
            if plan.export_transition[slot] >= 0:
                blocks[r * plan.slots + slot, 0, :, :DIM] = transitions[int(plan.export_transition[slot])]
        local.append((outs, coeffs))
    result = torch.zeros(layout.padded_seq_len, dtype=torch.float64)
    for r, (plan, (outs, coeffs)) in enumerate(zip(plans, local)):
        for j, i in enumerate(plan.carried.tolist()):
            chain = plan.chains[j]
            state = blocks[chain[0], 1, :, 0]
            for block in chain[1:]:
                state = blocks[block, 0, :, :DIM] @ state + blocks[block, 1, :, 0]
            outs[i] = outs[i] + coeffs[i] @ state
        result[layout.slot_positions[r]] = torch.cat(outs)
    return result


def _layout(lengths, padding, g, strategy):
    ids = document_ids_from_lengths(lengths, sum(lengths) + padding)
    return plan_layout(ids, g, strategy, kernel_cost=PAIR_COUNT)


PACKS = st.tuples(
    st.lists(st.integers(1, 40), min_size=1, max_size=8), st.integers(0, 9), st.integers(1, 6),
    st.sampled_from(["contiguous", "balanced"]), st.integers(0, 2**31 - 1),
)


@settings(max_examples=150, deadline=None)
@given(pack=PACKS)
def test_state_passing_equals_each_document_alone(pack):
    lengths, padding, g, strategy, seed = pack
    layout = _layout(lengths, padding, g, strategy)
    n = layout.padded_seq_len
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(n, DIM, DIM, generator=gen, dtype=torch.float64) * 0.6
    b, c = torch.randn(n, DIM, generator=gen, dtype=torch.float64), torch.randn(n, DIM, generator=gen, dtype=torch.float64)
    expected = _reference_states(layout.document_ids, A, b, c)
    torch.testing.assert_close(_simulate_states(layout, A, b, c), expected, rtol=1e-10, atol=1e-10)


def _reference_conv(ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[j] · x[t - j] over the j reaching back no further than t's segment start (in
    Python floats: float64, as the tensors)."""
    ids, xs, ws = ids.tolist(), x.tolist(), w.tolist()
    out = [0.0] * len(xs)
    for t in range(len(xs)):
        for j in range(len(ws)):
            if t - j < 0 or ids[t - j] != ids[t]:
                break
            out[t] += ws[j] * xs[t - j]
    return torch.tensor(out, dtype=x.dtype)


@settings(max_examples=150, deadline=None)
@given(pack=PACKS, width=st.integers(0, 5))
def test_conv_halo_equals_each_document_alone(pack, width):
    lengths, padding, g, strategy, seed = pack
    layout = _layout(lengths, padding, g, strategy)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(layout.padded_seq_len, generator=gen, dtype=torch.float64)
    w = torch.randn(width + 1, generator=gen, dtype=torch.float64)
    plans = [plan_conv_halo(layout, r, width) for r in range(g)]
    local = [x[layout.slot_positions[r]] for r in range(g)]
    zero = torch.zeros(1, dtype=torch.float64)
    gathered = torch.cat([torch.cat([loc, zero])[torch.where(p.send_rows < 0, loc.numel(), p.send_rows)]
                          for loc, p in zip(local, plans)])
    result = torch.zeros_like(x)
    for r, plan in enumerate(plans):
        ext = torch.cat([local[r], gathered, zero])[plan.ext_index]
        out = torch.zeros_like(ext)
        bounds = plan.ext_runs.boundaries.tolist()
        for a, z in zip(bounds[:-1], bounds[1:]):
            ids = torch.ones(z - a, dtype=torch.long)
            out[a:z] = _reference_conv(ids, ext[a:z], w)
        result[layout.slot_positions[r]] = out[plan.keep]
    expected = _reference_conv(layout.document_ids, x, w)
    real = layout.document_ids > 0
    torch.testing.assert_close(result[real], expected[real], rtol=1e-12, atol=1e-12)


def test_a_document_over_three_ranks_chains_two_pieces():
    """Contiguous G = 4, L = 8: document 2 holds positions 3-20 (ranks 0-2), document 3 positions 21-31.
    Rank 2's first run composes rank 0's final state and rank 1's transition (rank 1 sends both); rank 2
    sends the final state of its second run, which rank 3 continues."""
    layout = _layout([3, 18, 11], 0, 4, "contiguous")
    plans = [plan_state_passing(layout, r) for r in range(4)]
    assert plans[0].carried.tolist() == [] and int(plans[0].export_final[0]) == 1
    assert plans[1].chains == ((0,),) and int(plans[1].export_transition[0]) == 0 and int(plans[1].export_final[0]) == 0
    assert plans[2].chains == ((0, 1),) and int(plans[2].export_transition[0]) == -1 and int(plans[2].export_final[0]) == 1
    assert plans[3].chains == ((2,),) and int(plans[3].export_final[0]) == -1
    assert [int(b) for b in pack_runs(layout).boundaries] == [0, 3, 21, 32]


SHAPE = MixerShape(key_heads=2, key_dim=128, value_heads=4, value_dim=128, conv_channels=1024, conv_kernel=4)


def test_heads_are_refused_where_the_heads_do_not_split():
    layout = _layout([100, 60], 0, 4, "contiguous")
    assert choose_mixer_transport("auto", layout, SHAPE) == "states"
    with pytest.raises(ValueError, match=r"key heads \(2\).*G=4"):
        choose_mixer_transport("heads", layout, SHAPE)
    assert choose_mixer_transport("states", layout, SHAPE) == "states"
    assert choose_mixer_transport("heads", _layout([100, 60], 0, 1, "contiguous"), SHAPE) == "local"


def test_auto_takes_states_for_short_documents_and_heads_for_one_long_document():
    """Short documents: state passing moves a few states and computes nothing twice. One document over
    every rank: each rank but the first computes its rows twice (transition), which costs more than
    moving the rows at large packs, so `auto` goes head-parallel."""
    shape = MixerShape(8, 128, 16, 128, 4096, 4)
    short = _layout([512] * 128, 0, 2, "contiguous")
    long = _layout([65536], 0, 2, "contiguous")
    assert choose_mixer_transport("auto", short, shape) == "states"
    assert choose_mixer_transport("auto", long, shape) == "heads"
    seconds = transport_seconds(long, shape)
    assert seconds["heads"] < seconds["states"]


def test_a_slower_backend_takes_state_passing_for_one_long_document():
    """gloo's byte rate (`mixer_cost_for("gloo")`) makes head-parallel's all-to-alls cost more than state
    passing's second pass where NCCL's makes them cheaper; unknown backends get NCCL's rate."""
    shape = MixerShape(8, 128, 16, 128, 4096, 4)
    long = _layout([65536], 0, 2, "contiguous")
    assert mixer_cost_for("nccl") is DEFAULT_MIXER_COST and mixer_cost_for("ucc") is DEFAULT_MIXER_COST
    gloo = mixer_cost_for("gloo")
    assert gloo.bytes_per_second < DEFAULT_MIXER_COST.bytes_per_second
    assert choose_mixer_transport("auto", long, shape) == "heads"
    assert choose_mixer_transport("auto", long, shape, gloo) == "states"
    seconds = transport_seconds(long, shape, gloo)
    assert seconds["states"] < seconds["heads"]


@pytest.mark.parametrize("decay", ["head", "entry"])
def test_mamba_mixers_go_by_state_passing_even_for_one_long_document(decay):
    """Mamba2 (one decay per head) and Mamba1 (one per state entry) have no head-parallel transport: `auto`
    passes states where the delta rule's shape goes head-parallel, and `heads` raises naming why."""
    shape = MixerShape(8, 128, 16, 128, 4096, 4, decay=decay, head_parallel=False)
    long = _layout([65536], 0, 2, "contiguous")
    assert choose_mixer_transport("auto", long, shape) == "states"
    assert set(transport_seconds(long, shape)) == {"states"}
    with pytest.raises(ValueError, match="no head-parallel transport"):
        choose_mixer_transport("heads", long, shape)
    with pytest.raises(ValueError, match="decay must be one of"):
        MixerShape(8, 128, 16, 128, decay="scalar")
