"""``cuboid plans``: the ready plans, or (with ``--gpus``) every plan ranked for a model and a cluster."""
from __future__ import annotations

import argparse
import json
import sys

FIELDS = ("plan", "fits", "why", "layout", "step_s", "compute_s", "comm_s", "comm_total_s", "optimizer_s", "bubble_s",
          "bubble", "params", "grads", "optimizer", "masters", "activations", "activations_checkpointed", "memory",
          "peak_parts", "peak_rank", "sent", "sent_total", "flops")

_HELP_JSON = ("print a JSON list, one object per plan (every plan priced, as --exhaustive), fastest first, with the "
              "fields: " + ", ".join(FIELDS)
              + " (times: the slowest rank's, comm_s exposed and comm_total_s all of it; bytes: the fullest rank's, "
                "memory its estimated peak, params/grads/optimizer/masters/sent exact; sent: bytes per group per step; "
                "bubble: idle over busy time of a pipeline)")


def add_parser(sub) -> None:
    p = sub.add_parser("plans", help="the ready plans; with --gpus, every plan ranked for a model and cluster",
                       description="Without --gpus: the ready plans. With --gpus N: every plan of N ranks that "
                                   "fits the model, ranked by predicted step time, with per-rank memory, traffic "
                                   "and pipeline bubble (parallel/cost/ says how each figure is made).")
    p.add_argument("--model", default="gpt2", help="a preset name or a model folder (default gpt2)")
    p.add_argument("--gpus", type=int, default=None, help="world size to plan for")
    p.add_argument("--hardware", default="h100", help="hardware profile: a name (see --list-hardware) or a "
                                                       ".toml file (default h100)")
    p.add_argument("--gpu-memory", default=None, help="device memory, e.g. 80GB, 80G or 75GiB (default: the profile's)")
    p.add_argument("--headroom", type=float, default=0.10,
                   help="share of device memory a plan must leave free to fit (default 0.10)")
    p.add_argument("--layout", default="autocast", choices=("autocast", "half"),
                   help="autocast: fp32 weights under bf16/fp16 autocast (cuboid.load's default); half: weights in "
                        "the training dtype with fp32 masters (cuboid.load(dtype=torch.bfloat16)); default autocast")
    p.add_argument("--quantize", default=None, choices=("nf4",),
                   help="nf4: price a QLoRA run, the blocks' linears a frozen 4-bit base at its real bytes (about "
                        "0.52 per parameter) trained through LoRA adapters (--lora); 1D tensor parallelism only")
    p.add_argument("--lora", default=None, metavar="SPEC",
                   help="price LoRA adapters as the only trained weights, e.g. r=16,alpha=32,targets=attn+mlp "
                        "(with --quantize nf4 the default is r=8,alpha=16 on attn and mlp)")
    p.add_argument("--exhaustive", action="store_true",
                   help="price every plan (as --json does): by default the table leaves out plans whose model "
                        "states or activations alone cannot fit and plans whose step-time floor is past the last "
                        "one shown (one line says how many)")
    p.add_argument("--no-search", action="store_true",
                   help="price the plans as enumerated, without trying micro-batch counts and checkpointing")
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


_UNIT = [1e9, "GB"]  # set per table: MB when every figure is under a GB


def _gb(x: float) -> str:
    return f"{x / _UNIT[0]:.2f}"


