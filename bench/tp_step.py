"""1D tensor parallelism: cuboid's layers vs torch's own ``parallelize_module``, same blocks, same ranks.

Four GPT blocks (hidden 256, 8 heads, MLP 1024; 4 x 128 tokens, fp32) on 2
gloo ranks of this machine. cuboid shards them with ``shard_1d`` (packed QKV);
torch's variant is the same blocks with ``nn.Linear`` layers parallelized by
``ColwiseParallel`` / ``RowwiseParallel`` over a DeviceMesh (QKV rows
reordered first so torch's contiguous split gives each rank whole q/k/v
heads, as cuboid's packing does). Both are checked to give the same output,
then forward+backward steps are timed alternately in the same processes;
prints the median step times and the ratio torch/cuboid (> 1: cuboid faster).

    python bench/tp_step.py [--steps 20] [--out bench/tp_step.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, HEADS, MLP, B, T, N_BLOCKS = 256, 8, 1024, 4, 128, 4


def worker(steps: int):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from cuboid.parallel import Mesh, Plan, shard
    from cuboid.parallel import layers as L
    from cuboid.parallel.spec import ShardingSpec
    from cuboid.zoo.common import Block
    from cuboid.zoo.specs import _BLOCK_ROLES

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(H, HEADS, MLP, eps=1e-5, pre_ln=True, causal=True)
                                         for _ in range(N_BLOCKS)])

        def forward(self, x):
            residual = None
            for b in self.blocks:
                x, residual = b(x, residual)
            return x + residual

    torch.manual_seed(0)
    base = Blocks()
    plan = Plan(tp=2)
    mesh = Mesh.build(plan)
    ours = shard(copy.deepcopy(base), plan, mesh, ShardingSpec(roles=dict(_BLOCK_ROLES)))

    theirs = copy.deepcopy(base)
    p = dist.get_world_size()
    for path, mod in list(theirs.named_modules()):
        if type(mod) is L.Linear:
            lin = nn.Linear(mod.in_features, mod.out_features)
            w, b = mod.weight.detach(), mod.bias.detach()
            if path.endswith("qkv"):  # [q; k; v] -> [q_0 k_0 v_0; q_1 k_1 v_1; ...]
                w = torch.cat([c for r in range(p) for c in (s.chunk(p, 0)[r] for s in w.chunk(3, 0))])
                b = torch.cat([c for r in range(p) for c in (s.chunk(p, 0)[r] for s in b.chunk(3, 0))])
            with torch.no_grad():
                lin.weight.copy_(w)
                lin.bias.copy_(b)
            parent, _, leaf = path.rpartition(".")
            setattr(theirs.get_submodule(parent), leaf, lin)
    dmesh = init_device_mesh("cpu", (p,))
    tp_plan = {}
    for i in range(N_BLOCKS):
        tp_plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                        f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(theirs, dmesh, tp_plan)

    x = torch.randn(B, T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max().item()

    def step(m):
        xi = x.clone().requires_grad_()
        m(xi).sum().backward()
        m.zero_grad(set_to_none=True)

    times = {"cuboid": [], "torch": []}
    for i in range(steps + 3):
        for name, m in (("cuboid", ours), ("torch", theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            step(m)
            dist.barrier()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    return {"max_abs_diff": diff, **{k: statistics.median(v) for k, v in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="bench/tp_step.json")
    args = ap.parse_args()
    from tests.parallel.launch import run_world

    r = run_world(worker, 2, args.steps, timeout=900)[0]
    print(f"\n{N_BLOCKS} GPT blocks (H={H}, {HEADS} heads, MLP {MLP}), {B}x{T} tokens, fp32, tp=2 on gloo; "
          f"median of {args.steps} forward+backward steps; outputs agree to {r['max_abs_diff']:.1e}\n")
    print("| variant | ms / step | torch / cuboid |")
    print("| --- | ---: | ---: |")
    print(f"| cuboid shard_1d | {r['cuboid'] * 1e3:.1f} | {r['torch'] / r['cuboid']:.2f} |")
    print(f"| torch parallelize_module (Colwise/Rowwise) | {r['torch'] * 1e3:.1f} | 1.00 |")
    Path(args.out).write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
