"""ZeRO model-state memory and step time: plain dp and stages 1-3 on 4 gloo CPU ranks.

    python bench/zero.py [--model gpt2-medium] [--plans dp,zero1,zero2,zero3] [--steps 3] [--seq 16]
                         [--ranks 4] [--timeout 2400] [--mem-floor-gb 3] [--wait 900] [--json bench/zero.json]

Each plan (``dp``: ``Plan(dp=4)``; ``zeroK``: ``Plan(dp=4, zero=K)``) runs as
its own world of ``--ranks`` gloo processes on 127.0.0.1, one world after the
other, so only one plan's memory is alive at a time. Every rank builds
``cuboid.load(model, plan, dtype=torch.bfloat16, mesh=Mesh.build(plan))``
with ``cuboid.parallel.optim.AdamW(lr=1e-4)``, which keeps an fp32 master
copy and fp32 ``exp_avg`` / ``exp_avg_sq`` for every bf16 element it steps
(12 bytes of state per parameter), and trains on random token ids, 1 sequence
of ``--seq`` tokens per rank (global batch (ranks, seq), labels = inputs):

1. step 1 (``cuboid.train_step``): warm-up; the optimizer state appears;
2. step 2, the natural loop: ``share = cuboid.rank_share(model, batch)``,
   ``model(**share).loss.backward()``, then
   ``zero.model_state_bytes(model, opt)`` (params, grads, optimizer,
   masters: what the rank holds with gradients and optimizer state both
   alive), then ``opt.step()``, ``opt.zero_grad()``;
3. ``--steps`` timed ``cuboid.train_step`` calls (a barrier before each; a
   step's time is the slowest rank's; the table gives the median).

Measured per rank, beside ``zero.formula_bytes(P, stage, ranks,
param_bytes=2, state_bytes=12)`` (P = the model's parameter count, stage 0
for plain dp: 16 P, 4 P + 12 P/N, 2 P + 14 P/N, 16 P/N):

- model-state bytes at step 2 and their difference from the formula;
- ``RssAnon`` of ``/proc/self/status`` before the model is built (the
  interpreter, torch, gloo), at the step-2 measurement, and its peak while
  building and over the steps (sampled every 0.5 ms by ``AnonPeak`` from
  bench/checkpoint.py): what the run really allocated, model states,
  activations, gradient buckets, optimizer temporaries and allocator slack
  together; at step 2 also after ``malloc_trim(0)``, which hands glibc's
  free heap pages back to the kernel, so that memory freed but kept by
  ``malloc`` (blocks under its 32 MB mmap threshold come from the heap) is
  told apart from memory still in use;
- the median step time, as a ratio to plain dp's in the same invocation (to
  zero1's when dp did not run or did not fit, and the column says so).

The driver watches memory while a world runs: when ``MemAvailable`` falls
below ``--mem-floor-gb`` it kills the world and the row says the plan did
not fit (the ranks also set ``oom_score_adj`` to 1000, so that if the kernel
has to kill something it kills them, not the machine's other jobs). Before a
world starts it waits (up to ``--wait`` seconds) until the machine has the
memory the plan should need, so that it does not fight other jobs for it. A
world that runs past ``--timeout`` or whose rank fails is killed and
reported with the rank's error.

On a CPU without native bf16 (AVX2), bf16 matmuls run at 0.2-10 GFLOP/s per
core (depending on the operands' layout), so a gpt2-medium step of 64 tokens
per rank takes minutes: the default is 16 tokens. Activations stay small
either way; model states do not depend on it.

Prints markdown tables and writes ``--json``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository root: tests.parallel.launch

from tests.parallel.launch import free_port, rank_env  # noqa: E402


def _bench_checkpoint():
    """bench/checkpoint.py as a module (bench/ is not a package): its ``AnonPeak`` sampler."""
    spec = importlib.util.spec_from_file_location("_bench_checkpoint", HERE / "checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_of(name: str, ranks: int):
    from cuboid.parallel import Plan

    if name == "dp":
        return Plan(dp=ranks)
    m = re.fullmatch(r"zero([123])", name)
    if not m:
        raise SystemExit(f"unknown plan {name!r}: use dp, zero1, zero2, zero3")
    return Plan(dp=ranks, zero=int(m.group(1)))


def stage_of(name: str) -> int:
    return 0 if name == "dp" else int(name[-1])


# ---------------------------------------------------------------------- worker


def _malloc_trim() -> bool:
    """Hand glibc's free heap pages back to the kernel (``malloc_trim(0)``); False where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def worker(args) -> dict:
    """One rank of one plan's world (started by :func:`run_plan` with the torchrun environment)."""
    try:  # if the kernel must kill something for memory, kill this rank first
        Path("/proc/self/oom_score_adj").write_text("1000")
    except OSError:
        pass
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    import cuboid
    from cuboid.parallel import Mesh, zero
    from cuboid.parallel.optim import AdamW

    AnonPeak = _bench_checkpoint().AnonPeak
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_of(args.worker, world)
    dist.barrier()
    before = AnonPeak.now()
    build = AnonPeak()
    t0 = time.perf_counter()
    model = cuboid.load(args.model, plan, dtype=torch.bfloat16, mesh=Mesh.build(plan)).train()
    opt = AdamW(model.parameters(), lr=1e-4)
    build_s = time.perf_counter() - t0
    build_peak = build.stop()
    numel = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    gen = torch.Generator().manual_seed(0)  # the same global batches on every rank

    def batch() -> dict:
        ids = torch.randint(0, model.config.vocab_size, (world, args.seq), generator=gen)
        return {"input_ids": ids, "labels": ids}

    sampler = AnonPeak()
    t0 = time.perf_counter()
    cuboid.train_step(model, opt, batch())  # step 1: warm-up, makes the optimizer state
    warm_s = time.perf_counter() - t0
    share = cuboid.rank_share(model, batch())  # step 2: held model states after the backward
    model(**share).loss.backward()
    held = zero.model_state_bytes(model, opt)
    held_anon = AnonPeak.now()
    trimmed = AnonPeak.now() if _malloc_trim() else None  # what is left once malloc's free pages go back
    opt.step()
    opt.zero_grad()
    times = []
    for _ in range(args.steps):
        b = batch()
        dist.barrier()
        t0 = time.perf_counter()
        cuboid.train_step(model, opt, b)
        times.append(time.perf_counter() - t0)
    steps_peak = sampler.stop()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "plan": args.worker, "stage": plan.zero, "numel": numel, "held": held,
            "formula": zero.formula_bytes(numel, plan.zero, world, param_bytes=2, state_bytes=12),
            "anon_before": before, "anon_held": held_anon, "anon_trimmed": trimmed, "peak_build": build_peak,
            "peak_steps": steps_peak,
            "build_s": build_s, "warmup_s": warm_s, "step_s": times}


