"""Bytes a rank sends in a training step under a plan, group by group (exact: the tests hold them equal to
``comm.count``): the tensor modes' parts, the sequence split, DDP's / ZeRO's gradient traffic, the pipeline.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from ..plan import Plan
from .memory import expert_parameters, fsdp_rows, gradient_buckets, trainable
from .shape import Shape, Stage

# collectives per block and step of each tensor mode (forward + backward), for the alpha term only:
# counted with comm.count on a 2-block GPT (2D on 4 ranks, 2.5D and 3D on 8), embeddings and head included
TP_CALLS_PER_BLOCK = {"1d": 4, "2d": 65, "2.5d": 100, "3d": 70}
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP's default bucket: one all-reduce each


def _add(out: dict, key: tuple, nbytes: float, calls: float = 1.0) -> None:
    b, c = out.get(key, (0.0, 0.0))
    out[key] = (b + nbytes, c + calls)


def _all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def _autocast(plan: Plan):
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[plan.dtype]


def traffic(config, plan: Plan, params: dict, stage: Stage, batch: int, seq: int, *, spec=None,
            masked: bool = False) -> dict:
    """``{(op, group): (bytes, calls)}`` one rank sends in a ``train_step`` of a ``batch`` x ``seq``
    global batch under ``plan``, in :mod:`cuboid.parallel.comm`'s convention (what ``comm.count`` measures).

    ``config``: the model's :class:`~.shape.Shape` or a config its family registered; ``params``: this
    rank's parameters by name (meta tensors do); ``stage``: its pipeline stage; ``spec``: the model's
    :class:`~cuboid.parallel.spec.ShardingSpec` (its blocks make ZeRO-3's units, the modules its first and
    last stages share are tied over ``pp``). Bytes are exact for the zoo's models with AdamW and no
    clipping; ``calls`` are exact for the gradient and pipeline traffic and estimated for the tensor modes
    (they only price latency).
    """
    shape = Shape.of(config)
    out: dict = {}
    rows = batch // plan.dp
    ps = trainable(params.values())
    if plan.tp > 1:
        _add_tensor(out, shape, plan, stage, rows, seq, ps[0].dtype if ps else torch.float32)
    if plan.sp > 1:
        _add_sequence(out, shape, plan, rows, seq, masked)
    experts = {id(p) for p in expert_parameters(params, spec)} if plan.ep > 1 else set()
    if plan.ep > 1:
        _add_experts(out, shape, plan, stage, rows, seq, ps[0].element_size() if ps else 4)
    if plan.dp * plan.sp > 1:
        _add_gradients(out, shape, plan, params, [p for p in ps if id(p) not in experts], spec)
    if experts and plan.dp * plan.sp // plan.ep > 1:
        _add_expert_gradients(out, plan, {n: p for n, p in params.items() if id(p) in experts})
    if plan.pp > 1:
        _add_pipeline(out, shape, plan, stage, rows, seq, masked, params, spec)
    if shape.sparse and shape.balance_stats and plan.dp * plan.sp > 1:
        _add_balance(out, shape, plan, stage)
    # train_step's scalars summed over dp (float64 on CPU): each micro-batch's label count, then the loss
    if plan.dp > 1:
        _add(out, ("all_reduce", "dp"), _all_reduce(plan.dp, 8 * plan.microbatches) + _all_reduce(plan.dp, 8), 2)
    return out


def expert_exchange_bytes(tokens: float, top_k: int, dim: int, elem: int, ep: int) -> float:
    """Bytes one rank sends in one expert all-to-all of a sparse layer: ``tokens x top_k x dim x elem x
    (ep - 1) / ep``.

    Each of the rank's ``tokens`` goes to ``top_k`` experts as a row of ``dim`` elements of ``elem`` bytes; the
    experts are split evenly over the ``ep`` ranks, so under even routing ``(ep - 1) / ep`` of those rows live
    on another rank (the rest stay here and are not counted, as :mod:`cuboid.parallel.comm` counts an
    all-to-all). The combine sends as many rows back. A sparse layer makes four such exchanges per micro-batch
    (dispatch and combine in forward, their gradients in backward) and two more when its forward is
    recomputed. Exact for a routing that sends each rank's choices evenly over the ranks; a skewed routing
    sends more or less (``bench/moe.py`` measures it)."""
    return tokens * top_k * dim * elem * (ep - 1) / ep if ep > 1 else 0.0


def engine_config(shape: Shape) -> SimpleNamespace:
    """What :func:`cuboid.parallel.tensor.engine.step_parts` reads of a model, from ``shape``. It prices two
    block layouts, told apart by ``n_kv_heads``: GPT's (fused qkv, LayerNorm, fc and proj, a position table)
    and Llama's (q, k, v apart, RMSNorm, a gated MLP, no table); a gated MLP is the second."""
    view = SimpleNamespace(dim=shape.dim, vocab_size=shape.vocab_size, hidden=shape.hidden, n_heads=shape.n_heads,
                           n_positions=shape.n_positions, n_layers=shape.n_layers)
    if shape.gated_mlp:
        view.n_kv_heads = shape.kv_heads or shape.n_heads
        view.head_dim = shape.q_dim // shape.n_heads
    return view


