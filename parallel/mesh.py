"""The process mesh: one object that owns every process group of a plan.

Ranks are laid out as a (pp, dp, sp, tp) grid, tp fastest (neighbouring ranks
share a tensor-parallel group, the most talkative one). A one-process run has
no process group at all: every group is ``None`` and every collective is a
no-op, so single-device code needs no launcher.

The ``tp`` group is further laid out as the plan's ``tp_grid``, last index
fastest, and the mesh owns a group along each axis of that grid:

- 2D (q, q): tensor rank ``t = i q + j`` sits at row i, column j; ``tp_row``
  is the q ranks of its row (same i), ``tp_col`` the q ranks of its column
  (same j);
- 2.5D (d, q, q) and 3D (q, q, q): ``t = k q^2 + i q + j``; ``tp_dep`` is the
  ranks with the same (i, j), ``tp_row`` / ``tp_col`` as in 2D inside depth k.

Under expert parallelism (``plan.ep > 1``) the ``dp x sp`` ranks of each
(pp, tp) coordinate, numbered ``d = dp_index * sp + sp_index``, are cut into
contiguous runs of ``ep`` (torchtitan's layout): ``ep`` is the run holding
one copy of every expert (``d // ep`` fixed), ``edp`` the ``dp x sp / ep``
ranks holding the same experts (``d % ep`` fixed), over which the experts'
gradients are averaged and ZeRO shards their state.

As for every axis, ``coords[name]`` is this rank's index *inside* group
``name`` (so in 2D ``coords["tp_row"] = j`` and ``coords["tp_col"] = i``), and
an axis of size one has group ``None``. Every group is registered with
:func:`cuboid.parallel.comm.name_group` under its axis name, so byte tallies
read ``dp``, ``tp``, ``tp_row``, ...

:func:`init_distributed` starts ``torch.distributed`` from torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with
gloo on CPU and NCCL on CUDA. Every group, the world's and the mesh's, is made
with one timeout (``timeout_s`` or ``CUBOID_TIMEOUT_S``, default 300 s): a
collective or p2p whose peer stalls that long fails with
:class:`cuboid.parallel.comm.CollectiveTimeout` instead of waiting for ever.
What it starts it also ends: an exit handler
(:func:`cuboid.parallel.comm.release_groups_at_exit`) destroys the process
groups while the interpreter is still whole; without it a gloo process that
simply returns can die of SIGABRT at exit.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from . import comm
from .plan import Plan

AXES = ("pp", "dp", "sp", "tp")
TP_AXES = {2: ("tp_col", "tp_row"), 3: ("tp_dep", "tp_col", "tp_row")}  # group along grid dim k varies index k


def init_distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> tuple[int, int]:
    """Start the default process group from the environment if there is one; (rank, world size).

    Without ``WORLD_SIZE`` (a plain ``python`` run) nothing is started and
    (0, 1) is returned. Gloo is pinned to the loopback interface when the
    master address is a loopback one. ``timeout_s`` (default
    ``CUBOID_TIMEOUT_S``, else 300) bounds every wait on a peer.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        if timeout_s is not None:  # no peers; what else is bounded by it (GRPO's reward functions) reads it
            comm.set_timeout(timeout_s)
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if backend == "gloo" and (addr.startswith("127.") or addr == "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # every collective and p2p of every group (the mesh's are made with the same) fails after this, never hangs
    comm.set_timeout(timeout_s if timeout_s is not None else comm.timeout_s())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=comm.timeout_s()))
    comm.release_groups_at_exit()
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Mesh:
    """Process groups of a plan. ``coords[axis]`` is this rank's index along ``axis``."""

    plan: Plan
    rank: int = 0
    world_size: int = 1
    coords: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict)     # axis -> ProcessGroup or None
    group_ranks: dict = field(default_factory=dict)  # axis -> global ranks of this rank's group

    @classmethod
    def build(cls, plan: Plan, model_config=None) -> "Mesh":
        """The mesh for ``plan`` over the running world (starting it from the environment if needed)."""
        rank, world = init_distributed()
        plan.validate(model_config, world)
        return cls.layout(plan, rank, create_groups=world > 1)

    @classmethod
    def layout(cls, plan: Plan, rank: int = 0, *, create_groups: bool = False) -> "Mesh":
        """The mesh of ``rank`` in ``plan``'s world: coords and group ranks of every axis.

        Without ``create_groups`` no process group is made (every group is
        ``None``): the layout alone, for planning and tests.
        """
        sizes = {"pp": plan.pp, "dp": plan.dp, "sp": plan.sp, "tp": plan.tp}
        mesh = cls(plan=plan, rank=rank, world_size=plan.world_size)
        grid = torch.arange(plan.world_size).reshape(*(sizes[a] for a in AXES))
        mesh._add_groups(grid, AXES, create_groups)
        if plan.sp > 1:  # data parallelism averages gradients over dp x sp (every sp rank holds every weight)
            mesh._add_groups(grid.reshape(plan.pp, plan.dp * plan.sp, 1, plan.tp), ("pp", "dpsp", "sp1", "tp"),
                             create_groups, skip=1, only=1)
        if plan.ep > 1:  # expert parallelism: runs of ep among the dp x sp ranks, and the ranks across the runs
            experts = grid.reshape(plan.pp, plan.dp * plan.sp // plan.ep, plan.ep, plan.tp)
            mesh._add_groups(experts, ("pp", "edp", "ep", "tp"), create_groups, skip=1, only=2)
            mesh._add_groups(experts, ("pp", "edp", "ep", "tp"), create_groups, skip=1, only=1)
        tp_grid = plan.tp_grid
        if len(tp_grid) > 1:
            mesh._add_groups(grid.reshape(*grid.shape[:3], *tp_grid), ("pp", "dp", "sp") + TP_AXES[len(tp_grid)],
                             create_groups, skip=3)
        return mesh

    def _add_groups(self, grid: torch.Tensor, axes: tuple, create: bool, skip: int = 0,
                    only: Optional[int] = None) -> None:
        """One group along each of ``grid``'s dims from ``skip`` on (or dim ``only``), created on every rank in
        the same order."""
        for i, axis in enumerate(axes):
            if i < skip or (only is not None and i != only):
                continue
            size = grid.shape[i]
            moved = grid.movedim(i, -1).reshape(-1, size)
            for ranks in moved.tolist():
                group = comm.new_group(ranks, axis) if create and size > 1 else None
                if self.rank in ranks:
                    self.groups[axis] = group
                    self.group_ranks[axis] = ranks
                    self.coords[axis] = ranks.index(self.rank)
                    comm.name_group(group, axis)

    def __deepcopy__(self, memo):
        return self  # process groups cannot be copied; a model copy shares its mesh

    def size(self, axis: str) -> int:
        return len(self.group_ranks.get(axis, [self.rank]))

    def group(self, axis: str):
        return self.groups.get(axis)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            with comm.guarded("barrier", None):
                dist.barrier()

    def __repr__(self) -> str:
        c = ", ".join(f"{a}={self.coords.get(a, 0)}/{self.size(a)}" for a in AXES)
        return f"Mesh(rank {self.rank} of {self.world_size}: {c})"
