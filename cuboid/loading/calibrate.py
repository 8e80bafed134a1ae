"""``cuboid plans --calibrate``: measure this machine into the ``local`` hardware profile.

Short probes (about 30 s), each rank on one thread as the launcher's ranks
run:

- matmul FLOP/s (fp32, bf16) at a block's linear size;
- a reference GPT's training step (forward + backward): what its matmul
  FLOPs do not explain is priced per activation element
  (``elementwise_ns``: norms, softmax, adds, the loss, Python), the split
  the cost model applies per plan (1D tensor parallelism repeats part of it);
- the same step in as many processes as cores (``busy``) and in twice as
  many (``oversubscribed``: the extra beyond time slicing);
- an AdamW step (the optimizer is memory bound);
- gloo all-reduces between two local processes on 127.0.0.1: latency from
  an 8-byte one, bandwidth from the two largest.
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

SIZES = (8, 64 << 10, 2 << 20, 8 << 20)  # all-reduce probe sizes in bytes: the first prices latency alone


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype = torch.float32, m: int = 512, k: int = 256, n: int = 768,
                 reps: int = 7) -> float:
    """FLOP/s of an ``(m, k) @ (k, n)`` matmul and its two backward products on one thread (a block's
    linear at the reference model's size: what one rank of a local run gets)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w, g = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.randn(m, n, dtype=dtype)
        t = _best(lambda: (x @ w, g @ w.t(), x.t() @ g), reps)
    finally:
        torch.set_num_threads(threads)
    return 3 * 2 * m * k * n / t


# the reference model of the training probe (tests time other sizes against it)
PROBE = dict(vocab_size=512, n_positions=64, dim=256, n_layers=2, n_heads=8, mlp_hidden=0)
PROBE_BATCH, PROBE_SEQ = 8, 64


def _probe_step():
    """The reference model's forward + backward on one thread, and the FLOPs it counts as."""
    from cuboid.kernels import use_backend
    from cuboid.loading.model import load
    from cuboid.zoo import config_of
    from cuboid.parallel.cost import Shape, step_flops

    torch.set_num_threads(1)
    config = config_of("gpt-debug", **PROBE)
    model = load(config)
    ids = torch.randint(0, config.vocab_size, (PROBE_BATCH, PROBE_SEQ), generator=torch.Generator().manual_seed(0))

    def step():  # the CPU path the ranks of a local run take (never the Triton interpreter)
        with use_backend("torch"):
            model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    return step, step_flops(Shape.of(config), PROBE_BATCH, PROBE_SEQ), config


def training_seconds(reps: int = 3) -> float:
    """Median seconds of the reference model's training step (no optimizer) on one thread."""
    threads = torch.get_num_threads()
    try:
        step, _, _ = _probe_step()
        return _best(step, reps)
    finally:
        torch.set_num_threads(threads)


def _answers(ctx, target, args: list, answers: int, timeout: float, what: str) -> list:
    """Run ``target(*a, queue)`` for each ``a`` of ``args`` in its own spawned process; the first
    ``answers`` values put on the queue, or a RuntimeError naming ``what`` after ``timeout`` seconds."""
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, queue), daemon=True) for a in args]
    for p in procs:
        p.start()
    try:
        return [queue.get(timeout=timeout) for _ in range(answers)]
    except Exception:
        raise RuntimeError(f"{what} gave no answer within {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def _crowd_rank(barrier, reps: int, queue) -> None:
    step, _, _ = _probe_step()
    step()
    barrier.wait()
    queue.put(_best(step, reps))


def crowded_seconds(procs: int, reps: int = 3, timeout: float = 180.0) -> float:
    """Median step of the reference model when ``procs`` processes run it at once (the slowest's)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    return max(_answers(ctx, _crowd_rank, [(barrier, reps)] * procs, procs, timeout,
                        f"the {procs}-process compute probe"))


def adamw_bytes_per_s(numel: int = 1 << 21, reps: int = 5) -> float:
    """Bytes per second of an AdamW step, counting 28 bytes per fp32 element (read p, g, m, v; write p, m, v)."""
    from cuboid.kernels import use_backend
    from cuboid.parallel.cost import ADAMW_TOUCHED_BYTES
    from cuboid.parallel.optim import AdamW

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = torch.nn.Parameter(torch.randn(numel))
        p.grad = torch.randn(numel)
        opt = AdamW([p], lr=1e-3)
        with use_backend("torch"):
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
            t = torch.ones(max(size // 4, 1))
            out[size] = _best(lambda: dist.all_reduce(t), 25 if size < 4096 else 9)
        if rank == 0:
            queue.put(out)
    finally:
        dist.destroy_process_group()


def gloo_link(timeout: float = 120.0) -> Link:
    """Alpha and bandwidth of gloo between two local processes, on the bytes one rank sends
    (``2 (n - 1) / n`` of the tensor: all of it at n = 2)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    times, = _answers(mp.get_context("spawn"), _probe_rank, [(0, port), (1, port)], 1, timeout,
                      f"the gloo probe on 127.0.0.1:{port}")
    # latency: the smallest all-reduce; bandwidth: the slope between the two largest (a least-squares fit
    # over all four lets the big sizes' noise swamp the intercept)
    small, mid, big = SIZES[0], SIZES[-2], SIZES[-1]
    slope = max(times[big] - times[mid], 1e-9) / (big - mid)
    return Link(alpha_s=max(times[small], 1e-6), bytes_per_s=1.0 / slope)


def calibrate(progress: bool = True, save: bool = True, path: Optional[Path] = None) -> tuple[Hardware, Optional[Path]]:
    """Measure this machine; save it as ``local.toml`` in :func:`~cuboid.parallel.cost.user_hardware_dir`."""
    say = (lambda m: print(m, flush=True)) if progress else (lambda m: None)
    from cuboid.parallel.cost import Plan, Shape, Stage, elementwise_elements

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    say("calibrating: matmul FLOP/s and a reference GPT's training step (one thread) ...")
    fp32 = matmul_flops(torch.float32)
    bf16 = matmul_flops(torch.bfloat16)
    _, flops, config = _probe_step()
    alone = training_seconds()
    shape = Shape.of(config)
    rest = max(alone - flops / fp32, 0.0)  # what is not matmul: norms, softmax, adds, the loss, Python
    elementwise_ns = rest / elementwise_elements(shape, Plan(), Stage(shape.n_layers), PROBE_BATCH, PROBE_SEQ) * 1e9
    say(f"  matmul {fp32 / 1e9:.1f} GFLOP/s fp32, {bf16 / 1e9:.1f} bf16; step {alone * 1e3:.0f} ms, of which "
        f"{rest / alone:.0%} not matmul ({elementwise_ns:.2f} ns per activation element); {cores} and "
        f"{2 * cores} processes at once ...")
    busy = crowded_seconds(cores) / alone if cores > 1 else 1.0
    oversubscribed = crowded_seconds(2 * cores) / (2 * busy * alone)
    say(f"  all cores busy: {busy:.2f}x slower; two per core: {oversubscribed:.2f}x beyond time slicing; AdamW "
        "memory traffic ...")
    mem = adamw_bytes_per_s()
    say(f"  {mem / 1e9:.2f} GB/s; gloo all-reduce between two local ranks ...")
    link = gloo_link()
    say(f"  alpha {link.alpha_s * 1e6:.0f} us, {link.bytes_per_s / 1e9:.2f} GB/s")
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        ram = 16e9
    hw = Hardware(name="local", gpus_per_node=1 << 20, memory_bytes=float(ram), flops={"fp32": fp32, "bf16": bf16,
                  "fp16": bf16}, memory_bytes_per_s=mem, intra=link, inter=link, cores=cores,
                  elementwise_ns=elementwise_ns, busy=busy, oversubscribed=oversubscribed, overlap=0.0,
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
