"""The q x q tensor grid shared by the 2D (:mod:`.d2`) and 2.5D (:mod:`.d2p5`) modes.

- :class:`Grid`: the groups of one rank's grid: ``row`` (the mesh's ``tp_row``,
  q ranks with the same i, indexed by j), ``col`` (``tp_col``, same j, indexed
  by i) and ``dep`` (``tp_dep``, same (i, j), indexed by the depth k; ``None``
  in 2D), plus ``plane`` (the q^2 ranks with the same k, over which a split
  parameter's shards lie: the mesh's ``tp`` group in 2D).
- :class:`_GridSharded`: d1's full-tensor machinery generalised to parameters
  cut along *several* dims, each over one grid axis or over both (j outer, i
  inner: q^2 pieces), with packed segments and vocabulary padding.
- :func:`split_input` / :func:`gather_output`: the batch split of model inputs
  (batch block ``k q + i`` on rank (k, i, j)) and its inverse.
- :func:`batch_mean`, :func:`cross_entropy`: means over the whole batch of
  per-block sums (a loss on batch-split rows).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.tensor.d1 import _copy_params, _Sharded

__all__ = ["Grid", "split_input", "gather_output", "batch_mean", "cross_entropy"]


class Grid:
    """Groups and coordinates of this rank on a (d x) q x q tensor grid; a 1 x 1 grid by default.

    Sizes and coordinates come from the mesh's layout (so a layout-only mesh
    still gives sharded shapes); collectives go to the groups, ``None`` being a
    no-op. Deep copies of a model share the grid (groups cannot be copied).
    """

    def __init__(self, row=None, col=None, dep=None, plane=None, *, q: Optional[int] = None,
                 i: Optional[int] = None, j: Optional[int] = None, d: Optional[int] = None,
                 k: Optional[int] = None) -> None:
        self.row, self.col, self.dep, self.plane = row, col, dep, plane
        self.q = comm.group_size(row) if q is None else q
        self.j = comm.group_rank(row) if j is None else j
        self.i = comm.group_rank(col) if i is None else i
        self.d = comm.group_size(dep) if d is None else d
        self.k = comm.group_rank(dep) if k is None else k
        if q is None and comm.group_size(col) != self.q:
            raise ValueError(f"row and column groups differ in size ({self.q} vs {comm.group_size(col)})")

    @classmethod
    def from_mesh(cls, mesh) -> "Grid":
        """The grid of a 2D or 2.5D mesh (depth only for ``tp_mode="2.5d"``); cached on the mesh."""
        cached = mesh.__dict__.get("_cuboid_grid")
        if cached is not None:
            return cached
        plan = mesh.plan
        if mesh.size("tp") > 1 and plan.tp_mode not in ("2d", "2.5d"):
            raise ValueError(f"the 2D/2.5D layers need tp_mode 2d or 2.5d, not {plan.tp_mode}")
        deep = plan.tp_mode == "2.5d" and mesh.size("tp_dep") > 1
        plane = _plane_group(mesh) if deep else mesh.group("tp")
        grid = cls(mesh.group("tp_row"), mesh.group("tp_col"), mesh.group("tp_dep") if deep else None, plane,
                   q=mesh.size("tp_row"), j=mesh.coords.get("tp_row", 0), i=mesh.coords.get("tp_col", 0),
                   d=mesh.size("tp_dep") if deep else 1, k=mesh.coords.get("tp_dep", 0) if deep else 0)
        mesh.__dict__["_cuboid_grid"] = grid
        return grid

    @classmethod
    def of(cls, mesh_or_grid) -> "Grid":
        if mesh_or_grid is None:
            return cls()
        return mesh_or_grid if isinstance(mesh_or_grid, Grid) else cls.from_mesh(mesh_or_grid)

    @property
    def batch_parts(self) -> int:
        """Blocks the batch is split into (d q)."""
        return self.d * self.q

    @property
    def batch_index(self) -> int:
        """This rank's batch block, k q + i."""
        return self.k * self.q + self.i

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"Grid(d={self.d}, q={self.q}; k={self.k}, i={self.i}, j={self.j})"


def _plane_group(mesh):
    """The q^2 ranks sharing this rank's depth k (2.5D): made here while the mesh does not own one.

    Every rank must reach this point in the same order (``Grid.from_mesh`` is
    first called by ``shard_2p5d`` on every rank); the groups of every plane of
    the world are created, in one fixed order, as ``dist.new_group`` requires.
    """
    if "tp_plane" in mesh.groups:
        return mesh.groups["tp_plane"]
    plan = mesh.plan
    d, q = plan.tp_grid[0], plan.tp_grid[1]
    grid = torch.arange(plan.world_size).reshape(plan.pp, plan.dp, plan.sp, d, q * q)
    create = dist.is_available() and dist.is_initialized() and q > 1
    mine = None
    for ranks in grid.reshape(-1, q * q).tolist():
        group = dist.new_group(ranks) if create else None
        if mesh.rank in ranks:
            mine = group
            comm.name_group(group, "tp_plane")
    return mine


