"""The q x q tensor grid shared by the 2D (:mod:`.d2`) and 2.5D (:mod:`.d2p5`) modes.

- :class:`Grid`: the :class:`~.base.Axes` of one rank's grid: ``row`` (the
  mesh's ``tp_row``, q ranks with the same i, indexed by j), ``col``
  (``tp_col``, same j, indexed by i) and ``dep`` (``tp_dep``, same (i, j),
  indexed by the depth k; ``None`` in 2D), plus ``plane`` (the q^2 ranks with
  the same k, over which a split parameter's pieces lie: the mesh's ``tp``
  group in 2D), the ``shard_group`` of the grid's cuts, and ``tp`` (every
  rank of the grid, the plane and the depth: the ``tensor_group``; given by
  ``tp=``, the plane when the depth is 1).
- :class:`GridSharded`: the base of the 2D / 2.5D layers (a thin user of
  :class:`~.base.Sharded`) with the depth and vector-gather helpers.
- :func:`styles`: the role -> layer table both modes apply, over a mode's
  classes; :class:`Costs`: their per-layer traffic (2D is depth 1).
- :func:`split_input` / :func:`gather_output`: the batch split of model inputs
  (batch block ``k q + i`` on rank (k, i, j)) and its inverse.
- :func:`batch_mean`, :func:`cross_entropy`: means over the whole batch of
  per-block sums (a loss on batch-split rows).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.head import mean_of
from cuboid.parallel.tensor import engine
from cuboid.parallel.tensor.base import Axes, HeadNorm, Sharded, rms_offset, to_compute
from cuboid.parallel.tensor.engine import ANY, Style, no_row_sibling, rms, row_sibling, square

__all__ = ["Grid", "GridSharded", "split_input", "gather_output", "batch_mean", "cross_entropy", "styles", "Costs"]


class Grid(Axes):
    """Groups and coordinates of this rank on a (d x) q x q tensor grid; a 1 x 1 grid by default.

    Sizes and coordinates come from the mesh's layout (so a layout-only mesh
    still gives sharded shapes); collectives go to the groups, ``None`` being a
    no-op. Deep copies of a model share the grid (groups cannot be copied).
    """

    def __init__(self, row=None, col=None, dep=None, plane=None, *, q: Optional[int] = None,
                 i: Optional[int] = None, j: Optional[int] = None, d: Optional[int] = None,
                 k: Optional[int] = None, tp=None) -> None:
        self.row, self.col, self.dep, self.plane = row, col, dep, plane
        self.q = comm.group_size(row) if q is None else q
        self.j = comm.group_rank(row) if j is None else j
        self.i = comm.group_rank(col) if i is None else i
        self.d = comm.group_size(dep) if d is None else d
        self.k = comm.group_rank(dep) if k is None else k
        if q is None and comm.group_size(col) != self.q:
            raise ValueError(f"row and column groups differ in size ({self.q} vs {comm.group_size(col)})")
        # the plane's rank is i q + j: its pieces are numbered over (col, row)
        super().__init__({"tp_row": (row, self.q, self.j), "tp_col": (col, self.q, self.i),
                          "tp_dep": (dep, self.d, self.k)}, ("tp_col", "tp_row"), plane)
        self.tensor_group = tp if tp is not None or self.d > 1 else plane  # None: unknown (HeadNorm refuses)

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
                   d=mesh.size("tp_dep") if deep else 1, k=mesh.coords.get("tp_dep", 0) if deep else 0,
                   tp=mesh.group("tp"))
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
        group = comm.new_group(ranks, "tp_plane") if create else None
        if mesh.rank in ranks:
            mine = group
            comm.name_group(group, "tp_plane")
    return mine


# ---------------------------------------------------------------- layers on the grid


class GridSharded(Sharded):
    """Base of the 2D / 2.5D layers: built on ``grid=`` (a 2D / 2.5D Mesh or a :class:`Grid`).

    Split parameters are cut over both grid axes (their q^2 pieces lie on the
    ``plane``: ``Placement(plane)``) and replicated over depth; ``_MODE``
    ("2d" or "2.5d") refuses a grid of the wrong depth.
    """

    _where = "grid"
    _MODE = "2d"

    def _set_grid(self, mesh_or_grid) -> None:
        grid = Grid.of(mesh_or_grid)
        if self._MODE == "2d" and grid.d > 1:
            raise ValueError(f"{type(self).__name__} is a 2D layer; a grid of depth {grid.d} needs the 2.5D layers")
        self._setup(grid)

    @property
    def grid(self) -> "Grid":
        return self.axes

    def _dep(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Enter the depth replicas: backward sums the parameter's gradient over ``dep``."""
        return None if t is None else comm.copy_to(t, self.grid.dep)

    def _vec(self, t: Optional[torch.Tensor], parts: int = 1, matmul: bool = False) -> Optional[torch.Tensor]:
        """A parameter cut on its last dim by (j, i) -> its j-block (gathered over ``col``), segments in order.

        ``matmul``: bound for a matmul, so cast to the autocast dtype before the gather.
        """
        if t is None:
            return None
        t = self._dep(t)
        t = comm.all_gather_to(to_compute(t) if matmul else t, self.grid.col, -1)
        q = self.grid.q
        if parts > 1 and q > 1:  # [i][segment] -> [segment][i]
            t = t.unflatten(-1, (q, parts, -1)).transpose(-3, -2).flatten(-3)
        return t


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

    One all-reduce of 2 fp32 values over each batch group (:meth:`Costs.mean`).
    """
    g = Grid.of(mesh_or_grid)
    s = torch.stack([total.float(), count.to(torch.float32)])
    s = comm.reduce_from(comm.reduce_from(s, g.col), g.dep)
    return mean_of(s[0], s[1])


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mesh_or_grid, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the *whole* batch of batch-split (.., C) logits (a :class:`Head2D` output).

    NaN when every label of the batch is ignored, as ``F.cross_entropy``.
    """
    c = logits.shape[-1]
    labels = labels.reshape(-1).to(torch.long)
    total = F.cross_entropy(logits.reshape(-1, c).float(), labels, ignore_index=ignore_index, reduction="sum")
    return batch_mean(total, (labels != ignore_index).sum(), mesh_or_grid)


