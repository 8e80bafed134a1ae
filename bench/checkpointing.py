"""Activation checkpointing on a GPT-2 training step, on CPU: none, full (whole blocks) and selective.

    python bench/checkpointing.py [--model gpt2] [--layers 12] [--batch 2] [--seq 512] [--repeats 3]
                                  [--steps 3] [--threads 2] [--json bench/checkpointing.json]

The zoo's ``gpt2`` preset (124M parameters, 12 blocks, hidden 768, fp32, random weights, dropout 0.1),
``--layers`` fewer to make it cheaper (``--layers 12`` is the preset itself), trained on random tokens of
``--batch`` x ``--seq`` under ``checkpoint=none|full|selective``. Each run is its own process, so one run's
freed memory cannot hide the next one's peak. A child loads the model, makes one training step (first-call
costs; it also allocates the gradients, which later steps accumulate into), then measures:

- ``peak``: the highest ``RssAnon`` (``/proc/self/status``, sampled every 0.5 ms by a thread) during a step,
  above its value just before it (after ``malloc_trim``, so that freed memory malloc kept does not hide the
  growth): the activations, their recompute in backward and the backward's own temporaries (the gradients
  exist already);
- ``s``: seconds of a step (the median of ``--steps``), wall clock and CPU time of the process (all its
  threads: on a machine others share, less disturbed by them than the wall clock);
- ``held``: bytes the forward leaves alive for backward, counted exactly (every storage an op made during
  the forward that is still alive after it, found through weak references: autograd's saved tensors,
  checkpoint inputs, selective checkpointing's kept outputs), and the part of it made inside the blocks;
  divided by ``layers x tokens x hidden x 4 bytes`` the latter is the number of fp32 elements per token and
  hidden unit a block keeps, the figure :func:`cuboid.parallel.cost.activation_bytes` prices (Korthikanti
  et al.'s 17 elements for none).

Runs alternate (the order of the modes turns each repeat) and time ratios are taken between runs of the same
repeat (medians over repeats), since the machine is shared. Prints a markdown table and writes ``--json``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/ is not a package: its helpers are imported as top-level modules
from checkpoint import AnonPeak  # noqa: E402  (the RssAnon sampler)
MB = 1 << 20
MODES = ("none", "full", "selective")


def trim() -> None:
    """Give the memory malloc keeps after frees back to the system, so that a step's ``RssAnon`` growth is what
    the step allocates (without it a step reuses the heap earlier steps left and its growth reads low)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def made_tracker():
    """A dispatch mode that remembers (weakly) every storage an op makes, numbered in order; ``live(first, end)``
    sums the bytes of those still alive (of numbers ``first .. end - 1``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Made(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.refs: list = []   # weak references, in the order the storages were made
            self.seen: dict = {}   # address -> index into refs of the storage living there

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):  # new storages only: a view (of a weight, say) is not memory made here
                if isinstance(t, torch.Tensor):
                    s = t.untyped_storage()
                    at = self.seen.get(s.data_ptr())
                    if s.data_ptr() not in inputs and (at is None or self.refs[at]() is None):  # new, or reused
                        self.seen[s.data_ptr()] = len(self.refs)
                        self.refs.append(weakref.ref(s))
            return out

        def live(self, first: int = 0, end=None) -> int:
            gc.collect()
            return sum(s.nbytes() for s in (r() for r in self.refs[first:end]) if s is not None)

    return Made()


# ---------------------------------------------------------------------- one run (a child process)


def child(mode: str, model: str, layers: int, batch: int, seq: int, steps: int, threads: int) -> dict:
    import torch

    import cuboid

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    plan = None if mode == "none" else f"checkpoint={mode}"
    net = cuboid.load(model, plan, seed=0, n_layers=layers, dropout=0.1).train()
    cfg = net.config
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    net(input_ids=ids, labels=ids).loss.backward()  # first-call costs; allocates the gradients

    # bytes the forward leaves alive, and the part made inside the blocks (hooks mark the block's ops)
    made = made_tracker()
    spans, starts = [], []

    def enter(_module, _args):
        starts.append(len(made.refs))

    def leave(_module, _args, _out):
        spans.append((starts.pop(), len(made.refs)))

    hooks = [b.register_forward_pre_hook(enter) for b in net.blocks] + \
            [b.register_forward_hook(leave) for b in net.blocks]
    with made:
        loss = net(input_ids=ids, labels=ids).loss
    held, held_blocks = made.live(), sum(made.live(a, b) for a, b in spans)
    loss.backward()
    for h in hooks:
        h.remove()
    del loss, made
    gc.collect()

    seconds, cpu, peaks, losses = [], [], [], []
    for _ in range(steps):
        gc.collect()
        trim()
        base = AnonPeak.now()
        sampler = AnonPeak()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        peaks.append(sampler.stop() - base)
        losses.append(float(loss))
        del loss
    per_block = held_blocks / (layers * batch * seq * cfg.dim * 4)
    return {"mode": mode, "seconds": statistics.median(seconds), "cpu_seconds": statistics.median(cpu),
            "peak_above_base": max(peaks), "held": held,
            "held_blocks": held_blocks, "elements_per_token_hidden": per_block, "losses": losses,
            "params": sum(p.numel() for p in net.parameters()), "dim": cfg.dim}


# ---------------------------------------------------------------------- the driver


def run_child(args, mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--model", args.model, "--layers",
           str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd="/tmp")
    if out.returncode != 0:
        return {"mode": mode, "skipped": f"exit {out.returncode}: {out.stderr[-500:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: list) -> str:
    """Medians per mode; ratios against none's run of the same repeat."""
    head = ("checkpoint", "peak MB", "peak / none", "held MB", "held in blocks MB",
            "kept per block, fp32 elements per token x hidden", "step s", "time / none", "step CPU s", "CPU / none")
    rows = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode and "skipped" not in r]
        if not mine:
            continue
        peak, time_ratio, cpu_ratio = [], [], []
        for r in mine:
            none = next((n for n in runs if n["mode"] == "none" and n.get("repeat") == r["repeat"]
                         and "skipped" not in n), None)
            if none is not None:
                peak.append(r["peak_above_base"] / none["peak_above_base"])
                time_ratio.append(r["seconds"] / none["seconds"])
                cpu_ratio.append(r["cpu_seconds"] / none["cpu_seconds"])

        def med(key, scale=1.0, fmt="{:.0f}"):
            return fmt.format(statistics.median(r[key] for r in mine) / scale)

        rows.append("| " + " | ".join([
            mode, med("peak_above_base", MB), f"{statistics.median(peak):.2f}" if peak else "-",
            med("held", MB), med("held_blocks", MB), med("elements_per_token_hidden", fmt="{:.2f}"),
            med("seconds", fmt="{:.1f}"), f"{statistics.median(time_ratio):.2f}" if time_ratio else "-",
            med("cpu_seconds", fmt="{:.1f}"), f"{statistics.median(cpu_ratio):.2f}" if cpu_ratio else "-"]) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after one untimed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", default=os.path.join(HERE, "checkpointing.json"))
    p.add_argument("--child", metavar="MODE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.layers, args.batch, args.seq, args.steps, args.threads)))
        return 0
    runs = []
    for rep in range(args.repeats):
        for mode in MODES[rep % 3:] + MODES[:rep % 3]:
            r = dict(run_child(args, mode), repeat=rep)
            runs.append(r)
            what = r.get("skipped") or (f"{r['seconds']:.1f} s, peak +{r['peak_above_base'] / MB:.0f} MB, "
                                        f"held {r['held'] / MB:.0f} MB ({r['elements_per_token_hidden']:.2f} "
                                        "elements per token x hidden per block)")
            print(f"repeat {rep} {mode}: {what}", flush=True)
    import torch

    header = (f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{args.threads} threads, {args.model} with {args.layers} blocks, batch {args.batch} x seq {args.seq}, "
              f"fp32, dropout 0.1, {args.repeats} repeats x {args.steps} timed steps")
    text = table(runs)
    print("\n" + header + "\n\n" + text)
    with open(args.json, "w") as fh:
        json.dump({"header": header, "runs": runs, "table": text}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