# ---------------------------------------------------------------------- driver


def _meminfo(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024


def _anon_of(pid: int) -> int:
    try:
        return int(re.search(r"RssAnon:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def _param_count(model: str) -> int:
    import cuboid

    m = cuboid.load(model, device="meta")
    return sum(p.numel() for p in dict.fromkeys(m.parameters()))


def expected_bytes(numel: int, stage: int, ranks: int) -> int:
    """A rough per-rank need, to wait for memory before a world starts: the model states, the step's
    fp32 temporaries (gradient copy and denominator, 8 bytes per stepped element), plain dp's gradient
    buckets, 0.4 GB of interpreter, torch and activations; 15% more for what malloc keeps."""
    from cuboid.parallel import zero

    states = zero.formula_bytes(numel, stage, ranks, param_bytes=2, state_bytes=12)
    stepped = numel if stage == 0 else math.ceil(numel / ranks)
    return int(1.15 * (states + 8 * stepped + (2 * numel if stage == 0 else 0))) + int(0.4e9)


def wait_for_memory(need: int, floor: int, wait: float) -> dict:
    """Wait until ``need`` + ``floor`` bytes are available (other jobs share the machine), at most ``wait`` s."""
    t0, total = time.monotonic(), _meminfo("MemTotal")
    if need + floor > total:  # waiting cannot help: run it, guarded
        return {"waited_s": 0.0, "available": _meminfo("MemAvailable"), "fits_by_estimate": False}
    while _meminfo("MemAvailable") < need + floor and time.monotonic() - t0 < wait:
        print(f"  waiting for memory: {_meminfo('MemAvailable') / 2**30:.1f} GiB available, "
              f"{(need + floor) / 2**30:.1f} GiB wanted", file=sys.stderr, flush=True)
        time.sleep(15)
    return {"waited_s": time.monotonic() - t0, "available": _meminfo("MemAvailable"), "fits_by_estimate": True}


def run_plan(name: str, args) -> dict:
    """Run one plan on ``args.ranks`` processes (each ``python bench/zero.py --worker``, so the driver reads
    every rank's own RssAnon), watching memory, time and failures."""
    port, world = free_port(), args.ranks
    env0 = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, __file__, "--worker", name, "--model", args.model, "--steps", str(args.steps),
           "--seq", str(args.seq), "--timeout", str(args.timeout)]
    procs, outs, errs = [], [], []
    for rank in range(world):
        env = {**env0, **rank_env(rank, world, port)}
        outs.append(tempfile.TemporaryFile("w+"))
        errs.append(tempfile.TemporaryFile("w+"))
        procs.append(subprocess.Popen(cmd, stdout=outs[-1], stderr=errs[-1], text=True, env=env, cwd=HERE))
    t0, floor, load0 = time.monotonic(), int(args.mem_floor_gb * 2**30), os.getloadavg()[0]
    seen = [0] * world  # the highest RssAnon the driver saw per rank
    status, detail, low = "ok", "", _meminfo("MemAvailable")
    try:
        while any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                seen[r] = max(seen[r], _anon_of(p.pid))
            low = min(low, _meminfo("MemAvailable"))
            failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                r, rc = failed[0]
                status = "killed" if rc == -signal.SIGKILL else "failed"
                detail = (f"rank {r} was killed by SIGKILL (the kernel's OOM killer?)" if status == "killed"
                          else f"rank {r} exited with {rc}")
                break
            if low < floor:
                status = "memory"
                detail = (f"MemAvailable fell to {low / 2**30:.1f} GiB (< {args.mem_floor_gb} GiB): "
                          f"world stopped at {max(seen) / 1e9:.2f} GB RssAnon per rank")
                break
            if time.monotonic() - t0 > args.timeout:
                status, detail = "timeout", f"ran past {args.timeout:.0f} s"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    wall = time.monotonic() - t0
    results, stderr = [], []
    for r, (p, out, err) in enumerate(zip(procs, outs, errs)):
        out.seek(0)
        err.seek(0)
        lines = out.read().strip().splitlines()
        stderr.append(err.read())
        if status == "ok" and p.returncode == 0 and lines:
            results.append(json.loads(lines[-1]))
    if status == "ok" and len(results) != world:
        status, detail = "failed", "a rank returned no result"
    if status != "ok":
        tails = [s.strip()[-2000:] for s in stderr if "Traceback" in s or "Error" in s]
        if status == "failed" and tails:
            detail += ":\n" + tails[0]
        print(f"{name}: {status}: {detail}", file=sys.stderr, flush=True)
    return {"plan": name, "status": status, "detail": detail, "wall_s": wall, "ranks": results,
            "driver_peak_anon": seen, "min_available": low, "floor_gb": args.mem_floor_gb,
            "loadavg_1min": [load0, os.getloadavg()[0]]}


# ---------------------------------------------------------------------- tables


def gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def summarise(run: dict, numel: int, ranks: int) -> dict:
    from cuboid.parallel import zero

    stage = stage_of(run["plan"])
    row = {"plan": run["plan"], "stage": stage, "status": run["status"], "detail": run["detail"],
           "formula": zero.formula_bytes(numel, stage, ranks, param_bytes=2, state_bytes=12), "wall_s": run["wall_s"],
           "floor_gb": run["floor_gb"]}
    if run["status"] != "ok":
        row["driver_peak_anon"] = max(run["driver_peak_anon"])
        return row
    rs = run["ranks"]
    held = max(rs, key=lambda r: r["held"]["total"])["held"]
    steps = [max(r["step_s"][i] for r in rs) for i in range(len(rs[0]["step_s"]))]  # the slowest rank's
    row.update(held=held, diff=(held["total"] - row["formula"]) / row["formula"],
               anon_before=max(r["anon_before"] for r in rs), anon_held=max(r["anon_held"] for r in rs),
               anon_trimmed=max(r["anon_trimmed"] or 0 for r in rs),
               peak_build=max(r["peak_build"] for r in rs), peak_steps=max(r["peak_steps"] for r in rs),
               step_s=statistics.median(steps), steps=steps, build_s=max(r["build_s"] for r in rs),
               warmup_s=max(r["warmup_s"] for r in rs))
    return row


def table(rows: list, ranks: int) -> tuple:
    ok = {r["plan"]: r for r in rows if r["status"] == "ok"}
    ref = "dp" if "dp" in ok else ("zero1" if "zero1" in ok else None)
    head = ("plan", "formula GB/rank", "model states GB/rank", "diff %", "RssAnon before GB",
            "RssAnon at step 2 GB", "same after malloc_trim GB", "peak RssAnon build GB", "peak RssAnon steps GB",
            "step s", f"ratio to {ref}" if ref else "ratio")
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        if r["status"] != "ok":
            why = {"memory": f"did not fit in {_meminfo('MemTotal') / 2**30:.0f} GiB (stopped when MemAvailable "
                             f"fell below {r['floor_gb']:g} GiB",
                   "killed": "killed by SIGKILL (", "timeout": "timed out (", "failed": "failed ("}[r["status"]]
            seen = f"at {gb(r['driver_peak_anon'])} GB RssAnon/rank; " if r.get("driver_peak_anon") else ""
            lines.append(f"| {r['plan']} | {gb(r['formula'])} | {why}{', ' if why[-1] != '(' else ''}{seen}"
                         f"formula x {ranks} ranks = {gb(ranks * r['formula'])} GB) |" + " - |" * (len(head) - 3))
            continue
        ratio = f"{r['step_s'] / ok[ref]['step_s']:.2f}" if ref else "-"
        lines.append("| " + " | ".join([
            r["plan"], gb(r["formula"]), gb(r["held"]["total"]), f"{100 * r['diff']:+.1f}", gb(r["anon_before"]),
            gb(r["anon_held"]), gb(r["anon_trimmed"]) if r["anon_trimmed"] else "-", gb(r["peak_build"]),
            gb(r["peak_steps"]), f"{r['step_s']:.2f}", ratio]) + " |")
    return "\n".join(lines), ref


def kinds_table(rows: list) -> str:
    head = ("plan", "params GB", "grads GB", "optimizer GB", "masters GB", "total GB", "formula GB")
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        if r["status"] == "ok":
            h = r["held"]
            lines.append("| " + " | ".join([r["plan"]] + [gb(h[k]) for k in ("params", "grads", "optimizer",
                                                                             "masters", "total")]
                                           + [gb(r["formula"])]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2-medium", help="a zoo preset")
    ap.add_argument("--plans", default="dp,zero1,zero2,zero3", help="comma-separated: dp, zero1, zero2, zero3")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up and the measured step")
    ap.add_argument("--seq", type=int, default=16, help="tokens per rank (batch 1 per rank)")
    ap.add_argument("--ranks", type=int, default=4, help="dp ranks (gloo processes)")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per world before it is killed")
    ap.add_argument("--mem-floor-gb", type=float, default=3.0,
                    help="kill a world when the machine's MemAvailable falls below this (GiB)")
    ap.add_argument("--wait", type=float, default=900.0, help="seconds to wait for free memory before a world")
    ap.add_argument("--json", type=Path, default=HERE / "zero.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    import torch

    names = [n for n in args.plans.split(",") if n]
    for n in names:
        plan_of(n, args.ranks)  # unknown names stop here
    numel = _param_count(args.model)
    print(f"zero bench: {args.model} ({numel / 1e6:.1f}M params) bf16, AdamW (fp32 masters and moments), "
          f"{args.ranks} gloo ranks, {args.seq} tokens/rank, {os.cpu_count()} CPUs, "
          f"{_meminfo('MemTotal') / 2**30:.1f} GiB, torch {torch.__version__}", file=sys.stderr, flush=True)
    t_start, runs = time.monotonic(), []
    for name in names:
        need = expected_bytes(numel, stage_of(name), args.ranks) * args.ranks
        mem = wait_for_memory(need, int(args.mem_floor_gb * 2**30), args.wait)
        print(f"{name}: starting ({mem['available'] / 2**30:.1f} GiB available, about {need / 2**30:.1f} GiB "
              f"expected{'' if mem['fits_by_estimate'] else ', more than the machine has: guarded run'})",
              file=sys.stderr, flush=True)
        run = run_plan(name, args)
        run["memory_before"] = mem
        runs.append(run)
        print(f"{name}: {run['status']} in {run['wall_s']:.0f} s (1-minute load average {run['loadavg_1min'][0]:.1f}"
              f" at the start, {run['loadavg_1min'][1]:.1f} at the end)", file=sys.stderr, flush=True)
    rows = [summarise(r, numel, args.ranks) for r in runs]
    main_md, ref = table(rows, args.ranks)
    md = (f"{args.model}, {numel / 1e6:.1f}M params, bf16 params, {args.ranks} ranks, {args.seq} tokens/rank; "
          f"per rank, the largest over ranks; step s: median of {args.steps} (slowest rank each)\n\n{main_md}\n\n"
          f"model states at step 2 by kind (the rank holding the most):\n\n{kinds_table(rows)}")
    print(md)
    total = time.monotonic() - t_start
    print(f"\ntotal {total:.0f} s", file=sys.stderr)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
        "model": args.model, "numel": numel, "ranks": args.ranks, "seq": args.seq, "steps": args.steps,
        "ratio_reference": ref, "total_s": total,
        "machine": {"cpus": os.cpu_count(), "mem_total": _meminfo("MemTotal"), "python": platform.python_version(),
                    "torch": torch.__version__},
        "rows": rows, "runs": runs, "table": md}, indent=2) + "\n")


if __name__ == "__main__":
    main()
