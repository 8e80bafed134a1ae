"""Floors under what :func:`.predict.predict` says of a plan, from config arithmetic: what lets ``cuboid plans``
skip plans without building their meta models.

- :func:`states_floor`: bytes of model states on the fullest rank of a plan. Each parameter is held by at least
  one of the ``tp x pp`` ranks of one data replica (``E / ep`` experts each under ep), so the fullest of them
  holds at least the mean: the states of the whole model (:class:`ModelCounts`, counted once on one unsplit
  meta model) under the plan's ZeRO stage, over ``tp x pp`` (experts over ``tp x pp x ep``). The peak a plan
  is priced at adds activations, copies and buffers to its states, and checkpointing or micro-batches change
  none of them: a plan whose floor passes the usable memory fits under no checkpointing.
- :func:`memory_floor`: bytes of the peak of the rank with the most blocks, at the least: its states, the
  activations it keeps, the weight copies (autocast's, ZeRO-3's gathered blocks), DDP's buckets, the
  pipeline's receive buffers and the optimizer step's gradients and temporaries, each for the cheapest
  ``ceil(L / pp)`` blocks it may hold (:func:`_least`; blocks mix dense and expert bytes, so which are
  cheapest depends on what is counted) and the cheapest checkpointing and micro-batches the search tries.
  ``tests/parallel/test_plan_pruning.py`` holds it under the priced peak of every plan of small models.
- :func:`step_floor`: seconds of a step of the rank with the most blocks (at least ``ceil(L / pp)``; the
  cost model always looks at it): its compute and elementwise work without recompute and without the head,
  its pipeline bubble, and the collectives that are on the critical path whatever the parameters are
  (tensor, sequence and the experts' all-to-alls, priced on the links of the groups of that rank's position,
  the cheapest over the pipeline's positions where those differ), and the gradient traffic over dp that stays
  exposed whatever the overlap (ZeRO-1's, ZeRO-2's all-gather, an eighth of ZeRO-3's) for the bytes of its
  cheapest ``ceil(L / pp)`` blocks. DDP's all-reduce, the optimizer step and the pipeline sends only add to
  it. The tensor ranks of one position are taken to hold alike (the zoo's cuts are even).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..plan import Plan
from .hardware import Hardware
from .memory import (ADAMW_STATE_BYTES, elementwise_elements, expert_parameters, head_bytes,
                     held_activations, OPTIMIZER_TEMPORARIES, pipeline_buffers)
from .predict import compute_seconds, elementwise_seconds, tensor_axes
from .shape import Shape, Stage, bubble_fraction
from .traffic import traffic

FLOOR_GROUPS = ("tp", "sp", "ep")  # groups whose traffic predict always counts as exposed


@dataclass(frozen=True)
class ModelCounts:
    """Elements and bytes of a whole model's parameters: trainable ones (``dense``: all but the experts;
    ``experts``), each as (elements, bytes, elements held in less than 4 bytes), frozen bytes, and each
    block's trainable (dense bytes, expert bytes), smallest first; ``shapes``: each block's elements, frozen
    ones too, as (dense, expert, of the dense ones in matrices: what autocast copies), and ``itemsize``: the
    smallest element size of any parameter (what :func:`.memory.peak_bytes` prices gathered units at, at least)."""

    dense: tuple = (0, 0, 0)
    experts: tuple = (0, 0, 0)
    frozen_dense: int = 0
    frozen_experts: int = 0
    blocks: tuple = ()
    shapes: tuple = ()
    itemsize: int = 0

    @classmethod
    def of(cls, model, spec=None) -> "ModelCounts":
        """The counts of ``model`` (a meta model of one rank holding everything), its experts by ``spec``."""
        named = dict(model.named_parameters())
        mine = {id(p) for p in expert_parameters(named, spec)}
        prefix = (spec.blocks if spec is not None else "blocks") + "."
        trained = {True: [0, 0, 0], False: [0, 0, 0]}
        frozen = {True: 0, False: 0}
        per_block: dict = {}
        shapes: dict = {}
        seen = set()
        for name, p in named.items():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key = id(p) in mine
            if name.startswith(prefix):
                e = shapes.setdefault(name[len(prefix):].split(".", 1)[0], [0, 0, 0])
                e[key] += p.numel()
                e[2] += p.numel() if p.dim() >= 2 and not key else 0
            if not p.requires_grad:
                frozen[key] += p.numel() * p.element_size()
                continue
            t = trained[key]
            t[0] += p.numel()
            t[1] += p.numel() * p.element_size()
            t[2] += p.numel() if p.element_size() < 4 else 0
            if name.startswith(prefix):
                b = per_block.setdefault(name[len(prefix):].split(".", 1)[0], [0, 0])
                b[key] += p.numel() * p.element_size()
        blocks = tuple(sorted(tuple(b) for b in per_block.values()))
        itemsize = min((p.element_size() for p in named.values()), default=0)
        return cls(tuple(trained[False]), tuple(trained[True]), frozen[False], frozen[True], blocks,
                   tuple(tuple(e) for e in shapes.values()), itemsize)


def _group_states(counts: tuple, zero: int, n: int, grads: bool = True) -> float:
    """States of trainable parameters ``counts`` (elements, bytes, half elements) under ZeRO ``zero`` over ``n``
    ranks, as :func:`.memory.model_states` counts them (less its rounding up); ``grads``: with the gradients."""
    elements, nbytes, half = counts
    n = max(n, 1)
    shard = 1 if zero == 0 or n == 1 else n
    params = nbytes / (n if zero == 3 and n > 1 else 1)
    grad = nbytes / (n if zero >= 2 and n > 1 else 1) if grads else 0.0
    return params + grad + (elements * ADAMW_STATE_BYTES + half * 4) / shard


def states_floor(counts: ModelCounts, plan: Plan, grads: bool = True) -> float:
    """Bytes of model states the fullest rank of ``plan`` holds at the least (module docstring); ``grads``:
    with the gradients."""
    ranks = plan.tp * plan.pp
    n = plan.dp * plan.sp
    if plan.ep > 1:
        dense = _group_states(counts.dense, plan.zero, n, grads) + counts.frozen_dense
        experts = (_group_states(counts.experts, plan.zero, n // plan.ep, grads) + counts.frozen_experts) / plan.ep
    else:
        merged = tuple(a + b for a, b in zip(counts.dense, counts.experts))
        dense = _group_states(merged, plan.zero, n, grads) + counts.frozen_dense + counts.frozen_experts
        experts = 0.0
    return (dense + experts) / ranks


def memory_floor(counts: ModelCounts, config, plan: Plan, batch: int, seq: int, layout: str) -> float:
    """Bytes the fullest rank of ``plan`` needs at the least under any checkpointing: the larger of its states'
    floor and what the rank with the most blocks holds beside its activations (fewest micro-batches in flight,
    the cheaper of no and full checkpointing, of the plan's micro-batches and the most the search tries):
    without a pipeline every rank holds the same blocks, so its states less the gradients (which the peak
    does not hold beside the activations); under one, the states of the smallest blocks that rank holds
    (:func:`_stage_states`); and in both its weight copies, DDP's buckets and the pipeline's receive buffers
    (:func:`_held_extras`), or, where the optimizer step peaks higher, its gradients and the step's
    temporaries (:func:`_step_bytes`) in place of the activations and copies."""
    shape = Shape.of(config)
    stage = Stage(math.ceil(max(shape.n_layers, 1) / plan.pp), first=False, last=False, index=plan.pp - 1)
    rows = batch // plan.dp
    fewest = max(rows // max(plan.batch_parts, 1), 1) if plan.pp > 1 else 1  # micro-batches of one block each
    least = math.inf
    for ck in ("none", "full"):
        for m in {plan.microbatches, fewest}:
            p = plan.replace(checkpoint=ck, microbatches=m)
            fixed, beside = _held_extras(counts, shape, p, rows // m, seq, layout)
            act = held_activations(shape, p, stage, rows // m, seq, layout)
            least = min(least, fixed + max(act + beside, _step_bytes(counts, p, shape.n_layers, layout)))
    if plan.pp == 1:
        return max(states_floor(counts, plan), states_floor(counts, plan, grads=False) + least)
    return max(states_floor(counts, plan), _stage_states(counts, plan, shape.n_layers) + least)


def _held_extras(counts: ModelCounts, shape: Shape, plan: Plan, micro_rows: int, seq: int, layout: str) -> tuple:
    """(held throughout, held beside the activations): what :func:`.memory.peak_bytes` adds to the states of
    the rank with the most blocks (at least ``ceil(L / pp)``, each cut over tp, experts over tp x ep), at the
    least. Beside the activations: autocast's copies of the block linears (of its smallest blocks; under
    checkpointing one block's, the smallest), ZeRO-3's two gathered blocks (at least the ``ceil(L / pp)``-th
    smallest) and, without a pipeline, what the loss head keeps (:func:`.memory.head_bytes`); throughout:
    DDP's gradient buckets (its trainable bytes) and the pipeline's receive buffers of a stage that is not
    both first and last (it may be both under ``zbv``; ``interleaved`` is counted alike)."""
    k = math.ceil(max(shape.n_layers, 1) / plan.pp)
    split = (plan.tp, plan.tp * plan.ep) if plan.ep > 1 else (plan.tp, plan.tp)
    held = sorted(d / split[0] + e / split[1] for d, e, _ in counts.shapes)
    mats = sorted(m / plan.tp for _, _, m in counts.shapes)
    out, fixed = 0.0, 0.0
    if layout == "autocast" and mats:
        out += 2 * (sum(mats[:k]) if plan.checkpoint == "none" else mats[0])
    if plan.zero == 3 and plan.dp * plan.sp > 1 and held:
        out += 2 * held[min(k, len(held)) - 1] * counts.itemsize
    if plan.pp == 1:  # the one stage is the last: the loss head's saved gradients (and table)
        out += head_bytes(shape, plan, micro_rows, seq, layout)[0]
    if plan.zero == 0 and plan.dp * plan.sp > 1:
        fixed += _least(counts, plan, shape.n_layers, lambda dense, experts: dense + experts)
    if plan.pp > 1:
        ends = [(True, False), (False, True)] + ([(True, True)] if plan.schedule in ("interleaved", "zbv") else [])
        fixed += min(pipeline_buffers(plan, Stage(k, first=f, last=la), shape.dim, micro_rows, seq, layout)
                     for f, la in ends)
    return fixed, out


def _step_bytes(counts: ModelCounts, plan: Plan, n_layers: int, layout: str) -> float:
    """Gradients and the optimizer step's fp32 temporaries (:data:`.memory.OPTIMIZER_TEMPORARIES` per element
    of its pieces) of the trainable bytes the rank with the most blocks holds at the least (:func:`_least`),
    elements as the model's mean element size gives them."""
    def step(dense, experts):
        out = 0.0
        for nbytes, total, n in _groups(counts, plan, dense, experts):
            if nbytes and total[1]:
                out += nbytes / (n if plan.zero >= 2 and n > 1 else 1)
                out += nbytes * total[0] / total[1] * 4 * OPTIMIZER_TEMPORARIES[layout] / (
                    1 if plan.zero == 0 or n <= 1 else n)
        return out

    return _least(counts, plan, n_layers, step)