# ---------------------------------------------------------------- parameters cut over the grid


@dataclass(frozen=True)
class _Cut:
    dim: int            # the cut dim of the full tensor
    full: int           # its full (unpadded) size
    axes: tuple         # grid axes cutting it, outer first: ("row",) by j, ("col",) by i, ("row", "col") by j q + i
    parts: int = 1      # packed segments along dim, each cut alike
    pad: int = 0        # pad ``full`` up to a multiple of this (vocab); 0: it must divide


class _GridSharded(_Sharded):
    """d1's full-tensor interface for parameters cut along several dims over the grid.

    ``_splits[name]`` is a tuple of :class:`_Cut` (one per cut dim). A split
    parameter is cut over both grid axes (its q^2 shards lie on the ``plane``)
    and replicated over depth; a name not in ``_splits`` is replicated over the
    whole grid. ``shard_slices`` is one tuple of slices, or a list of them (one
    per packed segment); padding rows are zero in the local tensor and absent
    from the full one.
    """

    _MODE = "2d"

    def _set_grid(self, mesh_or_grid) -> None:
        grid = Grid.of(mesh_or_grid)
        if self._MODE == "2d" and grid.d > 1:
            raise ValueError(f"{type(self).__name__} is a 2D layer; a grid of depth {grid.d} needs the 2.5D layers")
        self.grid = grid
        self._set_group(grid.plane)
        self.tp_size, self.tp_rank = grid.q * grid.q, grid.j * grid.q + grid.i
        self._local_shapes: dict = {}

    # ------------------------------------------------------------ cuts

    def _count(self, c: _Cut) -> int:
        return self.grid.q ** len(c.axes)

    def _index(self, c: _Cut, i: int, j: int) -> int:
        idx = 0
        for a in c.axes:
            idx = idx * self.grid.q + (j if a == "row" else i)
        return idx

    def _cut_len(self, name: str, c: _Cut) -> int:
        n = self._count(c)
        if c.pad:
            m = max(c.pad, n)
            return -(-c.full // m) * m // n
        if c.full % (c.parts * n):
            raise ValueError(f"{type(self).__name__}.{name}: dim {c.dim} of size {c.full} does not split into "
                             f"{c.parts} segment(s) over {n} ranks of the {self.grid.q} x {self.grid.q} grid")
        return c.full // c.parts // n

    def _add_cuts(self, name: str, full_shape, *cuts: _Cut) -> tuple:
        """Register ``name`` (full shape, cuts); returns its local shape."""
        shape = list(full_shape)
        cuts = tuple(replace(c, dim=c.dim % len(full_shape)) for c in cuts)
        for c in cuts:
            shape[c.dim] = self._cut_len(name, c) * c.parts
        self._splits[name] = cuts
        self._full_shapes[name] = torch.Size(full_shape)
        self._local_shapes[name] = tuple(shape)
        return tuple(shape)

    def _blocks(self, name: str, i: int, j: int) -> list:
        """[(full slices, local slices)] of the pieces rank (i, j) holds, real rows only."""
        full_shape = self.full_shape(name)
        per_cut = []
        for c in self._splits[name]:
            n, idx = self._cut_len(name, c), self._index(c, i, j)
            if c.pad:
                a, b = min(idx * n, c.full), min((idx + 1) * n, c.full)
                per_cut.append([(c.dim, a, b, 0)])
            else:
                seg = c.full // c.parts
                per_cut.append([(c.dim, g * seg + idx * n, g * seg + (idx + 1) * n, g * n) for g in range(c.parts)])
        out = []
        for combo in itertools.product(*per_cut):
            fsl = [slice(0, s) for s in full_shape]
            lsl = [slice(0, s) for s in full_shape]
            for dim, a, b, at in combo:
                fsl[dim], lsl[dim] = slice(a, b), slice(at, at + b - a)
            out.append((tuple(fsl), tuple(lsl)))
        return out

    # ------------------------------------------------------------ ShardedModule

    def shard_slices(self, name: str) -> Union[tuple, list]:
        if name not in self._splits:
            return super(_Sharded, self).shard_slices(name)
        out = [f for f, _ in self._blocks(name, self.grid.i, self.grid.j)]
        return out[0] if len(out) == 1 else out

    def local_part(self, name: str, full: Any) -> torch.Tensor:
        """This rank's local tensor (packed, zero-padded) from a full tensor or a safetensors slice."""
        if name not in self._splits:
            return torch.as_tensor(full[tuple(slice(0, n) for n in self.full_shape(name))])
        pieces = [(lsl, torch.as_tensor(full[fsl])) for fsl, lsl in self._blocks(name, self.grid.i, self.grid.j)
                  if all(s.stop > s.start for s in fsl)]
        is_t = isinstance(full, torch.Tensor)
        dtype = pieces[0][1].dtype if pieces else (full.dtype if is_t else torch.float32)
        device = pieces[0][1].device if pieces else (full.device if is_t else None)
        out = torch.zeros(self._local_shapes[name], dtype=dtype, device=device)
        for lsl, piece in pieces:
            out[lsl] = piece
        return out

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one shaped like parameter ``name`` (a collective over the plane)."""
        if name not in self._splits:
            return local.detach()
        by_i = torch.stack(comm.all_gather_list(local.detach(), self.grid.col))  # (q, *local)
        by_ji = comm.all_gather_list(by_i, self.grid.row)                            # q x (q, *local)
        full = torch.zeros(self.full_shape(name), dtype=local.dtype, device=local.device)
        for j, rows in enumerate(by_ji):
            for i in range(rows.shape[0]):
                for fsl, lsl in self._blocks(name, i, j):
                    full[fsl] = rows[i][lsl]
        return full

    def norm_placement(self, name: str) -> Optional[L.Placement]:
        """Split parameters: their q^2 shards lie on the grid's plane (replicated over depth)."""
        return L.Placement(self.grid.plane) if name in self._splits and self.grid.q > 1 else None

    # ------------------------------------------------------------ forward helpers

    def _dep(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Enter the depth replicas: backward sums the parameter's gradient over ``dep``."""
        return None if t is None else comm.copy_to(t, self.grid.dep)

    def _vec(self, t: Optional[torch.Tensor], parts: int = 1) -> Optional[torch.Tensor]:
        """A parameter cut on its last dim by (j, i) -> its j-block (gathered over ``col``), segments in order."""
        if t is None:
            return None
        t = comm.all_gather_to(self._dep(t), self.grid.col, -1)
        q = self.grid.q
        if parts > 1 and q > 1:  # [i][segment] -> [segment][i]
            t = t.unflatten(-1, (q, parts, -1)).transpose(-3, -2).flatten(-3)
        return t


def copy_from_full(cls, module: nn.Module, mesh_or_grid, *args, **kwargs):
    """``cls`` built like ``module`` on ``mesh_or_grid`` (on meta, then allocated where module lives) and filled."""
    w = module.weight
    new = cls(*args, grid=Grid.of(mesh_or_grid), device="meta", dtype=w.dtype, **kwargs)
    return _copy_params(new.to_empty(device=w.device) if w.device.type != "meta" else new, module)


# ---------------------------------------------------------------- batch split


def split_input(x: torch.Tensor, mesh_or_grid, dim: int = 0, hidden: bool = False) -> torch.Tensor:
    """This rank's batch block ``k q + i`` of a model input (ids, masks, labels, pixels) along ``dim``.

    ``hidden=True`` also keeps hidden block j of the last dim (a full
    activation to the 2D layout). Differentiable (backward all-gathers).
    """
    g = Grid.of(mesh_or_grid)
    x = comm.scatter_to(comm.scatter_to(x, g.dep, dim), g.col, dim)
    return comm.scatter_to(x, g.row, -1) if hidden else x


def gather_output(x: torch.Tensor, mesh_or_grid, dim: int = 0, hidden: bool = False) -> torch.Tensor:
    """The inverse of :func:`split_input`: the whole batch (and hidden dim with ``hidden=True``) on every rank."""
    g = Grid.of(mesh_or_grid)
    if hidden:
        x = comm.gather_from(x, g.row, -1)
    return comm.gather_from(comm.gather_from(x, g.col, dim), g.dep, dim)


def batch_mean(total: torch.Tensor, count: torch.Tensor, mesh_or_grid) -> torch.Tensor:
    """``sum(total) / sum(count)`` over the batch blocks (``col`` then ``dep``); grads flow to ``total``.

    One all-reduce of 2 fp32 values per batch group: ``2 (q-1)/q * 8`` bytes
    over ``tp_col`` and ``2 (d-1)/d * 8`` over ``tp_dep``.
    """
    g = Grid.of(mesh_or_grid)
    s = torch.stack([total.float(), count.to(torch.float32)])
    s = comm.reduce_from(comm.reduce_from(s, g.col), g.dep)
    return s[0] / s[1]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mesh_or_grid, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the *whole* batch of batch-split (.., C) logits (a :class:`Head2D` output).

    NaN when every label of the batch is ignored, as ``F.cross_entropy``.
    """
    c = logits.shape[-1]
    labels = labels.reshape(-1).to(torch.long)
    total = F.cross_entropy(logits.reshape(-1, c).float(), labels, ignore_index=ignore_index, reduction="sum")
    return batch_mean(total, (labels != ignore_index).sum(), mesh_or_grid)
