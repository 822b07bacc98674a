"""Which collectives gloo runs with CUDA tensors (several ranks on one GPU); prints one line each."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda", 0)
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    checks = {
        "all_gather_single": lambda: ag(torch.empty(2 * world, device=dev), torch.full((2,), float(rank), device=dev)),
        "reduce_scatter_single": lambda: rs(torch.empty(2, device=dev), torch.ones(2 * world, device=dev)),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(world, device=dev), torch.ones(world, device=dev)),
        "all_reduce": lambda: dist.all_reduce(torch.ones(3, device=dev)),
    }
    for name, fn in checks.items():
        try:
            fn()
            torch.cuda.synchronize()
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - we report what fails
            status = f"FAILS: {type(exc).__name__}: {str(exc)[:120]}"
        if rank == 0:
            print(f"gloo+cuda {name}: {status}", flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, _port()), nprocs=2)