def _groups(counts: ModelCounts, plan: Plan, dense: float, experts: float) -> tuple:
    """((bytes, the model's trainable counts they are of, ZeRO group size)) of the dense and expert bytes."""
    n = plan.dp * plan.sp
    merged = counts.dense if plan.ep > 1 else tuple(a + b for a, b in zip(counts.dense, counts.experts))
    return (dense, merged, n), (experts, counts.experts, n // plan.ep)


def _stage_states(counts: ModelCounts, plan: Plan, n_layers: int) -> float:
    """States less gradients of the trainable bytes the rank with the most blocks holds at the least
    (:func:`_least`), elements as the model's mean element size gives them."""
    def states(dense, experts):
        out = 0.0
        for nbytes, total, size in _groups(counts, plan, dense, experts):
            if nbytes and total[1]:
                elements = nbytes * total[0] / total[1]
                out += _group_states((elements, nbytes, elements * total[2] / total[0]), plan.zero, size, grads=False)
        return out

    return _least(counts, plan, n_layers, states)


def _floor_params(dtype):
    """One stand-in trainable parameter of ``dtype``: what :func:`.traffic.traffic` reads the element size from."""
    import torch

    return {"floor": torch.empty(0, dtype=dtype, device="meta", requires_grad=True)}


def _symmetric(plan: Plan, hw: Hardware) -> bool:
    """Whether every pipeline position's groups span nodes alike (its ranks a multiple or divisor of a node)."""
    per_pp = plan.world_size // plan.pp
    return plan.pp == 1 or per_pp % hw.gpus_per_node == 0 or hw.gpus_per_node % per_pp == 0


def _least(counts: ModelCounts, plan: Plan, n_layers: int, cost) -> float:
    """The least ``cost(dense, experts)`` (linear in the trainable bytes, nothing for none) of what the rank with
    the most blocks holds: of the whole model without a pipeline, under one the sum of its ``ceil(L / pp)``
    cheapest blocks' (blocks mix dense and expert bytes: the cheapest depend on the cost); cut over tp
    (experts over tp x ep)."""
    def held(dense, experts):
        return ((dense + experts) / plan.tp, 0.0) if plan.ep == 1 else (dense / plan.tp, experts / (plan.tp * plan.ep))

    if plan.pp == 1:
        return cost(*held(counts.dense[1], counts.experts[1]))
    k = math.ceil(max(n_layers, 1) / plan.pp)
    return sum(sorted(cost(*held(d, e)) for d, e in counts.blocks)[:k])


def _gradient_floor(counts: ModelCounts, plan: Plan, hw: Hardware, groups: dict, n_layers: int) -> float:
    """Seconds of the data-parallel gradient and ZeRO traffic predict leaves exposed at the least: ZeRO-1's
    reduce-scatter and all-gather and ZeRO-2's all-gather whole, an eighth of ZeRO-3's (its first and last
    unit), nothing of DDP's all-reduce."""
    n = plan.dp * plan.sp
    if plan.zero == 0 or n == 1:
        return 0.0
    ops = {1: ("reduce_scatter", "all_gather"), 2: ("all_gather",), 3: ("reduce_scatter", "all_gather")}[plan.zero]
    share = 1 / 8 if plan.zero == 3 else 1.0

    def seconds(dense, experts):
        t = 0.0
        for nbytes, size, group in ((dense, n, "dpsp" if plan.sp > 1 else "dp"), (experts, n // plan.ep, "edp")):
            if nbytes and size > 1:
                t += sum(hw.collective_time(op, (size - 1) / size * nbytes, 0, groups.get(group, [0])) for op in ops)
        return t

    t = _least(counts, plan, n_layers, seconds)
    return t * share


def step_floor(config, plan: Plan, hw: Hardware, batch: int, seq: int, dtype,
               counts: Optional[ModelCounts] = None) -> float:
    """Seconds a step of ``plan`` takes at the least (module docstring); ``dtype``: the parameters' dtype in the
    layout the run trains in (what the tensor and expert exchanges move); ``counts``: the model's, to add the
    gradient traffic that stays exposed (:func:`_gradient_floor`)."""
    from ..mesh import Mesh

    shape = Shape.of(config)
    plan = plan.replace(checkpoint="none")
    stage = Stage(math.ceil(max(shape.n_layers, 1) / plan.pp), first=False, last=False, index=0)
    per_node = min(hw.gpus_per_node, plan.world_size)
    crowd = hw.crowding(per_node)
    elements = elementwise_elements(shape, plan, stage, batch, seq)
    compute = (compute_seconds(shape, plan, stage, hw, batch, seq) + elementwise_seconds(hw, plan, elements)) * crowd
    idle = max(0.0, 2.0 - per_node / hw.cores) if hw.cores and per_node > hw.cores else 1.0
    bubble = compute * bubble_fraction(plan) * min(idle, 1.0)
    sent = {k: v for k, v in traffic(config, plan, _floor_params(dtype), stage, batch, seq).items()
            if k[1] in FLOOR_GROUPS}
    per_pp = plan.world_size // plan.pp
    comm = math.inf
    for s in (range(1) if _symmetric(plan, hw) else range(plan.pp)):
        groups = Mesh.layout(plan, s * per_pp).group_ranks
        t = 0.0
        for (op, group), (nbytes, calls) in sent.items():
            axes = tensor_axes(plan) if op == "tensor" else (group,)
            kind = "all_reduce" if op == "tensor" else op
            t += sum(hw.collective_time(kind, nbytes / len(axes), calls / len(axes), groups.get(a, [0]))
                     for a in axes) * crowd
        if counts is not None:
            t += _gradient_floor(counts, plan, hw, groups, shape.n_layers) * crowd
        comm = min(comm, t)
    return compute + bubble + comm
