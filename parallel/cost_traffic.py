"""Bytes a rank sends in a training step under a plan, group by group (exact: the tests hold them equal to
``comm.count``): the tensor modes' parts, the sequence split, DDP's / ZeRO's gradient traffic, the pipeline.
"""
from __future__ import annotations

import math

import torch

from .cost_memory import _buckets, _fsdp_rows, _trainable
from .cost_shape import Shape, Stage
from .plan import Plan


def _add(out: dict, key: tuple, nbytes: float, calls: float = 1.0) -> None:
    b, c = out.get(key, (0.0, 0.0))
    out[key] = (b + nbytes, c + calls)


def _all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


# collectives per block and step of each tensor mode (forward + backward), for the alpha term only:
# counted with comm.count on a 2-block GPT (2D on 4 ranks, 2.5D and 3D on 8), embeddings and head included
_TP_CALLS_PER_BLOCK = {"1d": 4, "2d": 65, "2.5d": 100, "3d": 70}


def traffic(config, plan: Plan, params: dict, stage: Stage, batch: int, seq: int, *, spec=None,
            masked: bool = False) -> dict:
    """``{(op, group): (bytes, calls)}`` one rank sends in a ``train_step`` of a ``batch`` x ``seq``
    global batch under ``plan``, in :mod:`.comm`'s convention (what ``comm.count`` measures).

    ``params``: this rank's parameters by name (meta tensors do); ``stage``: its pipeline stage;
    ``spec``: the model's :class:`~.apply.ShardingSpec` (its blocks make ZeRO-3's units, the modules its
    first and last stages share are tied over ``pp``). Bytes are exact for GPT-shaped models with AdamW
    and no clipping; ``calls`` are exact for the gradient and pipeline traffic and estimated for the
    tensor modes (they only price latency).
    """
    from .sequence_split import bytes_per_step as sp_bytes
    from .tensor.engine import mode_of, step_parts

    shape = Shape.of(config)
    out: dict = {}
    rows = batch // plan.dp
    m = plan.microbatches if plan.pp > 1 else 1
    autocast = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.dtype]
    named = params
    params = list(named.values())
    ps = _trainable(params)
    pdtype = ps[0].dtype if ps else torch.float32
    ckpt = plan.checkpoint != "none"  # full and selective alike re-run a block's collectives in its recompute

    # tensor parallelism: the stage's parts, once per micro-batch (forward again when recomputing); under
    # sp the embeddings see the whole (padded) sequence and the rest this rank's T / sp tokens, every one
    # of them a loss row (an estimate: measured 0.8% low at sp2 x tp2)
    if plan.tp > 1:
        costs = mode_of(plan.tp_mode).costs(plan, pdtype, autocast)
        if not hasattr(config, "vocab_size"):  # ViT: its classifier head is priced as a GPT head of no vocabulary
            from types import SimpleNamespace

            config = SimpleNamespace(**{**vars(config), "vocab_size": 0, "n_positions": config.n_patches + 1})
        if plan.sp == 1:
            parts = step_parts(costs, config, rows // m, seq)
        else:
            t = seq + (-seq) % (2 * plan.sp)
            n = rows * (t // plan.sp)
            parts = dict(step_parts(costs, config, rows, t // plan.sp), first=step_parts(costs, config, rows, t)["first"],
                         last=[costs.norm(shape.dim, n), costs.lm_loss(shape.vocab_size, shape.dim, n, n)])
        fwd_bwd = lambda xs: sum(f + b for f, b in xs)  # noqa: E731
        # recompute reruns a block's forward up to the last tensor backward needs (torch's non-reentrant
        # checkpoint stops early): under 1D that leaves out the last row linear's all-reduce, whose output
        # nothing saves; the grid modes gather that linear's operands first, so they run it all again
        redo = parts["block"][:-1] if plan.tp_mode == "1d" else parts["block"]
        again = sum(f for f, _ in redo) if ckpt else 0.0
        per_mb = stage.blocks * (fwd_bwd(parts["block"]) + again)
        per_mb += (fwd_bwd(parts["first"]) if stage.first else 0.0) + (fwd_bwd(parts["last"]) if stage.last else 0.0)
        calls = m * stage.blocks * _TP_CALLS_PER_BLOCK[plan.tp_mode] * (1.5 if ckpt else 1.0)
        _add(out, ("tensor", "tp"), m * per_mb, calls)

    # sequence parallelism (with 1D tp inside each sp rank: heads split over tp)
    if plan.sp > 1:
        elem = 2 if autocast is not None else 4
        first = {"bert": 1, "vit": 2}.get(_family(config), 0)
        kv = shape.kv_heads or shape.n_heads
        for op, b in sp_bytes(n_layers=shape.n_layers, heads=shape.n_heads // plan.tp,
                              kv_heads=kv // plan.tp if kv % plan.tp == 0 else 1, head_dim=shape.q_dim // shape.n_heads,
                              batch=rows, seq=seq, sp=plan.sp, mode=plan.sp_mode, masked=masked, elem=elem,
                              dim=shape.dim, first_token=first, recompute=ckpt).items():
            _add(out, (op, "sp"), b, shape.n_layers * (plan.sp - 1) if op == "send" else shape.n_layers)

    # gradients over dp (x sp): DDP's buckets, ZeRO's reduce-scatter + all-gather, or FSDP2's units
    n = plan.dp * plan.sp
    grad_bytes = sum(p.numel() * p.element_size() for p in ps)
    if n > 1 and plan.zero == 0:
        group = "dpsp" if plan.sp > 1 else "dp"
        _add(out, ("all_reduce", group), _all_reduce(n, grad_bytes), max(1, math.ceil(grad_bytes / (25 * 2 ** 20))))
    elif n > 1 and plan.zero in (1, 2):
        group = "dpsp" if plan.sp > 1 else "dp"
        for numel, size in _buckets(ps):
            padded = math.ceil(numel / n) * n * size
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded)
            _add(out, ("all_gather", group), (n - 1) / n * padded)
    elif n > 1 and plan.zero == 3:
        group = "dpsp" if plan.sp > 1 else "dp"
        blocks = (spec.blocks if spec is not None else "blocks") + "."
        trainable = {id(p) for p in ps}
        for name, p in named.items():
            if id(p) not in trainable:
                continue
            _, chunk, per_row = _fsdp_rows(p, n)
            padded = chunk * n * per_row * p.element_size()
            gathers = 2 if name.startswith(blocks) else 1  # the root unit stays gathered into backward
            _add(out, ("all_gather", group), gathers * (n - 1) / n * padded, 0)
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded, 0)
        units = shape.n_layers + 1
        _add(out, ("all_gather", group), 0.0, 2 * units - 1)
        _add(out, ("reduce_scatter", group), 0.0, units)

    # the pipeline: activations forward, their gradients back, the tied embedding, the loss
    if plan.pp > 1:
        _add_pipeline(out, shape, plan, stage, rows, seq, masked, named, spec)

    # train_step's scalars: the label count and the loss summed over dp (float64 on CPU)
    if plan.dp > 1:
        _add(out, ("all_reduce", "dp"), 2 * _all_reduce(plan.dp, 8), 2)
    return out


def _family(config) -> str:
    name = type(config).__name__.lower()
    return "bert" if "bert" in name else "vit" if "vit" in name else "gpt"


def _add_pipeline(out: dict, shape: Shape, plan: Plan, stage: Stage, rows: int, seq: int, masked: bool,
                  named: dict, spec) -> None:
    m = plan.microbatches
    micro = rows // m
    e = 4  # the stream stays fp32 between stages (autocast casts inside the blocks)
    act = micro * seq * shape.dim * e / (plan.tp if plan.tp_mode != "1d" else 1)  # 2D/3D: this rank's block
    block_rows = micro // plan.batch_parts
    extra = block_rows * 8 * (seq if masked else 1) + block_rows * seq * 8  # mask (int64; (B, 1) ones), labels
    if not stage.last:  # x and the residual forward, with the mask and labels
        _add(out, ("send", "pp"), m * (2 * act + extra), 4 * m)
    if not stage.first:  # the gradients of x and the residual back
        _add(out, ("send", "pp"), m * 2 * act, 2 * m)
    shared = set(spec.first) & set(spec.last) if spec is not None else set()
    tied = [p for name, p in named.items() if p.requires_grad and name.rsplit(".", 1)[0] in shared]
    if tied and stage.first != stage.last:  # summed over the first and last stage's ranks (a pair)
        _add(out, ("all_reduce", "pp_embed"), sum(_all_reduce(2, p.numel() * p.element_size()) for p in tied),
             len(tied))
    _add(out, ("broadcast", "pp"), (plan.pp - 1) / plan.pp * 8, 1)
