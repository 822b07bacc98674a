"""A pool of processes that share one real gloo process group per world size (or, with
`backend="nccl"`, one NCCL group with one process per GPU: rank r on GPU r).

Starting a process imports torch, transformers and the library (seconds), so each world size gets
one group for the whole session and every test case runs inside it; on a host without CUDA the
workers are forked from a fork server that imported them once (`_context`). A case is a module-level
function `case(rank, world_size, group, **kwargs)`; its return values come back as a list
indexed by rank. A case that raises on any rank fails the test with that rank's traceback;
a case that does not finish in time has every rank print its threads' stacks to stderr, then
kills the pool (the next test starts a fresh one).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import os
import queue
import signal
import socket
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox, outbox, backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A case that times out gets every thread's stack on stderr before the pool is killed (see _collect).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    kwargs = {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **kwargs)
    group = dist.group.WORLD
    # Everything imported so far lives for the whole session: the Trainer and accelerate call
    # gc.collect() at each setup and teardown, and each call walked these ~350k objects (0.16 s).
    gc.freeze()
    outbox.put((rank, "ready", None))
    while True:
        job = inbox.get()
        if job is None:
            break
        module, name, kwargs = job
        try:
            fn = getattr(importlib.import_module(module), name)
            result = fn(rank, world_size, group, **kwargs)
            outbox.put((rank, "ok", result))
        except BaseException:  # noqa: BLE001 - every failure must reach the parent
            outbox.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class CaseFailed(AssertionError):
    pass


# What every worker imports before its first case: loaded once by the fork server (see `_context`);
# `helpers.dynamo_warmup` does dynamo's one-time set-up there, which each worker's first compile would pay.
PRELOAD = ("torch", "torch.distributed", "transformers", "hf_blockdiag_cp", "helpers.reference", "helpers.model_zoo", "accelerate", "trl", "peft", "datasets",
           "helpers.dynamo_warmup")


def _context(backend: str):
    """Forked from a fork server that imported PRELOAD once, on CPU-only hosts (seconds saved per
    worker: each would import torch, transformers and the library itself); spawned where CUDA is
    present (a fork must not inherit an initialised CUDA driver) or for NCCL."""
    import torch

    if backend != "gloo" or torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class GlooPool:
    def __init__(self, world_size: int, start_timeout: float = 180.0, backend: str = "gloo"):
        self.world_size = world_size
        ctx = _context(backend)
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.inboxes[r], self.outbox, backend), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        _, errors = self._collect("start", start_timeout)
        if errors:
            self.close(force=True)
            raise CaseFailed(f"pool start failed: {errors}")

    def _collect(self, what: str, timeout: float):
        """Wait for one answer per rank: `(results_by_rank, errors_by_rank)`; kill the pool on timeout."""
        results, errors = {}, {}
        start = time.monotonic()
        while len(results) + len(errors) < self.world_size:
            try:
                rank, status, payload = self.outbox.get(timeout=max(timeout - (time.monotonic() - start), 0.01))
            except queue.Empty:
                self.dump_stacks()
                self.close(force=True)
                answered = sorted(set(results) | set(errors))
                raise CaseFailed(f"{what}: timed out after {timeout:.0f}s; ranks that answered: {answered}; errors: {errors}")
            (errors if status == "error" else results)[rank] = payload
        return results, errors

    def dump_stacks(self) -> None:
        """Every live worker prints all its threads' stacks to stderr (where a hung collective waits)."""
        for p in self.procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2.0)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run_collecting(self, fn, timeout: float = 300.0, **kwargs):
        """Run module-level `fn(rank, world_size, group, **kwargs)` on every rank; `(results, errors)` by rank."""
        for inbox in self.inboxes:
            inbox.put((fn.__module__, fn.__name__, kwargs))
        return self._collect(f"{fn.__name__}({kwargs})", timeout)

    def run(self, fn, timeout: float = 300.0, **kwargs):
        """Like `run_collecting`, but raise CaseFailed with every failing rank's traceback."""
        results, errors = self.run_collecting(fn, timeout, **kwargs)
        if errors:
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise CaseFailed(f"{fn.__name__}({kwargs}) failed on ranks {sorted(errors)}:\n{msg}")
        return [results[r] for r in range(self.world_size)]

    def close(self, force: bool = False):
        if not force:
            for inbox in self.inboxes:
                inbox.put(None)
            for p in self.procs:
                p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
