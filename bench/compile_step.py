"""Median CPU training step of a zoo model: eager, ``torch.compile(model)`` and per-block compile (plan compile=true).

Same config, weights, batch and threads in one process; each variant is timed alternately with the others, one
step each round, so machine noise hits all alike. A step is forward, backward and AdamW. Compile time is the
first step's time (Dynamo, AOTAutograd and inductor's C++ code generation) and is reported apart. Prints a
table (eager / compiled > 1: compiled is faster) and writes JSON.

    python bench/compile_step.py [--shapes gpt llama] [--steps 10] [--threads 2] [--out bench/compile_step.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import cuboid
from cuboid.parallel.compile import compile_blocks
from cuboid.parallel.optim import AdamW

# name: (preset, overrides, batch, sequence): small enough for two CPU cores, big enough that a step is matmuls
SHAPES = {
    "gpt": ("gpt-debug", dict(dim=256, n_layers=4, n_heads=4, mlp_hidden=1024, vocab_size=8192, n_positions=256), 4,
            256),
    "llama": ("llama-debug", dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, mlp_hidden=688, vocab_size=8192,
                                  n_positions=256), 4, 256),
}
VARIANTS = ("eager", "compiled", "per_block")


def _model(shape: str, variant: str):
    preset, overrides, _, _ = SHAPES[shape]
    torch.manual_seed(0)
    model = cuboid.load(preset, seed=0, **overrides).train()
    if variant == "compiled":
        model = torch.compile(model)
    elif variant == "per_block":
        compile_blocks(model, "blocks")
    return model


def _step(model, opt, batch) -> float:
    start = time.perf_counter()
    loss = model(**batch).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    loss.item()
    return time.perf_counter() - start


def run(shapes, steps: int) -> list[dict]:
    rows = []
    for shape in shapes:
        _, overrides, B, T = SHAPES[shape]
        ids = torch.randint(0, overrides["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        torch._dynamo.reset()
        models = {v: _model(shape, v) for v in VARIANTS}
        opts = {v: AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
        first = {v: _step(models[v], opts[v], batch) for v in VARIANTS}  # compiles
        times = {v: [] for v in VARIANTS}
        for _ in range(steps):
            for v in VARIANTS:
                times[v].append(_step(models[v], opts[v], batch))
        med = {v: statistics.median(t) for v, t in times.items()}
        losses = {v: models[v](**batch).loss.item() for v in VARIANTS}
        rows.append(dict(shape=shape, batch=B, seq=T, **{f"{v}_ms": 1e3 * med[v] for v in VARIANTS},
                         **{f"{v}_first_s": first[v] for v in VARIANTS},
                         speedup_compiled=med["eager"] / med["compiled"],
                         speedup_per_block=med["eager"] / med["per_block"], losses=losses))
    return rows


def table(rows) -> str:
    lines = ["| shape | batch x seq | eager ms | compiled ms | per-block ms | eager/compiled | eager/per-block | "
             "first step s (eager, compiled, per-block) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['batch']}x{r['seq']} | {r['eager_ms']:.0f} | {r['compiled_ms']:.0f} | "
                     f"{r['per_block_ms']:.0f} | {r['speedup_compiled']:.2f} | {r['speedup_per_block']:.2f} | "
                     f"{r['eager_first_s']:.1f}, {r['compiled_first_s']:.1f}, {r['per_block_first_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/compile_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with cuboid.kernels.use_backend("torch"):
        rows = run(args.shapes, args.steps)
    print(table(rows))
    Path(args.out).write_text(json.dumps(dict(threads=args.threads, torch=torch.__version__, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