# ---------------------------------------------------------------- the table and the traffic


def styles(classes: dict) -> tuple:
    """The 2D / 2.5D role -> layer table over a mode's ``classes`` (:data:`.d2.CLASSES`, :data:`.d2p5.CLASSES`)."""
    return (
        Style(("column_qkv", "row"), L.Linear, classes["linear"], lambda s: {"packed": s.packed}),
        Style(("column", "column_kv"), L.Linear, classes["linear"], when=row_sibling),
        # a column layer taking a model input (ViT's patches): whole input features, replicated over the row
        Style(("column",), L.Linear, classes["linear"], lambda s: {"input_is_parallel": False}, no_row_sibling),
        Style(("vocab",), L.Embedding, classes["vocab"]),
        Style(("vocab",), L.LearnedTensor, classes["vocab_tensor"]),
        Style(("embedding",), L.Embedding, classes["embedding"]),
        Style(("norm",), L.LayerNorm, classes["norm"]),
        Style(("norm",), ANY, classes["norm"], lambda s: {"rms": True, "offset": rms_offset(s.module)}, rms),
        # whole on every rank, its gradient summed over the grid (batch blocks and heads)
        Style(("head_norm",), ANY, HeadNorm, when=rms),
        Style(("replicate",), L.Linear, classes["linear"], when=square),  # hidden -> hidden stays in the layout
        Style(("replicate",), L.Linear, classes["head"]),
        Style(("replicate",), L.LearnedTensor, classes["tensor"]),
    )


