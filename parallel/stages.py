"""Pipeline stages: which blocks and end modules each rank keeps under pp (the cut, on a meta model).

A spec names the blocks (``spec.blocks``), the modules the first stage owns
(``spec.first``: embeddings) and those the last owns (``spec.last``: final
norm, pooler, heads). A module in both (GPT's tied token embedding) lives on
both stages. :func:`cut_stages` balances the blocks by cost, counting the
first stage's embedding and the last stage's head (an LM head is several
blocks of work at GPT-2's vocabulary); a stage may hold no block.
:func:`cut_model` keeps this rank's stages of a model and records the cut in
its parallel state (``model.parallel.stages``), where
:class:`~.pipeline.Pipeline` reads it.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from .state import ParallelState, attach, planned


def cut_stages(block_costs: Sequence[float], stages: int, first_cost: float = 0.0,
               last_cost: float = 0.0) -> list[range]:
    """Contiguous block ranges for ``stages`` stages minimising the costliest stage.

    The first stage also pays ``first_cost`` (embeddings), the last
    ``last_cost`` (norm, head, loss). Exact (dynamic programming over the cut
    points); ties go to the earlier cut. A stage may get no block when the
    costs say so (a head worth more than the blocks).
    """
    n = len(block_costs)
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, a: int, b: int) -> float:
        extra = (first_cost if s == 0 else 0.0) + (last_cost if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    INF = float("inf")
    # best[s][b]: the least max-cost of stages 0..s covering blocks [0, b)
    best = [[INF] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for b in range(n + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, stages):
        for b in range(n + 1):
            for a in range(b + 1):
                v = max(best[s - 1][a], cost(s, a, b))
                if v < best[s][b] - 1e-12 * max(1.0, abs(v)):
                    best[s][b], cut[s][b] = v, a
    bounds, b = [], n
    for s in range(stages - 1, 0, -1):
        a = cut[s][b]
        bounds.append(range(a, b))
        b = a
    bounds.append(range(0, b))
    return bounds[::-1]


class Elsewhere(nn.Module):
    """Stands where a module of another stage was: no parameters, calling it is an error."""

    placeholder = True  # the tensor engine's walker skips it

    def __init__(self, name: str, where: str = "") -> None:
        super().__init__()
        self.where = f"{name} (not on this rank's pipeline stages{': ' + where if where else ''})"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.where} was called")

    def extra_repr(self) -> str:
        return self.where


def keep_stage(model: nn.Module, spec, blocks, first: bool, last: bool, where: str = "") -> nn.Module:
    """Drop from ``model`` (in place; meta or not) what this rank's stages do not own; returns it.

    ``blocks``: the block indices kept (a range or any iterable); ``first`` /
    ``last``: whether this rank runs the pipeline's first / last stage (which
    own ``spec.first`` / ``spec.last``). Dropped blocks and end modules become
    :class:`Elsewhere`, so the kept ones keep their single-device names (a
    checkpoint written from a stage uses them).
    """
    keep = set(blocks)
    seq = getattr(model, spec.blocks)
    for i in range(len(seq)):
        if i not in keep:
            seq[i] = Elsewhere(f"{spec.blocks}.{i}", where)
    gone = dropped_ends(spec, first, last)
    for name, _ in list(model.named_children()):
        if name in gone:
            setattr(model, name, Elsewhere(name, where))
    return model


def dropped_ends(spec, first: bool, last: bool) -> set:
    """The end modules (``spec.first``, ``spec.last``) a rank's stages do not own: those of the first stage
    unless it runs it (``first``), those of the last unless ``last``."""
    owned = (set(spec.first) if first else set()) | (set(spec.last) if last else set())
    return (set(spec.first) | set(spec.last)) - {spec.blocks} - owned


def stage_count(plan) -> int:
    """The pipeline's stages: one a rank, two for interleaved and ZBV (:func:`stage_ids`)."""
    return plan.pp * (1 if plan.schedule in ("gpipe", "1f1b") else 2)


def stage_ranges(plan, costs: tuple) -> list:
    """Every stage's block range: the plan's ``stage_blocks``, or balanced by ``costs`` = (per-block,
    embedding, head) (:func:`cut_stages`)."""
    total = stage_count(plan)
    if plan.stage_blocks:  # the plan's own split
        starts = [sum(plan.stage_blocks[:s]) for s in range(total + 1)]
        return [range(starts[s], starts[s + 1]) for s in range(total)]
    return cut_stages(costs[0], total, costs[1], costs[2])



def stage_ids(schedule: str, rank: int, pp: int) -> list[int]:
    """The pipeline stages rank ``rank`` of ``pp`` runs: one, or two virtual stages (interleaved: r and
    r + pp; ZBV's V shape: r and 2 pp - 1 - r)."""
    if schedule in ("gpipe", "1f1b"):
        return [rank]
    if schedule == "interleaved":
        return [rank, rank + pp]
    return [rank, 2 * pp - 1 - rank]



def cut_model(model: nn.Module, spec, mesh, costs: tuple) -> nn.Module:
    """Keep this rank's pipeline stages of a (meta) model: blocks balanced by ``costs`` = (per-block,
    embedding, head) over the plan's stages (two per rank for interleaved and ZBV), or as the plan's
    ``stage_blocks`` say; in place.

    The ranges of every stage are kept in the model's parallel state
    (``model.parallel.stages``) for :class:`Pipeline`.
    """
    plan = mesh.plan
    ids = stage_ids(plan.schedule, mesh.coords["pp"], plan.pp)
    blocks = stage_ranges(plan, costs)
    total = len(blocks)
    keep = [i for s in ids for i in blocks[s]]
    keep_stage(model, spec, keep, 0 in ids, total - 1 in ids, where=f"stages {ids}")
    state = planned(model)
    if state is None or state.plan != plan:
        state = attach(model, ParallelState(plan=plan, mesh=mesh, spec=spec))
    state.stages = blocks
    return model
