"""The real K/V exchanges on gloo (world sizes 2-4; contiguous, balanced and head-tail
layouts): every registered K/V exchange moves exactly the rows, gradients and bytes its record's
plan says (I5, docs/design.md); the plans themselves are checked against brute force in
unit/test_exchange_plan.py. Head-parallel records are skipped: they move q, k, v around the
kernel, not K/V rows alone; tests/multiprocess/test_heads_exchange.py checks their outputs,
gradients and bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_blockdiag_cp.comm import ExchangeMeter, exchange_kv
from hf_blockdiag_cp.planning import exchange_records, kv_row_bytes, plan_exchange
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids

# Un-repeated GQA heads and unequal head dims: the MLA-like case (docs/kernels.md, "K/V exchanges").
HKV, DK, DV = 2, 5, 3


class ByteCounter:
    """Wraps the torch.distributed calls the exchanges use and counts the bytes each rank receives."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "batch_isend_irecv")

    def __init__(self, rank):
        self.rank, self.received, self.originals = rank, [], {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.received.append(self._bytes(name, args, kwargs))
            return fn(*args, **kwargs)

        return counted

    def _bytes(self, name, args, kwargs):
        if name == "batch_isend_irecv":
            return sum(op.tensor.nbytes for op in args[0] if op.op.__name__ == "irecv")
        out, inp = args[0], args[1]
        if name.startswith("all_gather"):
            return out.nbytes - inp.nbytes
        if name.startswith("reduce_scatter"):
            return inp.nbytes - out.nbytes
        splits = kwargs.get("output_split_sizes") or args[2]
        return out.nbytes - splits[self.rank] * out[0].nbytes if out.shape[0] else 0

    def take(self):
        total, self.received = sum(self.received), []
        return total


EXCHANGE_LAYOUTS = (
    ("contiguous", [(False, 3), (False, 17), (False, 2), (True, 4), (False, 9)]),
    ("contiguous", [(False, 40), (True, 3)]),  # one document over every rank
    ("headtail", [(False, 5), (False, 30), (True, 2), (False, 11)]),
    ("balanced", [(False, 2), (False, 3), (False, 33), (False, 1), (False, 12)]),
)


def exchange_bytes_case(rank, world_size, group):
    """For every layout and exchange: rows, gradients (float64 reference) and received bytes vs the plan."""
    report = []
    for kind, runs in EXCHANGE_LAYOUTS:
        if kind not in LAYOUT_KINDS:
            continue
        layout = make_layout(pack_ids(runs), world_size, kind)
        plan = plan_exchange(layout)
        s_pad = layout.padded_seq_len
        gen = torch.Generator().manual_seed(7)
        k_all = torch.randn(s_pad, HKV, DK, generator=gen, dtype=torch.float64)
        v_all = torch.randn(s_pad, HKV, DV, generator=gen, dtype=torch.float64)
        mine = layout.slot_positions[rank]
        for record in exchange_records():
            if record.reason(plan) is not None or record.head_parallel:
                continue
            # every rank's rows: the gradient of a row sums what each receiver's weights make of it
            received = [record.plan(layout, plan, r).row_positions for r in range(world_size)]
            routes = record.plan(layout, plan, rank).routes
            k = k_all[mine].float().requires_grad_()
            v = v_all[mine].float().requires_grad_()
            meter = ExchangeMeter()
            with ByteCounter(rank) as counter:
                out_k, out_v = exchange_kv(record.name, k, v, group, world_size, routes=routes, meter=meter)
                fwd = counter.take()
                # Row weights seeded by the receiving rank; laid out [D, H, K] so the incoming
                # gradients have non-standard strides (gloo and strides: docs/kernels.md, "K/V exchanges").
                rows = received[rank]
                wk = _weights(rank, rows.numel(), DK).permute(2, 1, 0)
                wv = _weights(rank, rows.numel(), DV, offset=1).permute(2, 1, 0)
                loss = (out_k.permute(2, 1, 0) * wk).sum() + (out_v.permute(2, 1, 0) * wv).sum()
                loss.backward()
                bwd = counter.take()
            torch.testing.assert_close(out_k.double(), k_all[rows], rtol=0, atol=1e-6)
            torch.testing.assert_close(out_v.double(), v_all[rows], rtol=0, atol=1e-6)
            gk, gv = _expected_grads(layout, received, rank, world_size)
            torch.testing.assert_close(k.grad.double(), gk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v.grad.double(), gv, rtol=1e-5, atol=1e-5)
            planned = record.bytes_per_layer(plan, rank, kv_row_bytes(HKV, DK, DV, 4))
            report.append((kind, record.name, (fwd, bwd), (planned.forward, planned.backward), (meter.forward_bytes, meter.backward_bytes)))
    return report


def _weights(receiver, rows, dim, offset=0):
    gen = torch.Generator().manual_seed(1000 * receiver + offset)
    return torch.randn(rows, HKV, dim, generator=gen, dtype=torch.float64).float()


def _expected_grads(layout, received, rank, world_size):
    """d(sum over receivers of their weighted outputs) / d(this rank's rows), in float64."""
    s_pad = layout.padded_seq_len
    gk = torch.zeros(s_pad, HKV, DK, dtype=torch.float64)
    gv = torch.zeros(s_pad, HKV, DV, dtype=torch.float64)
    for receiver in range(world_size):
        rows = received[receiver]
        gk.index_add_(0, rows, _weights(receiver, rows.numel(), DK).double())
        gv.index_add_(0, rows, _weights(receiver, rows.numel(), DV, offset=1).double())
    mine = layout.slot_positions[rank]
    return gk[mine], gv[mine]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchanges_move_what_the_plan_says(gloo, world_size):
    results = gloo(world_size).run(exchange_bytes_case)
    seen = set()
    for rank, report in enumerate(results):
        for kind, name, measured, planned, metered in report:
            seen.add(name)
            assert measured == planned, f"rank {rank} {kind} {name}: moved (fwd, bwd) {measured} bytes, plan {planned}"
            assert metered == planned, f"rank {rank} {kind} {name}: step meter {metered}, plan {planned}"
    assert seen == {r.name for r in exchange_records() if not r.head_parallel}
