"""Pipeline stages under ZeRO-3 and tied embeddings: FSDP2 units per stage, the check that ZBV reduces a tied
module's gradient after its last use, and the embedding group of the first and last stages' ranks
(:class:`~.pipeline.Pipeline` uses them)."""
from __future__ import annotations

import torch
from torch import nn

from . import comm
from .zero import param_tags, retag, shard_experts_over_edp


def shard_stages(model: nn.Module, modules: list, group, split_backward: bool = False, *, experts=(),
                 expert_group=None) -> None:
    """ZeRO-3 under pp: FSDP2 ``fully_shard`` over the dp ``group``, one unit per kept block and one per stage
    module (its embeddings or head), as torchtitan composes FSDP with pipelining; torch's stages then run
    their FSDP units without gradient sync until the last micro-batch's backward.

    ``split_backward`` (ZBV): torch's input-gradient step records which weights to differentiate later as
    the stage module's parameters *at that moment*, so every unit must hold its gathered parameters from
    the forward to the weight step (``reshard_after_forward=False``; torch's schedule gathers a stage once
    and frees it after its last action): with the blocks freed after each forward (FSDP2's default), the
    input step would see the sharded parameters, which are not in the autograd graph, and the weight step
    would make no gradient for them. A module both ends own (the tied embedding, both ends
    on one rank under ZBV) is sharded with the first stage's unit and left out of the last's
    (``ignored_params``); the last stage differentiates the same gathered parameter, whose gradient the
    first stage's unit reduces after its last backward, which ZBV runs last of all on that rank.

    Expert-parallel layers (``experts``) are units of their own over ``expert_group`` (``edp``: the ranks
    holding the same experts), made before the blocks' units; with ``edp`` of one rank (None) they are left
    out of every unit (their gradients are complete): :func:`~.zero.shard_experts_over_edp`.
    """
    import warnings

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")  # as zero.py
    mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    tags = param_tags(model)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous():  # FSDP2 takes contiguous parameters (folder loads map transposed views)
                p.data = p.data.contiguous()
    reshard = False if split_backward else None  # None: FSDP2's default (blocks freed after forward, roots kept)
    ignored = shard_experts_over_edp(experts, expert_group, mesh.device_type, reshard)
    for block in (b for m in modules for b in m.blocks.values()):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, ignored_params=ignored or None)
    sharded: set = set()  # ids of end modules an earlier stage module of this rank shards
    for m in modules:
        shared = [e for e in m.ends.values() if id(e) in sharded]
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard,
                    ignored_params={p for e in shared for p in e.parameters()} | ignored or None)
        sharded.update(id(e) for e in m.ends.values())
    for m in modules:
        comm.guard_fsdp(m)  # a stalled gather or reduce-scatter names rank, group and op
    retag(model, tags)  # tensor-parallel placements (and layers) survive the DTensor swap


def check_tied_reduce(schedule, rank: int, ids: list) -> None:
    """ZeRO-3 with both ends of a tie on pp rank ``rank`` (ZBV's rank 0): the first stage's FSDP unit reduces
    the tied module's gradient, to which the last stage's backward adds, so that reduction must come after
    the last stage's every backward action. torch's ZBV order has it so (checked for pp 2..8 with pp..16
    micro-batches); a torch whose order differs is refused here rather than losing the gradient silently.
    ``schedule`` holds every rank's order, so every rank checks ``rank``'s and all raise together."""
    from torch.distributed.pipelining import schedules as S

    order = schedule.pipeline_order_with_comms[rank]
    backward = (S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT)
    reduced = max(i for i, a in enumerate(order) if a.stage_index == ids[0] and a.computation_type == S.REDUCE_GRAD)
    last = max(i for i, a in enumerate(order) if a.stage_index == ids[1] and a.computation_type in backward)
    if reduced < last:
        raise NotImplementedError(f"this torch's ZBV order reduces stage {ids[0]}'s gradients before stage "
                                  f"{ids[1]}'s last backward, which adds to the tied module's gradient: ZeRO-3 "
                                  "with a tied module under zbv is not built for it")


def embedding_group(mesh, last_rank: int):
    """The group of the ranks running the first and the last stage (pp index ``last_rank``) with this
    rank's other coordinates (None where rank 0 runs both, as ZBV's V); every such group of the world
    is made, in one order."""
    plan = mesh.plan
    if plan.pp == 1 or last_rank == 0:
        return None
    grid = torch.arange(plan.world_size).reshape(plan.pp, -1)
    mine = None
    for col in range(grid.shape[1]):
        ranks = [int(grid[0, col]), int(grid[last_rank, col])]
        group = comm.new_group(ranks, "pp_embed")
        if mesh.rank in ranks:
            mine = group
            comm.name_group(group, "pp_embed")
    return mine
