"""``cuboid plans``: the ready plans, or (with ``--gpus``) every plan ranked for a model and a cluster."""
from __future__ import annotations

import argparse
import json
import re
import sys

FIELDS = ("plan", "fits", "why", "step_s", "compute_s", "comm_s", "optimizer_s", "bubble_s", "bubble", "params",
          "grads", "optimizer", "masters", "activations", "activations_checkpointed", "memory", "sent", "sent_total",
          "flops")

_HELP_JSON = ("print a JSON list, one object per plan, fastest first, with the fields: " + ", ".join(FIELDS)
              + " (bytes per rank of the busiest rank; sent: bytes per group per step; times in seconds; "
                "bubble: idle over busy time of a pipeline)")


def add_parser(sub) -> None:
    p = sub.add_parser("plans", help="the ready plans; with --gpus, every plan ranked for a model and cluster",
                       description="Without --gpus: the ready plans. With --gpus N: every plan of N ranks that "
                                   "fits the model, ranked by predicted step time, with per-rank memory, traffic "
                                   "and pipeline bubble (parallel/cost.py says how each figure is made).")
    p.add_argument("--model", default="gpt2", help="a preset name or a model folder (default gpt2)")
    p.add_argument("--gpus", type=int, default=None, help="world size to plan for")
    p.add_argument("--hardware", default="h100", help="hardware profile: a name (see --list-hardware) or a "
                                                       ".toml file (default h100)")
    p.add_argument("--gpu-memory", default=None, help="device memory, e.g. 80GB (default: the profile's)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default 4 per GPU, >= 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's, at most 2048)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"), help="training dtype (default bf16)")
    p.add_argument("--top", type=int, default=20, help="rows in the table (default 20; --json lists all)")
    p.add_argument("--json", action="store_true", help=_HELP_JSON)
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul FLOP/s, memory bandwidth, a gloo probe on 2 local ranks) "
                        "and save it as the 'local' profile")
    p.add_argument("--list-hardware", action="store_true", help="the hardware profiles and exit")
    p.set_defaults(func=cmd_plans)


def _size(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(GB|GiB|TB|MB)?\s*", text, re.I)
    if not m:
        raise ValueError(f"--gpu-memory takes a size like 80GB, got {text!r}")
    unit = (m.group(2) or "GB").lower()
    return float(m.group(1)) * {"gb": 1e9, "gib": 2 ** 30, "tb": 1e12, "mb": 1e6}[unit]


_UNIT = [1e9, "GB"]  # set per table: MB when every figure is under a GB


def _gb(x: float) -> str:
    return f"{x / _UNIT[0]:.2f}"


def cmd_plans(args: argparse.Namespace) -> int:
    from cuboid.tables import table
    from cuboid.parallel import cost

    if args.calibrate:
        from cuboid.calibrate import calibrate

        hw, path = calibrate(progress=not args.json)
        print(f"saved the local profile to {path}", file=sys.stderr)
        print(hw.to_toml())
        if args.gpus is None:
            return 0
    if args.list_hardware:
        rows = [(n, cost.load_hardware(n).description) for n in cost.profile_names()]
        print(table(rows, ("profile", "description")))
        return 0
    if args.gpus is None:
        from cuboid import zoo

        print(table([(name, plan.describe(), str(plan.world_size)) for name, plan in zoo.READY_PLANS.items()],
                     ("plan", "fields", "processes")))
        return 0
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    from dataclasses import replace

    from cuboid.planner import config_of, rank_plans

    hw = cost.load_hardware(args.hardware)
    if args.gpu_memory:
        hw = replace(hw, memory_bytes=_size(args.gpu_memory))
    config = config_of(args.model)
    batch = args.batch or max(8, 4 * args.gpus)
    seq = args.seq or min(getattr(config, "n_positions", 0) or 2048, 2048)
    if hasattr(config, "patch_size"):
        seq = config.n_patches + 1
    ests = rank_plans(args.model, args.gpus, hw, batch, seq, dtype=args.dtype, progress=not args.json)
    if not ests:
        raise ValueError(f"no plan of {args.gpus} ranks fits {args.model}: its {config.n_heads} heads, "
                         f"{config.n_layers} layers and the batch of {batch} leave no split")
    if args.json:
        print(json.dumps([{k: e.to_dict()[k] for k in FIELDS} for e in ests], indent=1))
        return 0
    biggest = max(max(e.memory, e.sent_total) for e in ests)
    _UNIT[:] = [1e9, "GB"] if biggest >= 1e9 else [1e6, "MB"]
    print(f"{args.model} on {args.gpus} x {hw.name} ({hw.memory_bytes / 1e9:.0f} GB each), batch {batch} x "
          f"{seq} tokens, {args.dtype}, AdamW; {_UNIT[1]} per rank, time per step\n")
    rows = []
    for i, e in enumerate([e for e in ests if e.fits][:args.top], 1):
        ck = " (ckpt)" if e.plan.activation_checkpoint else ""
        rows.append((str(i), e.plan.describe() + ck, _gb(e.params), _gb(e.grads), _gb(e.optimizer + e.masters),
                     f"{_gb(e.activations)}/{_gb(e.activations_checkpointed)}", _gb(e.sent_total),
                     f"{e.bubble:.2f}", f"{e.step_s * 1e3:.3g} ms",
                     f"{e.compute_s * 1e3:.3g}+{e.comm_s * 1e3:.3g}+{(e.bubble_s + e.optimizer_s) * 1e3:.3g}"))
    print(table(rows, ("#", "plan", "params", "grads", "optim", "act/ckpt", "sent", "bubble", "step",
                        "compute+comm+other ms")))
    misfits = [e for e in ests if not e.fits]
    if misfits:
        print(f"\n{len(misfits)} plan(s) do not fit:")
        for e in misfits[:args.top]:
            print(f"  {e.plan.describe()}: {e.why}")
    return 0
