"""Predicted against measured peak memory on this machine, per plan (the cost model's peak of the fullest rank).

    python bench/memory_model.py            # 14 plans on 1, 2 and 4 gloo ranks; prints the table, bench/memory_model.json

Each plan runs in fresh processes (``tests/parallel/launch.py``'s ``run_world``): every rank reads its
``RssAnon`` (anonymous resident memory, from /proc/self/status: the heap, not the mapped libraries that RSS
also counts) once the process group is up, then samples it in a thread (``bench/checkpoint.py``'s
``AnonPeak``) while it loads the model and takes three ``cuboid.train_step`` calls with AdamW (the second and
third hold the optimizer state), with glibc's mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``: a
freed tensor's pages leave RssAnon). Measured: the highest rank's peak above its own baseline. Predicted:
:func:`cuboid.loading.planner.estimate`'s ``memory`` (the fullest rank's peak: model states, activations as the code
keeps them, autocast's copies, the loss head) for the same plan, layout, batch and sequence. The model is a
GPT of hidden 512, 8 blocks, vocabulary 8192 (29M parameters; bf16 rows a smaller batch, CPU bf16 matmuls are
slow).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODEL = dict(vocab_size=8192, n_positions=256, dim=512, n_layers=8, n_heads=8, mlp_hidden=0)
# (plan, ranks, layout, batch, seq)
ROWS = [("single", 1, "fp32", 8, 256), ("checkpoint=full", 1, "fp32", 8, 256),
        ("checkpoint=selective", 1, "fp32", 8, 256), ("dtype=bf16", 1, "autocast", 2, 128),
        ("dtype=bf16", 1, "half", 2, 128), ("dp=2", 2, "fp32", 8, 256), ("dp=2,zero=1", 2, "fp32", 8, 256),
        ("dp=2,zero=3", 2, "fp32", 8, 256), ("tp=2", 2, "fp32", 8, 256), ("pp=2,microbatches=2", 2, "fp32", 8, 256),
        ("sp=2", 2, "fp32", 8, 256), ("dp=4,zero=2", 4, "fp32", 8, 256), ("dp=2,tp=2", 4, "fp32", 8, 256),
        ("tp=4,tp_mode=2d", 4, "fp32", 8, 256)]


def worker(spec: str, layout: str, batch: int, seq: int, steps: int = 3) -> int:
    """Peak RssAnon above this rank's baseline over loading ``spec`` and ``steps`` train steps."""
    import torch

    import cuboid
    from bench.checkpoint import AnonPeak
    from bench.checkpointing import trim
    from cuboid import zoo
    from cuboid.parallel import init_distributed
    from cuboid.parallel.optim import AdamW

    init_distributed()
    config = zoo.config_of("gpt-debug", **MODEL)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    gc.collect()
    trim()
    base = AnonPeak.now()
    peak = AnonPeak()
    model = cuboid.load(config, plan=spec, dtype=torch.bfloat16 if layout == "half" else None)
    opt = AdamW(model.parameters(), lr=1e-4)
    for _ in range(steps):
        cuboid.train_step(model, opt, {"input_ids": ids, "labels": ids})
    return peak.stop() - base


def predicted(spec: str, ranks: int, layout: str, batch: int, seq: int):
    import torch

    from cuboid import zoo
    from cuboid.parallel import Plan, cost
    from cuboid.loading.planner import _Shards, estimate

    config = zoo.config_of("gpt-debug", **MODEL)
    plan = Plan.parse(spec, zoo.READY_PLANS)
    shards = _Shards(config, torch.bfloat16 if layout == "half" else None)
    return estimate(config, plan, cost.load_hardware("local"), batch, seq, shards=shards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(HERE / "memory_model.json"))
    ap.add_argument("--only", type=int, default=None, help="run the first N rows")
    ap.add_argument("--measured", default=None, help="a JSON this script wrote: its measurements again, new predictions")
    args = ap.parse_args()
    from cuboid.cli.tables import table
    from tests.parallel.launch import run_world

    # big tensors mmapped and unmapped on free: glibc's dynamic threshold would otherwise serve them from the
    # heap after the first free and keep the freed pages resident, so RssAnon would show a high-water mark of
    # the heap, not what the step holds (the spawned ranks read this at start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    t0, rows, out = time.time(), [], []
    before = {(r["plan"], r["layout"]): r["measured"] for r in json.loads(Path(args.measured).read_text())["rows"]} \
        if args.measured else {}
    for spec, ranks, layout, batch, seq in ROWS[:args.only]:
        got = before.get((spec, layout)) or max(run_world(worker, ranks, spec, layout, batch, seq, timeout=900))
        e = predicted(spec, ranks, layout, batch, seq)
        p = e.peak_parts
        off = e.memory / got - 1
        rows.append((spec, str(ranks), layout, f"{batch}x{seq}", f"{got / 2 ** 20:.0f}", f"{e.memory / 2 ** 20:.0f}",
                     f"{off:+.0%}", f"{p['states'] / 2 ** 20:.0f} / {(p['activations'] + p['rebuilt']) / 2 ** 20:.0f}"
                     f" / {p['copies'] / 2 ** 20:.0f} / {(p['head'] + p['temporaries']) / 2 ** 20:.0f}"))
        out.append({"plan": spec, "ranks": ranks, "layout": layout, "batch": batch, "seq": seq, "measured": got,
                    "predicted": e.memory, "off": off, "parts": p})
        print(rows[-1], flush=True)
    print(table(rows, ("plan", "ranks", "layout", "batch", "measured MiB", "predicted MiB", "off",
                       "states / activations / copies / head MiB")))
    print(f"\nworst {max(abs(r['off']) for r in out):.0%}; {time.time() - t0:.0f} s")
    Path(args.json).write_text(json.dumps({"model": MODEL, "rows": out, "when": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                              time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
