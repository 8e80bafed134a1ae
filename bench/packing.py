"""Packed rows against rows padded to the longest in their batch: real tokens/s and peak memory, on CPU.

The same documents both ways: lengths drawn like instruction data (lognormal,
median 150 tokens, sigma 1, cut to 1..2048), token ids random. Packed: rows
of 2048 filled by :func:`cuboid.data.packing.pack` (best-fit-decreasing), one row a
step, positions restarting per document (the model keeps attention inside each
document). Padded: the documents in a seeded order, ``docs_per_step`` of them a
step (as many as fill one packed row on average), padded to the longest of the
step, with an attention mask. Real tokens are the documents' tokens; padding
does not count.

Two parts, each mode in a fresh process (so one mode's allocations do not raise
the other's peak):

- ``model``: a Llama-shaped cuboid model (RMSNorm, RoPE, grouped K/V heads,
  SwiGLU), forward + backward + AdamW step per batch;
- ``kernel``: ``cuboid.kernels.attention`` alone on the CPU torch path, forward +
  backward, q/k/v shaped as that model's attention.

The packed rows' attention is the kernels' own: on CPU the torch path runs SDPA
once per document, so a packed row costs the sum of its documents' squares.

Each mode runs ``--passes`` passes over its batches after a warm-up batch; the
median pass counts. Peak memory is the peak of RssAnon (anonymous resident memory, /proc/self/status),
sampled every millisecond by a thread, not RSS (which counts mapped files).
Prints a table and writes JSON.

    python bench/packing.py [--docs 150] [--passes 2] [--parts model kernel] [--out bench/packing.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROW = 2048
SHAPE = dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, mlp_hidden=688, vocab_size=4096)


def doc_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(150), 1.0, n).round().astype(np.int64), 1, ROW)


def documents(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(1, SHAPE["vocab_size"], int(k)).tolist() for k in doc_lengths(n, seed)]


def packed_batches(docs: list[list[int]]) -> list[dict]:
    from cuboid.data.packing import pack

    rows = pack(docs, ROW, pad_id=0)
    n = rows["input_ids"].shape[0]
    return [{"input_ids": rows["input_ids"][i:i + 1], "labels": rows["labels"][i:i + 1],
             "position_ids": rows["position_ids"][i:i + 1], "real": int(rows["attention_mask"][i].sum())}
            for i in range(n)]


def padded_batches(docs: list[list[int]], per_step: int, seed: int = 0) -> list[dict]:
    order = np.random.default_rng(seed + 2).permutation(len(docs))
    out = []
    for s in range(0, len(order), per_step):
        group = [docs[i] for i in order[s:s + per_step]]
        width = max(map(len, group))
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, d in enumerate(group):
            ids[r, :len(d)] = torch.tensor(d)
            mask[r, :len(d)] = 1
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
                    "real": int(mask.sum())})
    return out


class PeakAnon:
    """Peak RssAnon (bytes) of this process while inside, sampled every millisecond by a thread."""

    def __enter__(self):
        self.peak, self.base, self._stop = 0, rss_anon(), False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def model_step_fn(mode: str):
    from cuboid.zoo import build, materialize
    from cuboid.zoo.llama.config import LlamaConfig

    config = LlamaConfig(n_positions=ROW, **SHAPE)
    model = materialize(build(config), "cpu", seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(batch: dict) -> None:
        inputs = {k: v for k, v in batch.items() if k != "real"}
        model(**inputs).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def kernel_step_fn(mode: str):
    """forward + backward of the attention alone; q/k/v (made per batch, outside the timing) shaped as the
    model's attention."""
    from cuboid.kernels import attention
    from cuboid.kernels.flash_attention import doc_ids_from_positions

    H, Hkv, D = SHAPE["n_heads"], SHAPE["n_kv_heads"], SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(0)
    made: dict = {}

    def inputs(batch: dict):
        if id(batch) not in made:
            rows, width = batch["input_ids"].shape
            made[id(batch)] = [torch.randn(rows, h, width, D, generator=gen, requires_grad=True)
                               for h in (H, Hkv, Hkv)]
        return made[id(batch)]

    def step(batch: dict) -> None:
        q, k, v = inputs(batch)
        if mode == "packed":
            out = attention(q, k, v, causal=True, doc_ids=doc_ids_from_positions(batch["position_ids"]),
                            backend="torch")
        else:
            out = attention(q, k, v, causal=True, key_padding_mask=batch["attention_mask"].bool(), backend="torch")
        out.sum().backward()
        for t in (q, k, v):
            t.grad = None
    step.prepare = lambda batches: [inputs(b) for b in batches]
    return step


