"""Checkpoint save/load throughput and peak memory: cuboid vs transformers.

    python bench/checkpoint.py [--preset gpt2-medium] [--shard-sizes 5GB,500MB] [--dir DIR]

Each measurement runs in its own process (`--worker`), which builds what it
needs first, then runs the one operation and reports its wall time and two
peaks, both as growth over the process's memory just before the operation:

- ``peak RSS``: ``VmHWM - VmRSS`` (the peak counter reset through
  ``/proc/self/clear_refs``). It counts pages of mmap'd files that were touched,
  which are page cache, not memory the process holds: reading a 1.4 GB
  checkpoint through ``safe_open`` adds 1.4 GB here however little is copied.
- ``peak anon``: anonymous memory (``/proc/self/statm`` resident - shared),
  sampled every 0.5 ms by a thread: what the operation really allocated. A
  load into a fresh model includes the model itself (1.4 GB).

The model is fp32 (gpt2-medium: 355M parameters, 1.4 GB).

- save: ``cuboid.zoo.checkpoint.save`` vs ``save_pretrained`` (same
  ``max_shard_size``); cuboid fsyncs every file and hashes every byte (HF does
  neither), so it pays for durability and integrity here.
- load: build + materialise + ``checkpoint.load`` vs ``from_pretrained``, each followed by one read of
  every parameter (HF may leave weights mmap-backed and unread until first use)
  (both into a fresh model, both from the page cache: the files were just
  written, so this is CPU/memcpy throughput, not the disk).
- convert (sharded -> single file) and verify: cuboid only.

Prints a markdown table and writes bench/checkpoint.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


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
    """Samples anonymous RSS in a thread; ``peak`` is the highest value seen, in bytes."""

    def __init__(self, period: float = 5e-4) -> None:
        import threading

        self.period, self.peak = period, self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now() -> int:
        size, res, shared = (int(x) for x in Path("/proc/self/statm").read_text().split()[:3])
        return (res - shared) * os.sysconf("SC_PAGE_SIZE")

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
    """The same operation on a tiny model first: lazy imports and first-call costs stay out of the timing."""
    import cuboid
    from cuboid import zoo
    from cuboid.zoo import checkpoint

    tiny = cuboid.load("gpt-debug")
    if op.startswith("cuboid"):
        checkpoint.save(tiny, scratch, max_shard_size="100KB")
        model = zoo.build("gpt-debug")
        model.to_empty(device="cpu")
        checkpoint.load(model, scratch)
        checkpoint.verify(scratch)
        checkpoint.convert(scratch, scratch.with_name(scratch.name + "-c"), progress=False)
    else:
        import transformers as T

        checkpoint.save(tiny, scratch)
        T.AutoModelForCausalLM.from_pretrained(scratch).save_pretrained(scratch.with_name(scratch.name + "-c"))
        T.AutoModelForCausalLM.from_pretrained(scratch.with_name(scratch.name + "-c"))
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(scratch.with_name(scratch.name + "-c"), ignore_errors=True)



def worker(op: str, preset: str, root: Path, shard: str) -> dict:
    import torch

    torch.set_grad_enabled(False)
    import cuboid
    from cuboid import zoo
    from cuboid.zoo import checkpoint

    ours, theirs = root / f"cuboid-{shard}", root / f"hf-{shard}"
    _warm_up(op, root / f"warm-{op}")
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
    elif op == "cuboid-load":
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        model = zoo.build(preset)
        model.to_empty(device="cpu")
        checkpoint.load(model, ours)
        _touch(model)
        seconds, path = time.perf_counter() - t0, ours
    elif op == "hf-load":
        import transformers as T

        T.GPT2LMHeadModel  # import the model code outside the timed region
        before, anon = _reset_peak(), AnonPeak()
        anon0 = anon.peak
        t0 = time.perf_counter()
        model = T.AutoModelForCausalLM.from_pretrained(theirs)
        _touch(model)
        seconds, path = time.perf_counter() - t0, theirs
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
            "peak_rss": _status("VmHWM") - before, "peak_anon": peak_anon, "rss_before": before}


def run_worker(op: str, args, shard: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", op, "--preset", args.preset, "--dir", str(args.dir), "--shard", shard]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="gpt2-medium")
    ap.add_argument("--shard-sizes", default="5GB,500MB", help="comma-separated max_shard_size values")
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
    rows = []
    try:
        for shard in args.shard_sizes.split(","):
            res = {op: run_worker(op, args, shard) for op in ("cuboid-save", "hf-save", "cuboid-load", "hf-load")}
            rows.append({"operation": "save", "shard": shard, "cuboid": res["cuboid-save"], "hf": res["hf-save"]})
            rows.append({"operation": "load", "shard": shard, "cuboid": res["cuboid-load"], "hf": res["hf-load"]})
            if shard == args.shard_sizes.split(",")[-1]:
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

    md = table(rows)
    print(f"checkpoint bench: {args.preset} fp32, {rows[0]['cuboid']['bytes'] / 1e9:.2f} GB, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}\n")
    print(md)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "preset": args.preset,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "rows": rows, "table": md}, indent=2) + "\n")


if __name__ == "__main__":
    main()
