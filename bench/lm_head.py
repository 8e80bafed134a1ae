"""The LM head's training step, fused linear cross-entropy against the unfused head, on CPU.

    python bench/lm_head.py [--tokens 4096,16384,32768] [--repeats 2] [--variants unfused,fused,layer,logprobs]
                            [--hidden 768] [--vocab 50257] [--threads 2] [--json bench/lm_head.json]

A GPT-2-sized head (hidden 768, vocabulary 50257, fp32): hidden states x (N, 768) and weight W (50257, 768)
as leaves, N labels (5% of them -100), one forward and backward (the gradients of x and W):

- ``unfused``: ``F.cross_entropy(F.linear(x, W), labels)``, which holds the (N, V) logits, their
  log-softmax and, in backward, their gradient;
- ``fused``: ``cuboid.kernels.linear_cross_entropy(x, W, labels)`` (the chunked torch path: about 64 MiB of
  logits at a time);
- ``layer``: the zoo's path, ``Embedding.lm_outputs(x, labels)`` with W as the table: the fused loss plus
  the copy of W it keeps so that the logits can be made when read (the deferred logits are held through
  backward, as a training loop holds the model's output);
- ``logprobs``: per-token log-probabilities, ``linear_cross_entropy(x, W, labels, reduction="none")``, and
  the backward of their sum weighted by a random weight per token (DPO's and GRPO's use): the gradients are
  formed in backward from recomputed chunks. The table gives its peak over ``fused``'s (the ``sum``
  reduction's; issue 46 asks for at most 1.2).

Each run is its own process (``--child``), so one run's freed memory cannot hide the next one's peak: it
builds the inputs, makes one small step of the same variant (first-call costs), then measures the step:
seconds, and the peak of ``RssAnon`` (``/proc/self/status``, sampled every 0.5 ms in a thread) above its
value just before the step. Runs alternate (the order of the variants turns each repeat) and time ratios are
taken between runs of the same repeat (medians over repeats), since the machine is shared. A run whose
estimated need exceeds ``MemAvailable`` waits for it (up to ``--wait`` s), else is skipped. Prints a markdown
table and writes ``--json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # bench/ is not a package: its helpers are imported as top-level modules
from checkpoint import AnonPeak  # noqa: E402  (the RssAnon sampler)
GB = 1 << 30


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------- one run (a child process)


def step_fn(variant: str, h: int, v: int):
    """``fn(x, w, labels) -> loss`` of ``variant``."""
    import torch
    import torch.nn.functional as F

    from cuboid.kernels import linear_cross_entropy

    if variant == "unfused":
        return lambda x, w, y: F.cross_entropy(F.linear(x, w), y)
    if variant == "fused":
        return lambda x, w, y: linear_cross_entropy(x, w, y)
    if variant == "logprobs":
        def logprobs(x, w, y):
            up = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))  # (N,) a weight per token
            return (linear_cross_entropy(x, w, y, reduction="none") * up).sum()
        return logprobs
    if variant == "layer":
        from cuboid.parallel import layers as L

        def layer(x, w, y):
            emb = L.Embedding(v, h, device="meta")  # a new one each call: nothing of a previous step stays
            emb.weight = w  # the table is the parameter itself
            loss, layer.logits = emb.lm_outputs(x, y)  # held, as a model's Output is, through backward
            return loss
        return layer
    raise ValueError(f"unknown variant {variant!r}")


def inputs(n: int, h: int, v: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).requires_grad_()
    w = torch.nn.Parameter(torch.randn(v, h, generator=g) * 0.02)  # a model's parameter
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < 0.05] = -100
    return x, w, y


def child(variant: str, n: int, h: int, v: int, threads: int) -> dict:
    import gc

    import torch

    torch.set_num_threads(threads)
    fn = step_fn(variant, h, v)
    x, w, y = inputs(256, h, v, seed=1)  # first-call costs, out of the measurement
    fn(x, w, y).backward()
    fn.logits = None  # (the layer's deferred logits of the warm-up)
    del x, w, y
    x, w, y = inputs(n, h, v)
    gc.collect()
    base = AnonPeak.now()
    sampler = AnonPeak()
    start = time.perf_counter()
    loss = fn(x, w, y)
    loss.backward()
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    return {"variant": variant, "tokens": n, "seconds": seconds, "peak_above_base": peak - base, "base": base,
            "loss": float(loss), "grad_norms": [float(x.grad.norm()), float(w.grad.norm())]}


# ---------------------------------------------------------------------- the driver


def need_bytes(variant: str, n: int, h: int, v: int) -> int:
    """A generous estimate of a run's memory: inputs and their gradients, plus the logits' copies."""
    base = 2 * 4 * (n * h + v * h) + (1 << 30)
    if variant == "unfused":
        return base + 3 * 4 * n * v
    return base + 4 * 4 * min(n, (1 << 24) // v + 1) * v + 4 * v * h


def run_child(args, variant: str, n: int) -> dict:
    need = need_bytes(variant, n, args.hidden, args.vocab)
    waited = time.time()
    while mem_available() < need and time.time() - waited < args.wait:
        time.sleep(5)
    if mem_available() < need:
        return {"variant": variant, "tokens": n, "skipped": f"needs about {need / GB:.1f} GiB, "
                                                           f"{mem_available() / GB:.1f} GiB available"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, str(n), "--hidden", str(args.hidden),
           "--vocab", str(args.vocab), "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd="/tmp")
    if out.returncode != 0:
        return {"variant": variant, "tokens": n, "skipped": f"exit {out.returncode}: {out.stderr[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(runs: list, variants: list, tokens: list, vocab: int) -> str:
    """Medians per token count: peaks above the step's start, the worst peak's ratio to unfused's (and
    logprobs' to fused's), seconds and the median over repeats of each repeat's time ratio to its unfused
    run."""
    others = [v for v in variants if v != "unfused"]
    versus_sum = "logprobs" in variants and "fused" in variants  # the per-token form's peak over the sum's
    head = (["tokens", "fp32 logits GiB"] + [f"{v} peak GiB" for v in variants]
            + [f"{v}/unfused peak" for v in others] + ["logprobs/fused peak"] * versus_sum
            + [f"{v} s" for v in variants]
            + [f"{v}/unfused time" for v in others])
    rows = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---:"] * len(head)) + " |"]
    for n in tokens:
        mine = [r for r in runs if r["tokens"] == n and "skipped" not in r]
        peak = {v: [r["peak_above_base"] for r in mine if r["variant"] == v] for v in variants}
        secs = {v: [r["seconds"] for r in mine if r["variant"] == v] for v in variants}
        ratios = {v: [] for v in others}
        for rep in sorted({r["repeat"] for r in mine}):
            pair = {r["variant"]: r for r in mine if r["repeat"] == rep}
            for v in others:
                if v in pair and "unfused" in pair:
                    ratios[v].append(pair[v]["seconds"] / pair["unfused"]["seconds"])

        def med(xs, fmt):
            return fmt.format(statistics.median(xs)) if xs else "-"

        cells = [str(n), f"{n * vocab * 4 / GB:.2f}"]
        cells += [med([p / GB for p in peak[v]], "{:.2f}") for v in variants]
        cells += [f"{max(peak[v]) / max(peak['unfused']):.3f}" if peak[v] and peak["unfused"] else "-"
                  for v in others]
        if versus_sum:
            cells.append(f"{max(peak['logprobs']) / max(peak['fused']):.3f}"
                         if peak["logprobs"] and peak["fused"] else "-")
        cells += [med(secs[v], "{:.1f}") for v in variants]
        cells += [med(ratios[v], "{:.2f}") for v in others]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="4096,16384,32768")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default="unfused,fused,layer")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for memory before skipping a run")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", default=os.path.join(HERE, "lm_head.json"))
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.hidden, args.vocab, args.threads)))
        return 0
    tokens = [int(t) for t in args.tokens.split(",")]
    variants = args.variants.split(",")
    if "unfused" not in variants:
        variants = ["unfused"] + variants
    runs = []
    for rep in range(args.repeats):
        for n in tokens:
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                r = dict(run_child(args, v, n), repeat=rep)
                runs.append(r)
                what = r.get("skipped") or f"{r['seconds']:.1f} s, peak +{r['peak_above_base'] / GB:.2f} GiB"
                print(f"repeat {rep} tokens {n} {v}: {what}", flush=True)
    import torch

    header = (f"{datetime.date.today()}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
              f"{args.threads} threads, hidden {args.hidden}, vocab {args.vocab}, fp32, {args.repeats} repeats")
    text = table(runs, variants, tokens, args.vocab)
    print("\n" + header + "\n\n" + text)
    with open(args.json, "w") as fh:
        json.dump({"header": header, "runs": runs, "table": text}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