def run_one(part: str, mode: str, n_docs: int, per_step: int, passes: int) -> dict:
    """One (part, mode) in this process: a warm-up batch, then ``passes`` timed passes over every batch;
    the median pass counts (the machine is shared: the spread is reported too)."""
    docs = documents(n_docs)
    batches = padded_batches(docs, per_step) if mode == "padded" else packed_batches(docs)
    warm = (padded_batches(documents(per_step, seed=7), per_step) if mode == "padded"
            else packed_batches(documents(per_step, seed=7)))[0]
    step = model_step_fn(mode) if part == "model" else kernel_step_fn(mode)
    getattr(step, "prepare", lambda b: None)(batches)
    step(warm)
    load_before = os.getloadavg()[0]
    times = []
    with PeakAnon() as mem:
        for _ in range(passes):
            t0 = time.perf_counter()
            for b in batches:
                step(b)
            times.append(time.perf_counter() - t0)
    seconds = sorted(times)[len(times) // 2]
    real = sum(b["real"] for b in batches)
    slots = sum(b["input_ids"].numel() for b in batches)
    return {"part": part, "mode": mode, "steps": len(batches), "real_tokens": real, "slots": slots,
            "padding": 1 - real / slots, "pass_seconds": times, "seconds": seconds,
            "real_tokens_per_s": real / seconds, "peak_rss_anon_mb": mem.peak / 2**20,
            "rss_anon_before_mb": mem.base / 2**20, "load_1min": [load_before, os.getloadavg()[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=150, help="documents (the same set for every mode)")
    ap.add_argument("--parts", nargs="+", default=["model", "kernel"], choices=["model", "kernel"])
    ap.add_argument("--out", default="bench/packing.json")
    ap.add_argument("--passes", type=int, default=2, help="timed passes over the batches (the median counts)")
    ap.add_argument("--one", nargs=2, metavar=("PART", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--per-step", type=int, default=None, help="documents per padded step (default: the mean "
                    "number a packed row holds)")
    args = ap.parse_args()
    lengths = doc_lengths(args.docs)
    per_step = args.per_step or max(1, round(ROW / lengths.mean()))
    if args.one:
        print(json.dumps(run_one(*args.one, args.docs, per_step, args.passes)))
        return
    results = []
    for part in args.parts:
        for mode in ("packed", "padded"):
            cmd = [sys.executable, __file__, "--docs", str(args.docs), "--per-step", str(per_step),
                   "--passes", str(args.passes), "--one", part, mode]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[-1]
            print(f"  {part} {mode}: passes of {', '.join(f'{t:.1f}' for t in r['pass_seconds'])} s, "
                  f"load {r['load_1min'][0]:.1f}-{r['load_1min'][1]:.1f}", file=sys.stderr, flush=True)
    report = {"docs": args.docs, "tokens": int(lengths.sum()), "median_length": float(np.median(lengths)),
              "max_length": int(lengths.max()), "row": ROW, "padded_docs_per_step": per_step, "shape": SHAPE,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))


def table(report: dict) -> str:
    lines = [f"{report['docs']} documents, {report['tokens']} tokens (median {report['median_length']:.0f}, "
             f"max {report['max_length']}); packed rows of {report['row']}, padded steps of "
             f"{report['padded_docs_per_step']} documents", "",
             "| part | mode | steps | padding | real tokens/s | peak RssAnon (MB) | vs padded: tokens/s | memory |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    padded = {r["part"]: r for r in report["results"] if r["mode"] == "padded"}
    for r in report["results"]:
        p = padded[r["part"]]
        lines.append(f"| {r['part']} | {r['mode']} | {r['steps']} | {r['padding']:.1%} | "
                     f"{r['real_tokens_per_s']:,.0f} | {r['peak_rss_anon_mb']:,.0f} | "
                     f"{r['real_tokens_per_s'] / p['real_tokens_per_s']:.2f}x | "
                     f"{r['peak_rss_anon_mb'] / p['peak_rss_anon_mb']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