class Costs(engine.Costs):
    """(forward, backward) bytes per rank of each 2D / 2.5D layer, for ``n`` rows (B T) counted whole.

    ``a = (q - 1) / q``; ``r = n / (d q)`` local rows; ``e = 2 (d - 1) / d``
    (a gradient all-reduce over depth, in the parameter's dtype, of the local
    piece: ``/ q^2`` of the full parameter). Gathers of matmul operands move
    ``c`` bytes, the rest ``b``; statistics are fp32.
    """

    def __init__(self, q: int, d: int = 1, dtype: torch.dtype = torch.float32,
                 autocast: Optional[torch.dtype] = None) -> None:
        super().__init__(dtype, autocast)
        self.q, self.d, self.a, self.e = q, d, (q - 1) / q, 2 * (d - 1) / d

    @classmethod
    def of(cls, plan, dtype=torch.float32, autocast=None) -> "Costs":
        grid = plan.tp_grid
        return cls(grid[-1], grid[0] if len(grid) == 3 else 1, dtype, autocast)

    def _padded(self, v: int) -> int:
        return -(-v // self.q ** 2) * self.q ** 2

    def linear(self, role: str, k: int, o: int, n: int, *, bias: bool = True, dx: bool = True,
               input_is_parallel: bool = True, recompute: bool = False) -> tuple:
        """SUMMA: x over the row, W and b over the column; backward the reduce-scatters (+ depth)."""
        a, q, r = self.a, self.q, n / (self.d * self.q)
        w = a * self.c * (o * k / q + (o / q if bias else 0))
        x = a * self.c * r * k
        fwd = w + (x if input_is_parallel else 0.0)
        bwd = w + ((x if input_is_parallel else 2 * x) if dx else 0.0) + self.e * self.b * (o * k + o * bias) / q ** 2
        return fwd, bwd + (fwd if recompute else 0.0)

    def norm(self, h: int, n: int, bias: bool = True) -> tuple:
        """Two fp32 statistics all-reduced over the row each way; w (and b) gathered over the column."""
        stats, w = 2 * 2 * self.a * 4 * n / (self.d * self.q), (1 + bias) * h / self.q
        return stats + self.a * self.b * w, stats + self.a * self.b * w + self.e * self.b * w / self.q

    def lookup(self, v: int, h: int, n: int) -> tuple:
        """The table's vocab block gathered over the column, the partial rows reduce-scattered over the row."""
        vp, r = self._padded(v), n / (self.d * self.q)
        fwd = self.a * self.b * (vp * h / self.q + r * h)
        return fwd, fwd + self.e * self.b * vp * h / self.q ** 2

    def lm_loss(self, v: int, h: int, n: int, labels: int, bias: bool = False) -> tuple:
        """The tied head (a SUMMA product, bias gathered), cross-entropy statistics over the row, and the
        batch mean (an fp32 pair over the column and the depth)."""
        vp, a, q, r = self._padded(v), self.a, self.q, n / (self.d * self.q)
        head = a * self.c * (r * h + vp * h / q) + (a * self.b * vp / q if bias else 0.0)
        fwd = head + 2 * a * 12 * labels / (self.d * q) + self.mean()
        return fwd, head + self.e * self.b * (vp * h + (vp if bias else 0)) / q ** 2

    def mean(self) -> float:
        """:func:`batch_mean`: an fp32 (sum, count) pair all-reduced over the column, then the depth."""
        return 2 * self.a * 8 + self.e * 8

    def embedding(self, rows: int, h: int) -> tuple:
        return self.tensor(rows * h)

    def tensor(self, m: int) -> tuple:
        """A hidden-last parameter of ``m`` elements gathered over the column where it is used."""
        return self.a * self.b * m / self.q, self.a * self.b * m / self.q + self.e * self.b * m / self.q ** 2

    def head(self, h: int, c: int, n: int, *, bias: bool = True, input_is_parallel: bool = True,
             loss: bool = False) -> tuple:
        """Head2D (H -> C): W gathered over the column, the partial logits all-reduced over the row;
        backward the weight's reduce-scatter and the bias' all-reduces. ``loss``: with its batch mean."""
        a, q, r = self.a, self.q, n / (self.d * self.q)
        fwd = a * self.c * c * h / q + 2 * a * self.c * r * c + (self.mean() if loss else 0.0)
        bwd = a * self.c * c * h / q + self.e * self.b * c * h / q ** 2 + (0.0 if input_is_parallel else
                                                                            a * self.c * r * h)
        return fwd, bwd + ((2 * a + self.e) * self.b * c if bias else 0.0)
