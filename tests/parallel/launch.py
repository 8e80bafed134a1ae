"""Run a function on N gloo ranks on loopback, bounded in time.

``run_world(fn, n, *args)`` spawns n processes, each with the torchrun
environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT),
calls ``fn(*args)`` in each (``fn`` must be importable: a module-level
function), and returns the list of return values by rank. An exception in
any rank, or a timeout, fails the caller with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, queue, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                      OMP_NUM_THREADS="1")
    try:
        import torch
        torch.set_num_threads(1)
        from cuboid.kernels import use_backend

        with use_backend("torch"):
            result = fn(*args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn, world: int, *args, timeout: float = 180.0):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, queue, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            (results if status == "ok" else errors)[rank] = value
            if errors:
                break
    except Exception as e:  # queue.Empty on timeout
        errors[-1] = f"timed out after {timeout:.0f} s waiting for ranks ({type(e).__name__})"
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        rank = min(errors)
        raise AssertionError(f"rank {rank} failed:\n{errors[rank]}")
    return [results[r] for r in range(world)]
