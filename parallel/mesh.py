"""The process mesh: one object that owns every process group of a plan.

Ranks are laid out as a (pp, dp, sp, tp) grid, tp fastest (neighbouring ranks
share a tensor-parallel group, the most talkative one). A one-process run has
no process group at all: every group is ``None`` and every collective is a
no-op, so single-device code needs no launcher.

:func:`init_distributed` starts ``torch.distributed`` from torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with
gloo on CPU and NCCL on CUDA.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .plan import Plan

AXES = ("pp", "dp", "sp", "tp")


def init_distributed(backend: Optional[str] = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Start the default process group from the environment if there is one; (rank, world size).

    Without ``WORLD_SIZE`` (a plain ``python`` run) nothing is started and
    (0, 1) is returned. Gloo is pinned to the loopback interface when the
    master address is a loopback one.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if backend == "gloo" and (addr.startswith("127.") or addr == "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
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
        sizes = {"pp": plan.pp, "dp": plan.dp, "sp": plan.sp, "tp": plan.tp}
        mesh = cls(plan=plan, rank=rank, world_size=world)
        grid = torch.arange(world).reshape(*(sizes[a] for a in AXES))
        where = (grid == rank).nonzero()[0].tolist()
        mesh.coords = dict(zip(AXES, where))
        for i, axis in enumerate(AXES):
            # every group along this axis, created on every rank in the same order
            moved = grid.movedim(i, -1).reshape(-1, sizes[axis])
            for ranks in moved.tolist():
                group = dist.new_group(ranks) if world > 1 and sizes[axis] > 1 else None
                if rank in ranks:
                    mesh.groups[axis] = group
                    mesh.group_ranks[axis] = ranks
        return mesh

    def size(self, axis: str) -> int:
        return len(self.group_ranks.get(axis, [self.rank]))

    def group(self, axis: str):
        return self.groups.get(axis)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def __repr__(self) -> str:
        c = ", ".join(f"{a}={self.coords.get(a, 0)}/{self.size(a)}" for a in AXES)
        return f"Mesh(rank {self.rank} of {self.world_size}: {c})"