def cmd_plans(args: argparse.Namespace) -> int:
    from cuboid.cli.tables import table
    from cuboid.parallel import cost

    if args.calibrate:
        from cuboid.loading.calibrate import calibrate

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
        from cuboid.zoo import READY_PLANS

        print(table([(name, plan.describe(), str(plan.world_size)) for name, plan in READY_PLANS.items()],
                     ("plan", "fields", "processes")))
        return 0
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    from dataclasses import replace

    from cuboid.loading.planner import (SEARCH_TOP, check_batch, config_of, default_seq, parse_size, rank_plans,
                                        skipped_line)

    hw = cost.load_hardware(args.hardware)
    if args.gpu_memory:
        try:
            hw = replace(hw, memory_bytes=parse_size(args.gpu_memory))
        except ValueError:
            raise ValueError(f"--gpu-memory takes a size like 80GB, 80G or 75GiB, got {args.gpu_memory!r}") from None
    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom {args.headroom}: give a share of memory in [0, 1)")
    config = config_of(args.model)
    batch = max(8, 4 * args.gpus) if args.batch is None else args.batch
    seq = default_seq(config) if args.seq is None else args.seq
    check_batch(config, batch, seq)
    skipped: dict = {}
    ests = rank_plans(args.model, args.gpus, hw, batch, seq, dtype=args.dtype, progress=not args.json,
                      layout=args.layout, headroom=args.headroom, search=not args.no_search,
                      quantize=args.quantize, lora=_lora_spec(args.lora), skipped=skipped,
                      keep=None if args.exhaustive or args.json else max(args.top, SEARCH_TOP))
    skip = skipped_line(skipped, hw.memory_bytes * (1 - args.headroom))
    if not ests:
        raise ValueError(f"no plan of {args.gpus} ranks fits {args.model}: its {config.n_heads} heads, "
                         f"{config.n_layers} layers and the batch of {batch} leave no split")
    if args.json:
        if skip:
            print(skip, file=sys.stderr)
        print(json.dumps([{k: e.to_dict()[k] for k in FIELDS} for e in ests], indent=1))
        return 0
    biggest = max(max(e.memory, e.sent_total) for e in ests)
    _UNIT[:] = [1e9, "GB"] if biggest >= 1e9 else [1e6, "MB"]
    layout = cost.LAYOUT_NAMES[ests[0].layout]
    shape = cost.Shape.of(config)
    if shape.sparse:  # a mixture of experts: what it holds and what a token uses
        print(f"{args.model}: {shape.parameters / 1e9:.3g}B parameters, {shape.active_parameters / 1e9:.3g}B active "
              f"per token ({shape.experts} experts, {shape.top_k} per token, {shape.sparse_layers} sparse layers)")
    base = ("; a 4-bit NF4 base, LoRA adapters trained" if args.quantize else
            "; LoRA adapters trained" if args.lora is not None else "")
    print(f"{args.model} on {args.gpus} x {hw.name} ({hw.memory_bytes / 1e9:.0f} GB each, {args.headroom:.0%} kept free), "
          f"batch {batch} x {seq} tokens, {args.dtype}, {layout}, AdamW{base}; {_UNIT[1]} per rank, time per step")
    print("= exact (what a run holds and sends): params, grads, optim, sent; ~ estimated: peak (the fullest rank, "
          "rank in brackets), step and its parts (the slowest rank; comm exposed / all)\n")
    rows = []
    fitting = [e for e in ests if e.fits]
    for i, e in enumerate(fitting[:args.top], 1):
        rows.append((str(i), e.plan.describe(), _gb(e.params), _gb(e.grads), _gb(e.optimizer + e.masters),
                     f"{_gb(e.memory)} [{e.peak_rank}]", _gb(e.sent_total), f"{e.bubble:.2f}", f"{e.step_s * 1e3:.3g} ms",
                     f"{e.compute_s * 1e3:.3g}+{e.comm_s * 1e3:.3g}/{e.comm_total_s * 1e3:.3g}"
                     f"+{(e.bubble_s + e.optimizer_s) * 1e3:.3g}"))
    print(table(rows, ("#", "plan", "=params", "=grads", "=optim", "~peak", "=sent", "bubble", "~step",
                        "~compute+comm+other ms")))
    if len(fitting) > args.top:
        print(f"showing {args.top} of {len(fitting)} plans that fit{MORE}")
    if skip:
        print(f"\n{skip}")
    why_no_tp = _no_tensor_split(config, args.gpus)
    if why_no_tp:
        print(f"\nno tensor-parallel plan: {why_no_tp}")
    misfits = [e for e in ests if not e.fits]
    if misfits:
        shown = f" (showing {args.top} of {len(misfits)}{MORE})" if len(misfits) > args.top else ""
        print(f"\n{len(misfits)} plan(s) do not fit{shown}:")
        for e in misfits[:args.top]:
            print(f"  {e.plan.describe()}: {e.why}")
    return 0


MORE = "; --top N shows more, --json lists all"


def _lora_spec(text):
    """``--lora``'s spec checked at the door (a one-line error for a bad one), or None."""
    if text is None:
        return None
    from cuboid.parallel.lora import LoraConfig

    return LoraConfig.parse(text)


def _no_tensor_split(config, world: int) -> str:
    """Why no tensor split of ``world`` ranks runs ``config`` (the refusal at the smallest tp), or ''."""
    from cuboid.parallel.cost.space import divisors, refusal

    reasons = [refusal({"tp": t, "dp": world // t}, config, world) for t in divisors(world) if t > 1]
    return reasons[0] if reasons and all(reasons) else ""
