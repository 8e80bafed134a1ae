"""Communication per rank of one GPT training step, measured beside each mode's ``bytes_per_step``.

A GPT of gpt2 width (hidden 768, MLP 3072, 16 heads of 48 so that 1D tp=8
divides them; 2 blocks, a vocabulary of 8192, 8 x 64 tokens) runs one forward
+ backward (the vocab-parallel loss; logits never gathered) on gloo ranks of
this machine under each tensor mode, in fp32 and under bf16 autocast;
``cuboid.parallel.comm.count()`` tallies the bytes every rank sends (the ring
convention of comm.py). The formula column is
``cuboid.parallel.tensor.bytes_per_step``, the same function the tests hold
to the tallies, summed from each mode's per-layer ``Costs``. Larger sizes (gpt2
itself, 12 blocks, vocabulary 50257, 8 x 1024 tokens), not run here, come
from the formula alone.

    python bench/comm.py [--out bench/comm.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

B, T = 8, 64
SMALL = dict(vocab_size=8192, n_positions=T, dim=768, n_layers=2, n_heads=16)  # gpt2 width, 16 heads of 48
GPT2 = dict(vocab_size=50257, n_positions=1024, dim=768, n_layers=12, n_heads=12)


def formula(mode: str, tp: int, depth: int = 1, config: dict = SMALL, batch: int = B, seq: int = T,
            bf16: bool = False) -> float:
    """Bytes one rank sends in one training step, from the mode's ``bytes_per_step``."""
    import torch

    from cuboid.parallel import Plan
    from cuboid.parallel.tensor import bytes_per_step
    from cuboid.zoo import GPTConfig

    return bytes_per_step(GPTConfig(**config), Plan(tp=tp, tp_mode=mode, depth=depth), batch, seq,
                          autocast=torch.bfloat16 if bf16 else None)


def worker(mode: str, tp: int, depth: int):
    import torch

    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan, comm, input_splitter
    from cuboid.parallel.tensor import shard_model

    plan = Plan(tp=tp, tp_mode=mode, depth=depth)
    mesh = Mesh.build(plan)
    model = zoo.materialize(shard_model(zoo.build(zoo.GPTConfig(**SMALL)), zoo.SPECS["gpt"], mesh), seed=0)
    ids = torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
    batch = (input_splitter(plan, mesh) or (lambda b: b))({"input_ids": ids, "labels": ids})
    totals = []
    for bf16 in (False, True):
        with comm.count() as tally, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            model(**batch).loss.float().backward()
        totals.append((tally.total, tally.per_op()))
    return totals


RUNS = [("1d", 4, 1), ("1d", 8, 1), ("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)]
FORMULA_ONLY = [("1d", 16, 1), ("1d", 64, 1), ("2d", 16, 1), ("2d", 64, 1), ("2.5d", 32, 2), ("3d", 64, 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/comm.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from tests.parallel.launch import run_world

    rows = []
    for mode, tp, depth in RUNS:
        results = run_world(worker, tp, mode, tp, depth, timeout=900)
        for k, bf16 in enumerate((False, True)):
            rows.append({"model": "small", "mode": mode, "tp": tp, "depth": depth, "bf16": bf16,
                         "measured_bytes": max(r[k][0] for r in results),
                         "formula_bytes": formula(mode, tp, depth, bf16=bf16), "per_op_rank0": results[0][k][1]})
    for mode, tp, depth in RUNS + FORMULA_ONLY:
        for bf16 in (False, True):
            rows.append({"model": "gpt2", "mode": mode, "tp": tp, "depth": depth, "bf16": bf16, "measured_bytes": None,
                         "formula_bytes": formula(mode, tp, depth, GPT2, 8, 1024, bf16)})
    print(f"\nbytes sent per rank, one training step (forward + backward); small: gpt2 width, "
          f"{SMALL['n_layers']} blocks, vocab {SMALL['vocab_size']}, {B}x{T} tokens; gpt2: 12 blocks, "
          f"vocab 50257, 8x1024 tokens (formula only)\n")
    print("| model | mode | tp | dtype | measured MB | formula MB | measured/formula |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        m, f = r["measured_bytes"], r["formula_bytes"]
        tp = f"{r['tp']}" + (f" (d={r['depth']})" if r["mode"] == "2.5d" else "")
        dtype = "bf16 autocast" if r["bf16"] else "fp32"
        measured = f"{m / 1e6:.3f} | {f / 1e6:.3f} | {m / f:.4f}" if m is not None else f"- | {f / 1e6:.3f} | -"
        print(f"| {r['model']} | {r['mode']} | {tp} | {dtype} | {measured} |")
    Path(args.out).write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
