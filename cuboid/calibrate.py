"""``cuboid plans --calibrate``: measure this machine into the ``local`` hardware profile.

Four short probes (about 20 s), each on one thread as the launcher's ranks
run: the sustained FLOP/s of training (a reference GPT's forward and
backward, FLOPs counted as :func:`cuboid.parallel.cost.step_flops` counts
them, so matmul efficiency, attention, norms and Python overhead are in the
rate), the ratio of bf16 to fp32 matmul speed, the bytes per second of an
AdamW step (the optimizer is memory bound), and gloo all-reduces between two
local processes on 127.0.0.1 at four sizes, fitted to ``alpha + bytes /
bandwidth``. The profile counts the cores: more ranks than cores share them.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from cuboid.parallel.cost import Hardware, Link, user_hardware_dir

SIZES = (4 << 10, 256 << 10, 2 << 20, 8 << 20)  # all-reduce probe sizes in bytes


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype = torch.float32, n: int = 384, reps: int = 7) -> float:
    """FLOP/s of an ``n x n`` matmul on one thread (what one rank of a local run gets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t = _best(lambda: (a @ b, a.t() @ b, a @ b.t()), reps)
    finally:
        torch.set_num_threads(threads)
    return 3 * 2 * n ** 3 / t


# the reference model of the training probe (tests time other sizes against it)
PROBE = dict(vocab_size=768, n_positions=96, dim=192, n_layers=3, n_heads=6, mlp_hidden=0)
PROBE_BATCH, PROBE_SEQ = 8, 96


def training_flops(reps: int = 3) -> float:
    """Sustained FLOP/s of an fp32 training step (forward, backward; no optimizer) of :data:`PROBE`."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel.cost import Shape, step_flops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = zoo.config_of("gpt-debug", **PROBE)
        model = cuboid.load(config)
        ids = torch.randint(0, config.vocab_size, (PROBE_BATCH, PROBE_SEQ), generator=torch.Generator().manual_seed(0))

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        t = _best(step, reps)
    finally:
        torch.set_num_threads(threads)
    return step_flops(Shape.of(config), PROBE_BATCH, PROBE_SEQ) / t


def adamw_bytes_per_s(numel: int = 1 << 21, reps: int = 5) -> float:
    """Bytes per second of an AdamW step, counting 28 bytes per fp32 element (read p, g, m, v; write p, m, v)."""
    from cuboid.parallel.cost import ADAMW_TOUCHED_BYTES
    from cuboid.parallel.optim import AdamW

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = AdamW([p], lr=1e-3)
        t = _best(opt.step, reps)
    finally:
        torch.set_num_threads(threads)
    return ADAMW_TOUCHED_BYTES * numel / t


def _probe_rank(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        out = {}
        for size in SIZES:
            t = torch.ones(size // 4)
            out[size] = _best(lambda: dist.all_reduce(t), 9)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def gloo_link(timeout: float = 120.0) -> Link:
    """Alpha and bandwidth of gloo between two local processes, fitted by least squares on the bytes
    one rank sends (``2 (n - 1) / n`` of the tensor: all of it at n = 2)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_probe_rank, args=(r, port, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        times = queue.get(timeout=timeout)
    except Exception:
        raise RuntimeError(f"the gloo probe on 127.0.0.1:{port} gave no answer within {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    xs, ys = list(times), [times[k] for k in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - slope * mx, 1e-6)
    return Link(alpha_s=alpha, bytes_per_s=1.0 / max(slope, 1e-12))


def calibrate(progress: bool = True, save: bool = True, path: Optional[Path] = None) -> tuple[Hardware, Optional[Path]]:
    """Measure this machine; save it as ``local.toml`` in :func:`~cuboid.parallel.cost.user_hardware_dir`."""
    say = (lambda m: print(m, flush=True)) if progress else (lambda m: None)
    say("calibrating: sustained training FLOP/s (one thread) ...")
    fp32 = training_flops()
    bf16 = fp32 * matmul_flops(torch.bfloat16) / matmul_flops(torch.float32)
    say(f"  fp32 {fp32 / 1e9:.1f} GFLOP/s, bf16 {bf16 / 1e9:.1f} GFLOP/s (by the matmul ratio); AdamW memory "
        "traffic ...")
    mem = adamw_bytes_per_s()
    say(f"  {mem / 1e9:.2f} GB/s; gloo all-reduce between two local ranks ...")
    link = gloo_link()
    say(f"  alpha {link.alpha_s * 1e6:.0f} us, {link.bytes_per_s / 1e9:.2f} GB/s")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 16e9
    hw = Hardware(name="local", gpus_per_node=1 << 20, memory_bytes=float(ram), flops={"fp32": fp32, "bf16": bf16,
                  "fp16": bf16}, memory_bytes_per_s=mem, intra=link, inter=link, cores=cores,
                  description=f"this machine: {cores} CPU cores, gloo on 127.0.0.1 (measured {time.strftime('%Y-%m-%d')})",
                  source="cuboid plans --calibrate")
    if not save:
        return hw, None
    path = path or user_hardware_dir() / "local.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(hw.to_toml())
    os.replace(tmp, path)
    return hw, path