def _add_tensor(out: dict, shape: Shape, plan: Plan, stage: Stage, rows: int, seq: int, pdtype) -> None:
    """Tensor parallelism: the stage's parts, once per micro-batch (forward again when recomputing). Under sp
    the embeddings see the whole (padded) sequence and the rest this rank's T / sp tokens, every one of them a
    loss row (an estimate: measured 0.8% low at sp2 x tp2)."""
    from ..tensor.engine import mode_of, step_parts

    m = plan.microbatches if plan.pp > 1 else 1
    costs = mode_of(plan.tp_mode).costs(plan, pdtype, _autocast(plan))
    view = engine_config(shape)
    if plan.sp == 1:
        parts = step_parts(costs, view, rows // m, seq)
    else:
        t = seq + (-seq) % (2 * plan.sp)
        n = rows * (t // plan.sp)
        parts = dict(step_parts(costs, view, rows, t // plan.sp), first=step_parts(costs, view, rows, t)["first"],
                     last=[costs.norm(shape.dim, n), costs.lm_loss(shape.vocab_size, shape.dim, n, n)])
    recompute = plan.checkpoint != "none"  # full and selective alike re-run a block's collectives

    def fwd_bwd(xs):
        return sum(f + b for f, b in xs)

    # recompute reruns a block's forward up to the last tensor backward needs (torch's non-reentrant
    # checkpoint stops early): under 1D that leaves out the last row linear's all-reduce, whose output
    # nothing saves; the grid modes gather that linear's operands first, so they run it all again
    redo = parts["block"][:-1] if plan.tp_mode == "1d" else parts["block"]
    again = sum(f for f, _ in redo) if recompute else 0.0
    per_mb = stage.blocks * (fwd_bwd(parts["block"]) + again)
    if shape.sparse:  # a sparse block's MLP is whole on every tensor rank (1D: the router and experts replicate)
        sparse = round(shape.sparse_layers * stage.blocks / max(shape.n_layers, 1))
        mlp = parts["block"][-shape.mlp_matrices:]
        # the whole MLP sends nothing: a recompute reruns the attention's row all-reduce (the MLP reads it)
        per_mb -= sparse * (fwd_bwd(mlp) + (again - sum(f for f, _ in parts["block"][:-shape.mlp_matrices])
                                            if recompute else 0.0))
    per_mb += (fwd_bwd(parts["first"]) if stage.first else 0.0) + (fwd_bwd(parts["last"]) if stage.last else 0.0)
    if shape.head_norm:  # the q and k norms' weight gradients, summed over the tensor group (two all-reduces)
        per_mb += stage.blocks * _all_reduce(plan.tp, shape.head_norm * torch.finfo(pdtype).bits // 8)
    calls = m * stage.blocks * TP_CALLS_PER_BLOCK[plan.tp_mode] * (1.5 if recompute else 1.0)
    _add(out, ("tensor", "tp"), m * per_mb, calls)


def _add_sequence(out: dict, shape: Shape, plan: Plan, rows: int, seq: int, masked: bool) -> None:
    """Sequence parallelism (with 1D tp inside each sp rank: heads split over tp)."""
    from ..sequence_split import bytes_per_step

    kv = shape.kv_heads or shape.n_heads
    sent = bytes_per_step(n_layers=shape.n_layers, heads=shape.n_heads // plan.tp,
                          kv_heads=kv // plan.tp if kv % plan.tp == 0 else 1, head_dim=_moved_head_dim(shape),
                          batch=rows, seq=seq, sp=plan.sp, mode=plan.sp_mode, masked=masked,
                          elem=2 if _autocast(plan) is not None else 4, dim=shape.dim,
                          first_token=shape.first_token_tensors, recompute=plan.checkpoint != "none")
    for op, b in sent.items():
        _add(out, (op, "sp"), b, shape.n_layers * (plan.sp - 1) if op == "send" else shape.n_layers)


def _moved_head_dim(shape: Shape):
    """The head width sp's exchanges move per head: q/k's, or for latent attention (values of ``v_head_dim``)
    the mean of q/k's and v's: a ring passes k and v, all-to-all q, k, v and the output (v's width), each as wide
    as its head, so the bytes are those of heads of the mean width (measured equal at sp=2 on deepseek-v3-debug)."""
    d = shape.q_dim // shape.n_heads
    return d if not shape.v_head_dim else (d + shape.v_head_dim) / 2


def _add_gradients(out: dict, shape: Shape, plan: Plan, named: dict, ps: list, spec) -> None:
    """Gradients over dp (x sp): DDP's buckets, ZeRO-1/2's reduce-scatter + all-gather, or FSDP2's units."""
    n = plan.dp * plan.sp
    group = "dpsp" if plan.sp > 1 else "dp"
    if plan.zero == 0:
        grad_bytes = sum(p.numel() * p.element_size() for p in ps)
        _add(out, ("all_reduce", group), _all_reduce(n, grad_bytes), max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES)))
    elif plan.zero in (1, 2):
        for numel, size in gradient_buckets(ps):
            padded = math.ceil(numel / n) * n * size
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded)
            _add(out, ("all_gather", group), (n - 1) / n * padded)
    else:
        blocks = (spec.blocks if spec is not None else "blocks") + "."
        mine = {id(p) for p in ps}
        for name, p in named.items():
            if id(p) not in mine:
                continue
            _, chunk, per_row = fsdp_rows(p, n)
            padded = chunk * n * per_row * p.element_size()
            gathers = 2 if name.startswith(blocks) else 1  # the root unit stays gathered into backward
            _add(out, ("all_gather", group), gathers * (n - 1) / n * padded, 0)
            _add(out, ("reduce_scatter", group), (n - 1) / n * padded, 0)
        units = shape.n_layers + 1
        _add(out, ("all_gather", group), 0.0, 2 * units - 1)
        _add(out, ("reduce_scatter", group), 0.0, units)


def _add_experts(out: dict, shape: Shape, plan: Plan, stage: Stage, rows: int, seq: int, elem: int) -> None:
    """Expert parallelism, per sparse layer of the stage and micro-batch: the counts exchange (an all-to-all of
    ``E`` int64 counts, ``(ep - 1) / ep * 8 E`` bytes) and the four token exchanges of
    :func:`expert_exchange_bytes` (dispatch and combine, forward and backward), the forward's three again when
    a checkpointed block is recomputed. Rows travel in the parameters' dtype (``elem`` bytes)."""
    if not shape.sparse:
        return
    m = plan.microbatches if plan.pp > 1 else 1
    tokens = rows // m * seq / plan.sp
    layers = round(shape.sparse_layers * stage.blocks / max(shape.n_layers, 1))
    again = 1 if plan.checkpoint != "none" else 0
    counts = (plan.ep - 1) / plan.ep * 8 * shape.experts
    rows_bytes = expert_exchange_bytes(tokens, shape.top_k, shape.dim, elem, plan.ep)
    _add(out, ("all_to_all", "ep"), m * layers * ((1 + again) * (counts + 2 * rows_bytes) + 2 * rows_bytes),
         m * layers * (3 * (1 + again) + 2))


def _add_balance(out: dict, shape: Shape, plan: Plan, stage: Stage) -> None:
    """A mixture of experts' router statistics, summed over dp (x sp) once per forward so that the auxiliary
    loss is the global micro-batch's (:class:`cuboid.parallel.experts.BalanceReduce`): one all-reduce of the
    counts, the probability sums (E fp32 each) and the tokens. Under a pipeline the last stage does it, for a
    model whose aux loss joins the loss (the others carry no statistics)."""
    if plan.pp > 1 and not (stage.last and shape.aux_loss):
        return
    m = plan.microbatches
    n = plan.dp * plan.sp
    _add(out, ("all_reduce", "dpsp" if plan.sp > 1 else "dp"), m * _all_reduce(n, (2 * shape.experts + 1) * 4), m)


def _add_expert_gradients(out: dict, plan: Plan, named: dict) -> None:
    """The gradients of the experts' parameters ``named`` over ``edp`` (the ``dp x sp / ep`` ranks holding the
    same experts): one flat all-reduce under plain data parallelism, ZeRO-1/2's buckets of their own, or FSDP2
    units of their own (one per expert layer)."""
    n = plan.dp * plan.sp // plan.ep
    mine = trainable(named.values())
    if plan.zero == 0:
        _add(out, ("all_reduce", "edp"), _all_reduce(n, sum(p.numel() * p.element_size() for p in mine)))
    elif plan.zero in (1, 2):
        for numel, size in gradient_buckets(mine):
            padded = math.ceil(numel / n) * n * size
            _add(out, ("reduce_scatter", "edp"), (n - 1) / n * padded)
            _add(out, ("all_gather", "edp"), (n - 1) / n * padded)
    else:
        units = {name.rsplit(".", 1)[0] for name in named}
        for p in named.values():
            _, chunk, per_row = fsdp_rows(p, n)
            padded = chunk * n * per_row * p.element_size()
            _add(out, ("all_gather", "edp"), 2 * (n - 1) / n * padded, 0)
            _add(out, ("reduce_scatter", "edp"), (n - 1) / n * padded, 0)
        _add(out, ("all_gather", "edp"), 0.0, 2 * len(units))
        _add(out, ("reduce_scatter", "edp"), 0.0, len(units))


def _add_pipeline(out: dict, shape: Shape, plan: Plan, stage: Stage, rows: int, seq: int, masked: bool,
                  named: dict, spec) -> None:
    """The pipeline: activations forward, their gradients back, the tied embedding, the loss."""
    m = plan.microbatches
    micro = rows // m
    e = 4  # the stream stays fp32 between stages (autocast casts inside the blocks)
    act = micro * seq * shape.dim * e / (plan.tp if plan.tp_mode != "1d" else 1)  # 2D/3D: this rank's block
    block_rows = micro // plan.batch_parts
    extra = block_rows * 8 * (seq if masked else 1) + block_rows * seq * 8  # mask (int64; (B, 1) ones), labels
    routed = shape.sparse and shape.aux_loss  # the router statistics travel with the stream: (E + 1) and E fp32
    if not stage.last:  # x and the residual forward, with the mask and labels
        _add(out, ("send", "pp"), m * (2 * act + extra), 4 * m)
        if routed:
            _add(out, ("send", "pp"), m * (2 * shape.experts + 1) * 4, 2 * m)
    if not stage.first:  # the gradients of x and the residual back (and of the probability sums)
        _add(out, ("send", "pp"), m * 2 * act, 2 * m)
        if routed:
            _add(out, ("send", "pp"), m * shape.experts * 4, m)
    shared = set(spec.first) & set(spec.last) if spec is not None else set()
    tied = [p for name, p in named.items() if p.requires_grad and name.rsplit(".", 1)[0] in shared]
    if tied and stage.first != stage.last:  # summed over the first and last stage's ranks (a pair)
        _add(out, ("all_reduce", "pp_embed"), sum(_all_reduce(2, p.numel() * p.element_size()) for p in tied),
             len(tied))
    _add(out, ("broadcast", "pp"), (plan.pp - 1) / plan.pp * 8, 1)
