"""Model-state bytes per rank: LoRA against full fine-tuning, gpt2-medium under dp=2 and tp=2 (2 gloo CPU ranks).

    python bench/lora.py [--model gpt2-medium] [--plans dp=2,tp=2] [--r 16] [--alpha 32] [--targets attn+mlp]
                         [--seq 16] [--timeout 1800] [--json bench/lora.json]

Each (plan, mode) runs as its own world of 2 processes on 127.0.0.1, one after
the other, so one run's memory is alive at a time. Every rank builds
``cuboid.load(model, plan, mesh=Mesh.build(plan))`` in fp32, with
``lora=dict(r, alpha, targets)`` for the LoRA rows, and
``cuboid.parallel.optim.AdamW(model.parameters(), lr=1e-4)`` built the plain
way over all parameters (frozen ones get no gradient, hence no state). It
takes one ``cuboid.train_step`` (the optimizer state appears), then the
natural loop's forward and backward on its dp share of a (2, seq) batch of
random ids, and measures ``zero.model_state_bytes(model, opt)`` while
gradients and optimizer state are both alive: parameters, gradients and
optimizer state this rank holds, read off the tensors themselves. Beside it
the expected figure: full fine-tuning 16 bytes per local parameter (fp32
weight, gradient, two Adam moments), LoRA 4 per local base parameter plus 16
per local adapter parameter.

Prints a markdown table and writes ``--json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root (tests.*), last
from tests.parallel.launch import free_port, rank_env  # noqa: E402


def worker(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(rank_env(rank, world, port))
    try:
        torch.set_num_threads(1)
        import cuboid
        from cuboid.parallel import Mesh, Plan, zero
        from cuboid.parallel.optim import AdamW

        plan = Plan.parse(cfg["plan"])
        start = time.perf_counter()
        lora = dict(r=cfg["r"], alpha=cfg["alpha"], targets=tuple(cfg["targets"])) if cfg["lora"] else None
        model = cuboid.load(cfg["model"], plan, mesh=Mesh.build(plan), lora=lora).train()
        opt = AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (2, cfg["seq"]), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        cuboid.train_step(model, opt, batch)
        model(**cuboid.rank_share(model, batch)).loss.backward()
        held = zero.model_state_bytes(model, opt)
        local = {"base": 0, "adapters": 0}
        for n, p in model.named_parameters():
            local["adapters" if p.requires_grad else "base"] += p.numel()
        expected = 16 * local["adapters"] + 4 * local["base"]  # full fine-tuning: nothing frozen, base == 0
        queue.put((rank, "ok", {**held, **local, "expected": expected, "seconds": time.perf_counter() - start}))
    except BaseException:  # noqa: BLE001 - reported by the driver
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg: dict, timeout: float) -> list:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, 2, port, cfg, queue), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out, err = {}, None
    try:
        for _ in range(2):
            rank, status, value = queue.get(timeout=timeout)
            if status != "ok":
                err = f"rank {rank}: {value}"
                break
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if err is None else 1)
            if p.is_alive():
                p.kill()
    if err is not None:
        raise RuntimeError(err)
    return [out[r] for r in range(2)]


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-medium")
    ap.add_argument("--plans", default="dp=2;tp=2", help="plans separated by ';'")
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", default="attn+mlp")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default="bench/lora.json")
    args = ap.parse_args(argv)
    rows = []
    for plan in args.plans.split(";"):
        for lora in (False, True):
            cfg = dict(model=args.model, plan=plan, lora=lora, r=args.r, alpha=args.alpha,
                       targets=args.targets.split("+"), seq=args.seq)
            ranks = run(cfg, args.timeout)
            rows.append({"plan": plan, "mode": f"LoRA r={args.r} ({args.targets})" if lora else "full", "ranks": ranks})
            r0 = ranks[0]
            print(f"{plan} {'lora' if lora else 'full'}: {gib(r0['total'])} GiB rank 0", file=sys.stderr)
    print(f"\n{args.model}, fp32, AdamW, 2 gloo CPU ranks, {datetime.date.today()}; bytes per rank (rank 0 / rank 1)\n")
    print("| plan | mode | trainable params / rank | params GiB | grads GiB | optimizer GiB | total GiB | expected GiB | vs full |")
    print("|---|---|---|---|---|---|---|---|---|")
    full = {}
    for row in rows:
        a, b = row["ranks"]
        if row["mode"] == "full":
            full[row["plan"]] = a["total"]
        train = a["adapters"] if a["base"] else a["adapters"] + a["base"]
        both = lambda k: gib(a[k]) if a[k] == b[k] else f"{gib(a[k])} / {gib(b[k])}"  # noqa: E731
        ratio = a["total"] / full[row["plan"]]
        print(f"| {row['plan']} | {row['mode']} | {train:,} | {both('params')} | {both('grads')} | "
              f"{both('optimizer')} | {both('total')} | {gib(a['expected'])} | {ratio:.3f}x |")
    with open(args.json, "w") as f:
        json.dump({"date": str(datetime.date.today()), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
