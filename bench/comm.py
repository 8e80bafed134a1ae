"""Communication per rank of one transformer block, measured beside the modes' formulas.

A gpt2-sized block (hidden 768, MLP 3072, 16 heads of 48 so 1D tp=8 divides them; 8 x 64 tokens, fp32)
runs forward and backward on gloo ranks of this machine under each tensor
mode; ``cuboid.parallel.comm.count()`` tallies the bytes every rank sends (the
ring convention of comm.py). The formulas are the sums of the per-layer costs
stated in each mode's docstring (tensor/d1.py, d2.py, d2p5.py, d3.py). Larger
sizes, not run here, come from the formulas alone.

    python bench/comm.py [--out bench/comm.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, HEADS, MLP, B, T, BYTES = 768, 16, 3072, 8, 64, 4  # 16 heads of 48 so that tp=8 divides them
# the block's layers: (kind, in, out) in the order the block runs them
LINEARS = [(H, 3 * H), (H, H), (H, MLP), (MLP, H)]


def formula(mode: str, tp: int, depth: int = 1, h: int = H, mlp: int = MLP, rows: int = B * T) -> float:
    """Bytes one rank sends for one forward + backward of the block (weights with biases, 2 norms)."""
    linears = [(h, 3 * h), (h, h), (h, mlp), (mlp, h)]
    if mode == "1d":
        p = tp
        return 4 * 2 * (p - 1) / p * rows * h * BYTES  # 2 all-reduces forward, 2 backward
    if mode in ("2d", "2.5d"):
        d = depth if mode == "2.5d" else 1
        q = round((tp // d) ** 0.5)
        a, n = (q - 1) / q, rows / (q * d)
        total = 0.0
        for k, o in linears:
            total += 2 * a * BYTES * (n * k + o * k / q + o / q)
            if d > 1:
                total += 2 * (d - 1) / d * BYTES * (o * k / q ** 2 + o / q ** 2)
        for _ in range(2):  # layer norms: fp32 statistics over the row + the gathered weight/bias
            total += 2 * (16 * a * n + 2 * a * BYTES * h / q)
            if d > 1:
                total += 2 * (d - 1) / d * BYTES * 2 * h / q ** 2
        return total
    q = round(tp ** (1 / 3))
    total = 0.0
    for k, o in linears:
        total += 2 * (q - 1) / q ** 3 * BYTES * (rows * k + k * o + rows * o) + 2 * (q - 1) / q ** 2 * o * BYTES
    for _ in range(2):
        total += 2 * 16 * (q - 1) * rows / q ** 3 + 8 * (q - 1) * h * BYTES / q ** 2
    return total


def worker(mode: str, tp: int, depth: int):
    import torch

    from cuboid.parallel import Mesh, Plan, comm, shard
    from cuboid.zoo.common import Block

    plan = Plan(tp=tp, tp_mode=mode, depth=depth)
    mesh = Mesh.build(plan)

    class One(torch.nn.Module):  # a one-block model, so the zoo's block spec applies
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(H, HEADS, MLP, eps=1e-5, pre_ln=True, causal=True)])

    from cuboid.zoo.plans import _BLOCK_ROLES
    from cuboid.parallel.apply import ShardingSpec

    torch.manual_seed(0)
    model = shard(One(), plan, mesh, ShardingSpec(roles=dict(_BLOCK_ROLES)))
    x = torch.randn(B, T, H)
    if mode in ("2d", "2.5d"):
        from cuboid.parallel.tensor.grid import split_input
        x = split_input(x, mesh, 0, hidden=True)
    elif mode == "3d":
        from cuboid.parallel.tensor.d3 import split_input
        x = split_input(x, mesh, 0, hidden=True)
    x = x.detach().requires_grad_()
    # one full step through the block's norms: ln1 -> attn -> ln2 -> mlp (pre-LN, residual fused)
    block = model.blocks[0]
    with comm.count() as tally:
        y, residual = block(x, None)
        (y.sum() + residual.sum()).backward()
    return tally.total, tally.per_op()


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
        results = run_world(worker, tp, mode, tp, depth, timeout=600)
        measured = max(r[0] for r in results)
        rows.append({"mode": mode, "tp": tp, "depth": depth, "measured_bytes": measured,
                     "formula_bytes": formula(mode, tp, depth), "per_op_rank0": results[0][1]})
    for mode, tp, depth in FORMULA_ONLY:
        rows.append({"mode": mode, "tp": tp, "depth": depth, "measured_bytes": None,
                     "formula_bytes": formula(mode, tp, depth)})
    print(f"\nbytes sent per rank, one forward+backward of a gpt2-sized block (H={H}, MLP={MLP}, "
          f"{B}x{T} tokens, fp32)\n")
    print("| mode | tp | measured MB | formula MB | measured/formula |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        m = r["measured_bytes"]
        f = r["formula_bytes"]
        tp = f"{r['tp']}" + (f" (d={r['depth']})" if r["mode"] == "2.5d" else "")
        print(f"| {r['mode']} | {tp} | {m / 1e6:.3f} | {f / 1e6:.3f} | {m / f:.4f} |" if m is not None else
              f"| {r['mode']} | {tp} | - | {f / 1e6:.3f} | - |")
    Path(args.out).write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
