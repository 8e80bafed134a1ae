"""Checkpoint save/load throughput and peak memory: cuboid vs transformers, and tp=4 folder loads.

    python bench/checkpoint.py [--preset gpt2-medium] [--shard-sizes 5GB,500MB] [--repeats 3] [--dir DIR]
    python bench/checkpoint.py --only loads        # the folder-load rows only (single device + tp=4)

Each measurement runs in its own process (`--worker`), which builds what it
needs first (and warms up on a tiny model: lazy imports and first-call costs
stay out of the timing), then runs the one operation and reports its wall time
and two peaks, both as growth over the process's memory just before the
operation:

- ``peak anon``: ``RssAnon`` of ``/proc/self/status``, sampled every 0.5 ms
  by a thread: the memory the operation really allocated.
- ``peak RSS``: ``VmHWM - VmRSS`` (the peak counter reset through
  ``/proc/self/clear_refs``). It also counts pages of mmap'd files that were
  touched, which are page cache, not memory the process holds: reading a
  1.4 GB checkpoint through ``safe_open`` adds 1.4 GB here however little is
  copied.

The model is fp32 with random weights made here (gpt2-medium: 355M
parameters, 1.42 GB), saved by cuboid (`checkpoint.save`) at each
``max_shard_size``; both libraries then load that same folder.

- save: ``cuboid.zoo.checkpoint.save`` vs ``save_pretrained`` (same
  ``max_shard_size``); cuboid fsyncs every file and hashes every byte (HF does
  neither), so it pays for durability and integrity here.
- load (single device): ``cuboid.load(folder)`` vs
  ``AutoModelForCausalLM.from_pretrained(folder)``, each followed by one read
  of every parameter (either may leave weights mmap-backed and unread until
  first use), in alternating fresh processes, ``--repeats`` times each; the
  table gives the medians and their ratio. Both read the page cache (the
  files were just written): this is CPU and memcpy throughput, not the disk.
- tp=4 load: ``cuboid.load(folder, plan="tp1d-4")`` on 4 gloo processes; each
  rank reports its peak anonymous memory (absolute, and growth during the
  load) beside the contract: its local shard + the largest single tensor +
  300 MB.
- convert (sharded -> single file) and verify: cuboid only.

Prints markdown tables and writes bench/checkpoint.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # the repository root, for tests.parallel.launch: last, so that its
    sys.path.append(str(HERE.parent))  # kernels/ never shadows an installed package (bench/checkpointing imports us)
from tests.parallel.launch import free_port, rank_env  # noqa: E402


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _touch(model) -> float:
    """Read every parameter once: from_pretrained can leave weights mmap-backed and unread, so a
    load is timed up to a model whose bytes have actually been read, for both libraries."""
    return float(sum(p.detach().float().sum() for p in model.parameters()))


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    return _status("VmRSS")


class AnonPeak:
    """Samples ``RssAnon`` in a thread; ``peak`` is the highest value seen, in bytes."""

    def __init__(self, period: float = 5e-4) -> None:
        import threading

        self.period, self.peak = period, self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        return _status("RssAnon")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())
        return self.peak


def _folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))


# ---------------------------------------------------------------------- workers


def _warm_up(op: str, scratch: Path) -> None:
    """The same operation on a tiny model first: lazy imports and first-call costs stay out of the timing.

    Under ``tp-load`` every rank runs this with the same ``scratch`` (the save is collective).
    """
    import cuboid
    from cuboid.zoo import checkpoint

    tiny = cuboid.load("gpt-debug")
    copy = scratch.with_name(scratch.name + "-c")
    checkpoint.save(tiny, scratch, max_shard_size="100KB")
    if op == "tp-load":
        cuboid.load(scratch, plan="tp1d-4")
        return
    if op.startswith("cuboid"):
        cuboid.load(scratch)
        checkpoint.verify(scratch)
        checkpoint.convert(scratch, copy, progress=False)
    else:
        import transformers as T

        T.AutoModelForCausalLM.from_pretrained(scratch).save_pretrained(copy)
        T.AutoModelForCausalLM.from_pretrained(copy)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(copy, ignore_errors=True)


def _largest_tensor(path: Path) -> int:
    from cuboid.zoo import checkpoint

    ts = checkpoint.TensorFolder(path)
    return max(math.prod(s) * torch_itemsize(d) for s, d in (ts.shape_dtype(n) for n in ts.keys()))


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _tp_load(path: Path) -> dict:
    """One rank of the tp=4 folder load (started by :func:`run_tp` with the torchrun environment)."""
    import torch.distributed as dist

    import cuboid

    rank = dist.get_rank()
    before, anon = _reset_peak(), AnonPeak()
    anon0 = anon.peak
    t0 = time.perf_counter()
    model = cuboid.load(path, plan="tp1d-4")
    seconds = time.perf_counter() - t0
    peak = anon.stop()
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    return {"rank": rank, "seconds": seconds, "anon_before": anon0, "peak_anon_abs": peak,
            "peak_anon": peak - anon0, "local": local, "largest": _largest_tensor(path),
            "peak_rss": _status("VmHWM") - before}


def worker(op: str, preset: str, root: Path, shard: str) -> dict:
    import torch

    torch.set_grad_enabled(False)
    import cuboid
    from cuboid.zoo import checkpoint

    ours, theirs = root / f"cuboid-{shard}", root / f"hf-{shard}"
    if op == "tp-load":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    _warm_up(op, root / f"warm-{op}")
    extra = {}
    if op == "tp-load":
        return {"op": op, "shard": shard, **_tp_load(ours)}
    if op == "cuboid-save":
        model = cuboid.load(preset)
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        checkpoint.save(model, ours, max_shard_size=shard)
        seconds, path = time.perf_counter() - t0, ours
    elif op == "hf-save":
        import transformers as T

        model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(ours))
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        model.save_pretrained(theirs, max_shard_size=shard)
        seconds, path = time.perf_counter() - t0, theirs
    elif op in ("cuboid-load", "hf-load"):
        if op == "hf-load":
            import transformers as T

            T.GPT2LMHeadModel  # import the model code outside the timed region
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        model = cuboid.load(ours) if op == "cuboid-load" else T.AutoModelForCausalLM.from_pretrained(ours)
        extra["load_seconds"] = time.perf_counter() - t0
        _touch(model)
        seconds, path = time.perf_counter() - t0, ours
    elif op == "cuboid-convert":
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        checkpoint.convert(ours, root / "converted", progress=False)
        seconds, path = time.perf_counter() - t0, root / "converted"
    elif op == "cuboid-verify":
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        checkpoint.verify(ours)
        seconds, path = time.perf_counter() - t0, ours
    else:
        raise SystemExit(f"unknown worker {op}")
    peak_anon = anon.stop() - anon0
    return {"op": op, "shard": shard, "seconds": seconds, "bytes": _folder_bytes(path),
            "peak_rss": _status("VmHWM") - before, "peak_anon": peak_anon, "rss_before": before, **extra}


def _command(op: str, args, shard: str) -> list:
    return [sys.executable, __file__, "--worker", op, "--preset", args.preset, "--dir", str(args.dir),
            "--shard", shard]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run_worker(op: str, args, shard: str) -> dict:
    out = subprocess.run(_command(op, args, shard), check=True, capture_output=True, text=True, env=_env(),
                         timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_tp(args, shard: str, world: int = 4) -> list:
    """The tp=4 load on ``world`` local gloo processes (the torchrun environment, set by hand)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**_env(), **rank_env(rank, world, port)}
        procs.append(subprocess.Popen(_command("tp-load", args, shard), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"tp-load rank {rank} failed:\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


# ------------------------------------------------------------------------ driver


def mb(n: float) -> float:
    return n / 1e6


def table(rows: list) -> str:
    head = ("operation", "max_shard_size", "cuboid s", "cuboid MB/s", "HF s", "HF MB/s", "speed cuboid/HF",
            "cuboid peak anon MB", "HF peak anon MB", "cuboid peak RSS MB", "HF peak RSS MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c, h = r["cuboid"], r.get("hf")
        cells = [r["operation"], r["shard"], f"{c['seconds']:.2f}", f"{mb(c['bytes']) / c['seconds']:.0f}"]
        if h:
            cells += [f"{h['seconds']:.2f}", f"{mb(h['bytes']) / h['seconds']:.0f}",
                      f"{(c['bytes'] / c['seconds']) / (h['bytes'] / h['seconds']):.2f}",
                      f"{mb(c['peak_anon']):.0f}", f"{mb(h['peak_anon']):.0f}",
                      f"{mb(c['peak_rss']):.0f}", f"{mb(h['peak_rss']):.0f}"]
        else:
            cells += ["-", "-", "-", f"{mb(c['peak_anon']):.0f}", "-", f"{mb(c['peak_rss']):.0f}", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _median(runs: list, key: str) -> float:
    return statistics.median(r[key] for r in runs)


def load_table(rows: list) -> str:
    head = ("max_shard_size", "cuboid load s", "cuboid load+read s", "HF load s", "HF load+read s",
            "speed cuboid/HF", "cuboid peak anon MB", "HF peak anon MB", "cuboid peak RSS MB", "HF peak RSS MB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c, h = r["cuboid"], r["hf"]
        cells = [r["shard"], f"{_median(c, 'load_seconds'):.2f}", f"{_median(c, 'seconds'):.2f}",
                 f"{_median(h, 'load_seconds'):.2f}", f"{_median(h, 'seconds'):.2f}", f"{r['ratio']:.2f}",
                 f"{mb(max(x['peak_anon'] for x in c)):.0f}", f"{mb(max(x['peak_anon'] for x in h)):.0f}",
                 f"{mb(max(x['peak_rss'] for x in c)):.0f}", f"{mb(max(x['peak_rss'] for x in h)):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tp_table(ranks: list) -> str:
    head = ("rank", "load s", "local shard MB", "largest tensor MB", "RssAnon before MB", "peak RssAnon MB",
            "growth MB", "bound MB (shard + largest + 300)", "within")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ranks:
        bound = r["local"] + r["largest"] + 300e6
        cells = [str(r["rank"]), f"{r['seconds']:.2f}", f"{mb(r['local']):.0f}", f"{mb(r['largest']):.0f}",
                 f"{mb(r['anon_before']):.0f}", f"{mb(r['peak_anon_abs']):.0f}", f"{mb(r['peak_anon']):.0f}",
                 f"{mb(bound):.0f}", "yes" if r["peak_anon_abs"] <= bound else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2-medium")
    ap.add_argument("--shard-sizes", default="5GB,500MB", help="comma-separated max_shard_size values")
    ap.add_argument("--repeats", type=int, default=3, help="single-device loads per library (medians reported)")
    ap.add_argument("--only", choices=("all", "loads"), default="all",
                    help="loads: the folder loads only (no HF save, verify, convert)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, default=HERE / "checkpoint.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--shard", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.preset, args.dir, args.shard)))
        return
    scratch = args.dir is None
    args.dir = Path(tempfile.mkdtemp(prefix="cuboid-bench-")) if scratch else args.dir
    args.dir.mkdir(parents=True, exist_ok=True)
    shards = args.shard_sizes.split(",")
    rows, loads, tp = [], [], []
    try:
        for shard in shards:
            save = run_worker("cuboid-save", args, shard)  # also makes the folder both libraries load
            if args.only == "all":
                rows.append({"operation": "save", "shard": shard, "cuboid": save, "hf": run_worker("hf-save", args, shard)})
            runs = {"cuboid-load": [], "hf-load": []}
            for _ in range(args.repeats):  # alternate, so that both see the same machine
                for op in runs:
                    runs[op].append(run_worker(op, args, shard))
            c, h = runs["cuboid-load"], runs["hf-load"]
            loads.append({"shard": shard, "cuboid": c, "hf": h, "ratio": _median(h, "seconds") / _median(c, "seconds")})
            if shard == shards[-1]:
                tp = run_tp(args, shard)
                if args.only == "all":
                    rows.append({"operation": "verify", "shard": shard, "cuboid": run_worker("cuboid-verify", args, shard)})
                    rows.append({"operation": "convert to one file", "shard": shard,
                                 "cuboid": run_worker("cuboid-convert", args, shard)})
                    shutil.rmtree(args.dir / "converted", ignore_errors=True)
            for d in (f"cuboid-{shard}", f"hf-{shard}"):
                shutil.rmtree(args.dir / d, ignore_errors=True)
    finally:
        if scratch:
            shutil.rmtree(args.dir, ignore_errors=True)
    import torch

    total = loads[0]["cuboid"][0]["bytes"]
    print(f"checkpoint bench: {args.preset} fp32, {total / 1e9:.2f} GB, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}\n")
    parts = {}
    if rows:
        parts["save, verify, convert"] = table(rows)
    parts[f"single-device folder load (median of {args.repeats}; speed = HF s / cuboid s, load+read)"] = \
        load_table(loads)
    parts[f"tp=4 folder load (tp1d-4, 4 gloo processes, max_shard_size {shards[-1]})"] = tp_table(tp)
    md = "\n\n".join(f"{title}:\n\n{body}" for title, body in parts.items())
    print(md)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "preset": args.preset,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "rows": rows, "loads": loads, "tp_load": tp, "table": md}, indent=2) + "\n")


if __name__ == "__main__":
    main()
