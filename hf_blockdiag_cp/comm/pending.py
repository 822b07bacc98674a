"""How a K/V exchange moves rows, run at once (`run`) or started without waiting, for overlap
(`begin` / `wait`: `CPConfig.overlap`, `ExchangeRecord.begin`).

A subclass of `PendingExchange` says how one exchange moves rows: `start_forward` /
`finish_forward` and `start_backward` / `finish_backward`, each start launching its collective
through `launch` (asynchronously; `collect` waits for it). `run(k, v)` is the plain transport: one
autograd function that starts and collects in forward, and the reverse in backward.

`begin(k, v)` starts the collective and returns at once; attention over what the rank already
holds runs meanwhile; `wait(out)` returns the exchanged rows and `out` (that attention's output).
Two autograd functions carry it through the graph:

- `_Start` (k, v -> token): forward starts the collective; backward waits for the reverse
  collective and returns the K/V gradients;
- `_Finish` (token, out -> rows, out): forward waits and returns the rows; backward starts the
  reverse collective once the rows' gradients are in, and passes `out`'s gradient on at once.

So in backward the reverse collective is in flight while `out`'s own backward runs: autograd
reaches `_Start` only after it (`_Start` was recorded before `out`'s attention). `out` passes
through `_Finish` so that its backward runs, and starts the reverse collective, on every rank,
even where no query reads the exchanged rows (every rank must join it, I5).

Every buffer handed to a collective is allocated contiguous by the subclasses: gloo writes
contiguous bytes into receive buffers whatever their strides, which silently corrupts gradients
when a buffer inherits odd strides from an incoming gradient. A synchronous collective in
torch.distributed is the asynchronous one waited for at once, so `run` costs what it did before.
"""

from __future__ import annotations

import torch

from .failure import guarded
from .group import resolve_group


class PendingExchange:
    """One exchange's collective in flight (forward), and later its reverse (backward).

    Holds no tensor once a direction has been waited for, so an autograd graph that keeps it
    (activation checkpointing keeps a function's context) keeps no rows alive, and holds its group
    weakly (`group.group_ref`): a graph that outlives a failed step keeps no group's sockets open."""

    what = "exchange"  # how errors name the forward collective
    what_backward = "exchange backward"

    def __init__(self, ref, world_size: int, meter):
        self.group_ref, self.world_size, self.meter = ref, world_size, meter
        self.k_shape = self.v_shape = None
        self._works, self._state, self._what, self._token = (), None, None, None

    # ----------------------------------------------------------------- what a subclass writes

    def start_forward(self, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def finish_forward(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def start_backward(self, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None) -> None:
        raise NotImplementedError

    def finish_backward(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    # ----------------------------------------------------------------- shared

    def launch(self, what: str, collective, *args, state=None) -> None:
        """Start `collective(*args, group, async_op=True)` (it returns a work, a list of works or None),
        keeping `state` (every buffer it reads or writes, and what `finish_*` needs) until it is waited for."""
        group = resolve_group(self.group_ref)
        works = guarded(what, group, collective, *args, group, True)
        self._works = () if works is None else tuple(works) if isinstance(works, (list, tuple)) else (works,)
        self._state, self._what = state, what

    def keep(self, state) -> None:
        """Hold `state` for `collect` when nothing needs to travel (no collective is started)."""
        self._works, self._state, self._what = (), state, None

    @property
    def in_flight(self) -> str | None:
        """The collective started and not yet collected (its name), or None."""
        return self._what if self._works else None

    def collect(self):
        """Wait for the collective in flight; return the `state` it was launched with."""
        works, state, what = self._works, self._state, self._what
        self._works, self._state = (), None
        group = resolve_group(self.group_ref) if works else None
        for work in works:
            guarded(f"{what} wait", group, work.wait)
        return state

    def run(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exchanged K/V rows, collected before returning (the plain transport)."""
        return _Now.apply(k, v, self)

    def begin(self, k: torch.Tensor, v: torch.Tensor) -> "PendingExchange":
        """Start the exchange and return at once; `wait(out)` collects it."""
        self._token = _Start.apply(k, v, self)
        return self

    def wait(self, out: torch.Tensor):
        """(k_rows, v_rows, out): the exchanged K/V rows once they arrived, and `out` unchanged."""
        token, self._token = self._token, None  # from here the graph holds the token: no cycle through this object
        return _Finish.apply(token, out, self)


def _start(pending: PendingExchange, k, v) -> None:
    pending.k_shape, pending.v_shape = tuple(k.shape), tuple(v.shape)
    pending.start_forward(k, v)


class _Now(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, pending: PendingExchange):
        ctx.pending = pending
        _start(pending, k, v)
        return pending.finish_forward(pending.collect())

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        ctx.pending.start_backward(grad_k, grad_v)
        return (*ctx.pending.finish_backward(ctx.pending.collect()), None)


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, pending: PendingExchange):
        ctx.pending = pending
        _start(pending, k, v)
        return k.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        del grad_token
        return (*ctx.pending.finish_backward(ctx.pending.collect()), None)


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, out, pending: PendingExchange):
        del token
        ctx.pending = pending
        k_rows, v_rows = pending.finish_forward(pending.collect())
        return k_rows, v_rows, out.view_as(out)

    @staticmethod
    def backward(ctx, grad_k, grad_v, grad_out):
        if ctx.needs_input_grad[0]:  # K and V need gradients (alike on every rank): start the reverse collective
            ctx.pending.start_backward(grad_k, grad_v)
        return None, grad_out, None
