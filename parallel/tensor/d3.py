"""3D tensor parallelism (Bian et al., arXiv 2105.14450; Colossal-AI's ``3d`` mode) on a q x q x q cube.

**Cube.** tp = q^3 ranks. Tensor rank ``t = k q^2 + i q + j`` sits at
k = ``coords["tp_dep"]``, i = ``coords["tp_col"]``, j = ``coords["tp_row"]``
(:class:`~cuboid.parallel.Mesh`); the group ``tp_dep`` varies k, ``tp_col``
varies i, ``tp_row`` varies j.

**Activation layouts.** An activation (B, .., C) is cut on its batch dim
(dim 0) into q^2 chunks over two cube axes (``tp_dep`` major) and on its
feature dim (last) into q blocks over the third, so every rank holds a
distinct 1/q^3 of it and nothing is replicated:

==========  ===================================  ====================  ==================
layout      where                                batch chunk (of q^2)  features block
==========  ===================================  ====================  ==================
``block``   embeddings, norms, residual stream,  k q + j               i (over ``tp_col``)
            input of a column / output of a row  (tp_dep, tp_row)
``inner``   output of a column, attention heads, k q + i               j (over ``tp_row``)
            MLP hidden, input of a row linear    (tp_dep, tp_col)
==========  ===================================  ====================  ==================

**Linear3D** ``y = x W^T + b``, W (O, K). Let the *in axis* be the axis of the
input's feature block and the *out axis* that of the output's: a column layer
has in = ``tp_col``, out = ``tp_row`` (block -> inner), a row layer in =
``tp_row``, out = ``tp_col`` (inner -> block). Rank (k, i, j) stores
W[out block c, in sub-block a q + k] of shape (O/q, K/q^2) (c, a its out- and
in-axis coordinates) and the bias block c (O/q), replicated over tp_dep and
the in axis. Forward: all-gather x's rows over the out-axis group (-> batch
block k, features a, (N/q, K/q)); all-gather W over ``tp_dep`` (-> W[c, a],
(O/q, K/q)); multiply; reduce-scatter the partial (N/q, O/q) over the in-axis
group on rows (-> batch chunk k q + a, features c); add the bias. Backward:
all-gather dy over the in axis; dx = reduce-scatter of dy W over the out axis;
dW = reduce-scatter of dy^T x over ``tp_dep``; db = all-reduce over ``tp_dep``
of the gathered dy's row sum. The output lands on the transposed pair, so a
column -> row pair (attention, MLP) goes block -> inner -> block and two
linears compose with nothing in between; ``packed=3`` (fused qkv) gives rank
(k, i, j) the j-th 1/q of each of W_q, W_k, W_v (stored [q_j; k_j; v_j]), i.e.
whole heads, and attention runs on its local heads and batch chunk.

**Communication** (exact bytes per layer: :class:`Costs`, in
:mod:`cuboid.parallel.comm`'s convention; per training step:
:func:`bytes_per_step`). A Linear3D gathers its input rows over the out axis
and its weight over ``tp_dep`` and reduce-scatters the product over the in
axis; backward gathers the output gradient over the in axis and
reduce-scatters dx over the out axis and dW over ``tp_dep`` (a bias adds one
all-reduce over ``tp_dep``): every term is ``(q-1)/q^3`` of a full tensor, so
the four linears of a block of width H, MLP 4H, move about
``2 (q-1)/q^3 * 16 N H b`` per step when N >> H (1D: ``8 (p-1)/p N H b``).
LayerNorm3D all-reduces two fp32 sums per row over ``tp_col`` each way and
its weight and bias gradients over ``tp_dep`` and ``tp_row``. The vocab table
(:class:`VocabEmbedding3D`) gathers a (Vp/q, H) block of itself over
``tp_dep`` and ``tp_row`` for the lookup and for the tied head; the lookup
reduce-scatters its (N/q^2, H) rows over ``tp_col``, the head all-gathers
``h``'s features over ``tp_col`` and multiplies locally, so no logits-sized
tensor ever moves: a step's traffic has no B T V term, only the table's
``Vp H / q`` and the loss's fp32 statistics over ``tp_col`` and (sum, count)
pair over ``tp_row`` and ``tp_dep``. Hidden-split tables and tensors move nothing forward and
all-reduce their gradients over the two axes they are replicated on. A ``head_norm`` (q/k
norms over each head's features, in the inner layout) is whole on every rank and
all-reduces its (D,) gradient over the cube (:class:`~.base.HeadNorm`). Under
bf16 autocast every matmul operand (inputs, weights) is gathered in bf16.

**Parameters.** Every layer is a thin user of :class:`~.base.Sharded`: its
parameters are cut along one or two dims, each over one or two cube axes
(:class:`~.base.Cut`), and replicated over the others; ``replicas(name)``
says how many tp ranks hold the same piece, and ``Placement(tp, replicas)``
tells norms to count each piece once.

**Padding.** A vocabulary V is padded to ``Vp = ceil(V / q^2) q^2`` rows; pad
rows are zero, never looked up, masked out of the loss (-inf), cut from
gathered logits and absent from ``full_tensor`` / checkpoints; their
gradients are exactly zero.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.head import mean_of
from cuboid.parallel.tensor import engine
from cuboid.parallel.tensor.base import Axes, Cut, HeadNorm, Sharded, VocabParallel, check_ids, rms_offset, to_compute
from cuboid.parallel.tensor.engine import (ANY, Mode, Style, hidden_last, no_row_sibling, parallelize_module, rms,
                                           step_bytes, takes_hidden)

__all__ = ["Linear3D", "LayerNorm3D", "VocabEmbedding3D", "VocabTensor3D", "Embedding3D", "LearnedTensor3D", "Head3D",
           "split_input", "gather_output", "shard_3d", "cube", "Costs", "bytes_per_step", "LAYOUTS", "STYLES", "MODE"]

AXES = ("tp_dep", "tp_col", "tp_row")
# layout -> (batch axes, major first; feature axis)
LAYOUTS = {"block": (("tp_dep", "tp_row"), "tp_col"), "inner": (("tp_dep", "tp_col"), "tp_row")}


def _layout(name: str) -> tuple:
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def cube(mesh) -> Axes:
    """The cube's :class:`~.base.Axes` of a 3D Mesh (shard group: ``tp``); Axes are returned as they are."""
    if isinstance(mesh, Axes):
        return mesh
    q = mesh.size("tp_row")
    if q ** 3 != mesh.size("tp") or not all(mesh.size(a) == q for a in AXES):
        raise ValueError(f"3D layers need a q x q x q tensor mesh (tp_mode 3d), got tp={mesh.size('tp')} "
                         f"with grid {[mesh.size(a) for a in AXES]}")
    return Axes.of_mesh(mesh, AXES, shard_group=mesh.group("tp"))


class Sharded3D(Sharded):
    """A 3D layer: built on ``mesh=`` (a 3D Mesh or its :func:`cube`)."""

    _where = "mesh"

    def _set_mesh(self, mesh) -> None:
        self._setup(cube(mesh))

    @property
    def q(self) -> int:
        return self.axes.size("tp_row")

    @property
    def coord(self) -> dict:
        return self.axes.coords()

    def _g(self, axis: str):
        return self.axes.group(axis)

    def _rep(self, t: Optional[torch.Tensor], *axes: str) -> Optional[torch.Tensor]:
        """``t`` replicated over ``axes``: identity forward, gradient summed over those groups."""
        for a in axes:
            t = comm.copy_to(t, self._g(a)) if t is not None else None
        return t


# ---------------------------------------------------------------- linear


class _Linear3DFn(torch.autograd.Function):
    """The 3D matmul of :class:`Linear3D` (layout and traffic in the module docstring).

    Under autocast the product runs in the autocast dtype; backward computes in
    the gradient's dtype and returns each gradient in its input's dtype.
    """

    @staticmethod
    def forward(ctx, x, w, b, g_in, g_out, g_dep):
        xg = comm.gather_from(x, g_out, 0)                          # (N/q, .., K/q): batch block k
        wg = comm.gather_from(w, g_dep, 1)                          # (O/q, K/q)
        y = comm.reduce_scatter_to(F.linear(xg, wg), g_in, 0)       # (N/q^2, .., O/q)
        if b is not None:
            y = y + b.to(y.dtype)
        ctx.save_for_backward(xg, wg)
        ctx.groups, ctx.dtypes = (g_in, g_out, g_dep), (x.dtype, w.dtype, b.dtype if b is not None else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xg, wg = (t.to(dy.dtype) for t in ctx.saved_tensors)
        (g_in, g_out, g_dep), (tx, tw, tb) = ctx.groups, ctx.dtypes
        dyg = comm.gather_from(dy.contiguous(), g_in, 0)            # (N/q, .., O/q)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = comm.reduce_scatter_to(dyg @ wg, g_out, 0).to(tx)  # (N/q^2, .., K/q)
        rows = dyg.reshape(-1, dyg.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = comm.reduce_scatter_to(rows.t() @ xg.reshape(-1, xg.shape[-1]), g_dep, 1).to(tw)  # (O/q, K/q^2)
        if tb is not None and ctx.needs_input_grad[2]:
            db = comm.all_reduce_(rows.sum(0), g_dep).to(tb)
        return dx, dw, db, None, None, None


class Linear3D(Sharded3D, L.Linear):
    """3D linear: ``role="column"`` maps the block layout to inner, ``"row"`` inner to block.

    ``role="column_qkv"`` is a column layer with ``packed=3`` (fused qkv). The
    weight (O, K) is stored as (O/q, K/q^2) per rank, the bias as (O/q).
    """

    role = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh, role: str = "column",
                 packed: Optional[int] = None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        if role not in ("column", "column_qkv", "row"):
            raise ValueError(f"Linear3D role must be column, column_qkv or row, got {role!r}")
        self._set_mesh(mesh)
        self.role, self.in_features, self.out_features = role, in_features, out_features
        self.packed = packed or (3 if role == "column_qkv" else 1)
        self.in_axis, self.out_axis = ("tp_row", "tp_col") if role == "row" else ("tp_col", "tp_row")
        w = self._cut("weight", (out_features, in_features), Cut(0, (self.out_axis,), self.packed),
                      Cut(1, (self.in_axis, "tp_dep")))
        b = self._cut("bias", (out_features,), Cut(0, (self.out_axis,), self.packed)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear3DFn.apply(to_compute(x), to_compute(self.weight), self.bias, self._g(self.in_axis),
                                 self._g(self.out_axis), self._g("tp_dep"))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"role={self.role}, packed={self.packed}, q={self.q}")


# ---------------------------------------------------------------- norm


class LayerNorm3D(Sharded3D, L.LayerNorm):
    """Layer norm over a hidden dim split over ``tp_col`` (block layout), residual add fused.

    ``forward(x)`` -> ``norm(x)``; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``.
    Statistics are fp32 sums all-reduced over ``tp_col``; weight and bias (H/q
    each) are replicated over ``tp_dep`` and ``tp_row``. ``rms=True``: the RMS
    norm (no mean, no bias); ``offset``: the output scales by ``offset + weight``
    (Gemma's norms: 1; :func:`~.base.rms_offset`).
    """

    role = "norm"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, mesh, rms: bool = False,
                 offset: float = 0.0, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.dim, self.eps, self.rms, self.offset = dim, eps, rms, offset
        w = self._cut("weight", (dim,), Cut(0, ("tp_col",)))
        b = self._cut("bias", (dim,), Cut(0, ("tp_col",))) if bias else None
        self._init_params({"weight": (w, "ones"), "bias": (b, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        h = x if residual is None else x + residual
        col = self._g("tp_col")
        h32 = h.float()
        stats = torch.stack([h32.sum(-1), (h32 * h32).sum(-1)], -1)     # (.., 2) local sums
        stats = comm.copy_to(comm.reduce_from(stats, col), col) / self.dim  # all-reduce both ways
        mean, sq = stats[..., :1], stats[..., 1:]
        if self.rms:  # RMS norm (Llama): no centring
            mean = torch.zeros_like(mean)
        y = (h32 - mean) * torch.rsqrt((sq - mean * mean).clamp_min(0.0) + self.eps)
        params = torch.stack([self.weight] + ([self.bias] if self.bias is not None else []))
        params = self._rep(params, "tp_dep", "tp_row").float()
        y = y * (params[0] + self.offset if self.offset else params[0]) + (params[1] if self.bias is not None else 0.0)
        y = y.to(x.dtype)
        return y if residual is None else (y, h)

    def extra_repr(self) -> str:
        return f"{self.dim} (local {self.weight.shape[0]}), eps={self.eps}, offset={self.offset}, q={self.q}"


# ---------------------------------------------------------------- vocabulary


class VocabEmbedding3D(VocabParallel, Sharded3D, L.Embedding):
    """Token table (V, H), also the tied LM head: rank (k, i, j) holds vocab chunk i q + k, features j.

    Both uses gather the same (Vp/q, H) table: vocab block i (over ``tp_dep``)
    with all features (over ``tp_row``). A lookup embeds this rank's
    block-layout ids (batch chunk k q + j) found in vocab block i and
    reduce-scatters the partial rows over ``tp_col`` on the features (-> block
    layout); the head gathers ``h``'s features over ``tp_col`` and multiplies
    locally, so the logits (batch chunk k q + j, vocab block i) are never summed
    or moved, and the loss is vocab-parallel over ``tp_col``.
    """

    role = "vocab"

    def __init__(self, num_embeddings: int, dim: int, *, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.num_embeddings, self.dim = num_embeddings, dim
        q = self.q
        w = self._cut("weight", (num_embeddings, dim), Cut(0, ("tp_col", "tp_dep"), pad=q * q), Cut(1, ("tp_row",)))
        self._set_vocab(w[0] * q, self.coord["tp_col"] * w[0] * q)  # the tp_dep-gathered block i
        self._init_params({"weight": (w, "normal")}, device, dtype)

    def _table(self, matmul: bool = False) -> torch.Tensor:
        w = comm.all_gather_to(to_compute(self.weight) if matmul else self.weight, self._g("tp_dep"), 0)
        return comm.all_gather_to(w, self._g("tp_row"), 1)  # (Vp/q, H): vocab block i, all features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._lookup(ids, self._table())               # (N/q^2, .., H) partial over vocab blocks i
        return comm.reduce_scatter_to(out, self._g("tp_col"), -1)  # (N/q^2, .., H/q): block layout

    # The tied head (``lm_outputs`` / ``lm_logits`` / ``lm_loss``) for ``h`` in the block layout: local
    # (N/q^2, .., Vp/q) logits, batch chunk k q + j (the block layout's rows) and vocab block i (``bias``: a
    # VocabTensor3D's output), gathered to the full (B, .., V) logits only when read. The loss's statistics
    # go over ``tp_col``, then the (sum, count) over the batch chunks (``tp_row``, ``tp_dep``); the fused loss
    # takes the same operands, so it composes as the unfused one.

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        return comm.all_gather_to(to_compute(h), self._g("tp_col"), -1)  # (N/q^2, .., H)

    def _head_weight(self) -> torch.Tensor:
        return self._table(matmul=True)  # (Vp/q, H): vocab block i, all features

    def _head_group(self):
        return self._g("tp_col")

    def _head_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        stats = torch.stack([total, count.to(total.dtype)])
        stats = comm.reduce_from(comm.reduce_from(stats, self._g("tp_row")), self._g("tp_dep"))
        return mean_of(stats[0], stats[1])  # every rank the same loss (NaN if every label is ignored)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (B, .., V) logits on every rank from the local ones, padding cut."""
        full = comm.gather_from(logits, self._g("tp_col"), -1)[..., :self.num_embeddings]
        return gather_output(full, self.axes, 0)



class LearnedTensor3D(Sharded3D, L.LearnedTensor):
    """A free-standing hidden-last tensor (ViT's CLS token, position table): last dim cut over ``tp_col``."""

    role = "replicate"
    _vocab = False  # the vocabulary variant pads its last dim to a multiple of q^2

    def __init__(self, *shape: int, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        w = self._cut("weight", tuple(shape), Cut(-1, ("tp_col",), pad=self.q ** 2 if self._vocab else 1))
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    def forward(self) -> torch.Tensor:
        return self._rep(self.weight, "tp_dep", "tp_row")


class VocabTensor3D(LearnedTensor3D):
    """A learned vocab-last tensor (BERT's MLM bias) cut like the head's logits: block i of Vp/q over ``tp_col``."""

    role = "vocab"
    _vocab = True


# ---------------------------------------------------------------- hidden-split tables


class Embedding3D(Sharded3D, L.Embedding):
    """Position / type table (P, H) with features cut over ``tp_col``, replicated over tp_dep x tp_row.

    Ids may be in the block layout (B/q^2, T) or broadcast (1, T); the output is (.., H/q).
    """

    role = "embedding"

    def __init__(self, num_embeddings: int, dim: int, *, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._cut("weight", (num_embeddings, dim), Cut(1, ("tp_col",)))
        self._init_params({"weight": (w, "normal")}, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings)
        return F.embedding(ids, self._rep(self.weight, "tp_dep", "tp_row"))


class Head3D(Sharded3D, L.Linear):
    """The small linears at a model's edges, on batch-split (block layout) rows.

    - ``in_layout="hidden", out_layout="replicated"`` (classifier): input
      (.., K/q) block layout -> full (B, .., C) on every rank. W (C, K) is cut
      on K over ``tp_col``; bias whole. Backward moves nothing.
    - ``in_layout="hidden", out_layout="hidden"`` (pooler, MLM transform):
      block layout in and out; the input's features are all-gathered over
      ``tp_col`` and W (O, K) is cut on O over ``tp_col``.
    - ``in_layout="full", out_layout="hidden"`` (ViT patch embedding): input
      rows batch-split like the block layout but with all K features.
    """

    role = "replicate"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, mesh, in_layout: str = "hidden",
                 out_layout: str = "replicated", device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        if (in_layout, out_layout) not in (("hidden", "replicated"), ("hidden", "hidden"), ("full", "hidden")):
            raise ValueError(f"Head3D maps hidden->replicated, hidden->hidden or full->hidden, "
                             f"not {in_layout}->{out_layout}")
        self.in_features, self.out_features = in_features, out_features
        self.in_layout, self.out_layout = in_layout, out_layout
        shape = (out_features, in_features)
        if out_layout == "replicated":
            w, b = self._cut("weight", shape, Cut(1, ("tp_col",))), ((out_features,) if bias else None)
        else:
            w = self._cut("weight", shape, Cut(0, ("tp_col",)))
            b = self._cut("bias", (out_features,), Cut(0, ("tp_col",))) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        col, x = self._g("tp_col"), to_compute(x)
        if self.out_layout == "replicated":
            xg = gather_output(x, self.axes, 0)                         # (B, .., K/q)
            y = comm.reduce_from(F.linear(xg, self.weight), col)        # (B, .., C)
            return y + self.bias if self.bias is not None else y
        x = comm.all_gather_to(x, col, -1) if self.in_layout == "hidden" else comm.copy_to(x, col)  # (.., K)
        return F.linear(x, self._rep(self.weight, "tp_dep", "tp_row"), self._rep(self.bias, "tp_dep", "tp_row"))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"{self.in_layout}->{self.out_layout}, q={self.q}")


# ---------------------------------------------------------------- inputs and outputs


def split_input(x: torch.Tensor, mesh, dim: int = 0, *, layout: str = "block", hidden: bool = False) -> torch.Tensor:
    """This rank's batch chunk of a replicated model input along ``dim`` (block layout by default).

    ``hidden=True`` also keeps this rank's block of the last (feature) dim, giving
    a full 3D activation. Backward all-gathers. ``x.shape[dim]`` must divide by q^2.
    """
    batch, feat = _layout(layout)
    for a in batch:
        x = comm.scatter_to(x, mesh.group(a), dim)
    return comm.scatter_to(x, mesh.group(feat), -1) if hidden else x


def gather_output(y: torch.Tensor, mesh, dim: int = 0, *, layout: str = "block", hidden: bool = False) -> torch.Tensor:
    """The replicated full tensor of a batch-split ``y`` (feature-split too with ``hidden``); undoes split_input."""
    batch, feat = _layout(layout)
    if hidden:
        y = comm.gather_from(y, mesh.group(feat), -1)
    for a in reversed(batch):
        y = comm.gather_from(y, mesh.group(a), dim)
    return y


# ---------------------------------------------------------------- traffic


class Costs(engine.Costs):
    """(forward, backward) bytes per rank of each 3D layer, for ``n`` rows (B T) counted whole.

    A gather or reduce-scatter of a full tensor's 1/q^2 pieces over one axis
    sends ``e = (q-1)/q^3`` of it; an all-reduce of a 1/q piece ``2 s``, with
    ``s = (q-1)/q^2``. Matmul operands move ``c`` bytes, parameters ``b``,
    ids and labels 8, statistics fp32.
    """

    def __init__(self, q: int, dtype: torch.dtype = torch.float32, autocast: Optional[torch.dtype] = None) -> None:
        super().__init__(dtype, autocast)
        self.q, self.e, self.s = q, (q - 1) / q ** 3, (q - 1) / q ** 2

    @classmethod
    def of(cls, plan, dtype=torch.float32, autocast=None) -> "Costs":
        return cls(plan.tp_grid[-1], dtype, autocast)

    def _padded(self, v: int) -> int:
        return -(-v // self.q ** 2) * self.q ** 2

    def linear(self, role: str, k: int, o: int, n: int, *, bias: bool = True, dx: bool = True) -> tuple:
        """x over the out axis, W over tp_dep, the product reduce-scattered; backward the mirror (+ db)."""
        fwd = self.e * self.c * (n * k + k * o + n * o)
        bwd = self.e * self.c * (n * o + k * o + (n * k if dx else 0)) + (2 * self.s * o * self.c if bias else 0.0)
        return fwd, bwd

    def norm(self, h: int, n: int, bias: bool = True) -> tuple:
        stats = 16 * self.e * n  # an fp32 (N/q^2, 2) all-reduce over tp_col
        return stats, stats + 4 * (1 + bias) * self.s * h * self.b

    def _table(self, v: int, h: int, nbytes: int) -> float:
        """The (Vp/q, H) table block gathered over tp_dep, then tp_row (or its gradient reduce-scattered)."""
        return (self.e + self.s) * self._padded(v) * h * nbytes

    def lookup(self, v: int, h: int, n: int) -> tuple:
        """The table block, then the partial rows reduce-scattered over tp_col (backward: the mirror)."""
        fwd = self._table(v, h, self.b) + self.e * n * h * self.b
        return fwd, fwd

    def lm_loss(self, v: int, h: int, n: int, labels: int, bias: bool = False) -> tuple:
        """The tied head (h's features over tp_col, the table block; the logits stay put) and the loss over
        ``labels`` rows (fp32 statistics over tp_col, a (sum, count) pair over tp_row and tp_dep)."""
        head = self._table(v, h, self.c) + self.e * n * h * self.c
        fwd = head + 24 * self.e * labels + 2 * 2 * (self.q - 1) / self.q * 8
        return fwd, head + (4 * self.s * self._padded(v) * self.b if bias else 0.0)

    def embedding(self, rows: int, h: int) -> tuple:
        return self.tensor(rows * h)

    def tensor(self, m: int) -> tuple:
        """A hidden-last parameter of ``m`` elements: its gradient all-reduced over the two other axes."""
        return 0.0, 4 * self.s * m * self.b

    def head(self, k: int, o: int, n: int, in_layout: str = "hidden", out_layout: str = "replicated", *,
             bias: bool = True, dx: bool = True) -> tuple:
        c = self.c
        if out_layout == "replicated":  # rows gathered over tp_row and tp_dep, partial logits over tp_col
            return (self.e + self.s) * n * k * c + 2 * (self.q - 1) / self.q * n * o * c, 0.0
        weights = 4 * self.s * (o * k + (o if bias else 0)) * self.b
        if in_layout == "hidden":
            return self.e * n * k * c, self.e * n * k * c + weights
        return 0.0, (2 * self.e * n * k * c if dx else 0.0) + weights


def bytes_per_step(config, plan, batch: int, seq: int, *, dtype=torch.float32, autocast=None) -> float:
    """Bytes one rank sends in a GPT-shaped training step under 3D (:func:`.engine.step_bytes`)."""
    return step_bytes(Costs.of(plan, dtype, autocast), config, batch, seq)


# ---------------------------------------------------------------- whole models


def _head_out(s) -> dict:
    return {"in_layout": "hidden", "out_layout": "hidden" if s.module.out_features == s.hidden else "replicated"}


STYLES = (
    # a column layer with no row sibling (ViT's patch projection) takes whole features to the block layout
    Style(("column",), L.Linear, Head3D, lambda s: {"in_layout": "full", "out_layout": "hidden"}, no_row_sibling),
    Style(("column", "column_qkv", "row"), L.Linear, Linear3D, lambda s: {"role": s.role}),
    Style(("column_kv",), L.Linear, Linear3D, lambda s: {"role": "column"}),
    Style(("vocab",), L.Embedding, VocabEmbedding3D),
    Style(("vocab",), L.LearnedTensor, VocabTensor3D),
    Style(("embedding",), L.Embedding, Embedding3D),
    Style(("norm",), L.LayerNorm, LayerNorm3D),
    Style(("norm",), ANY, LayerNorm3D, lambda s: {"rms": True, "offset": rms_offset(s.module)}, rms),
    Style(("head_norm",), ANY, HeadNorm, when=rms),  # whole, its gradient summed over the cube
    Style(("replicate",), L.Linear, Head3D, _head_out, takes_hidden),
    Style(("replicate",), L.LearnedTensor, LearnedTensor3D, when=hidden_last),
    Style(("replicate",), ANY, None),  # other replicated layers stay whole
)
MODE = Mode("3D", STYLES, cube, Costs.of)


def shard_3d(model, spec, mesh):
    """Replace the layers named by ``spec`` with their 3D counterparts (:data:`STYLES`), in place.

    ``column`` / ``column_qkv`` / ``row`` -> :class:`Linear3D` (a column layer
    with no ``row`` sibling, as ViT's patch embedding, -> :class:`Head3D` full
    -> hidden); ``vocab`` -> :class:`VocabEmbedding3D` / :class:`VocabTensor3D`;
    ``embedding`` -> :class:`Embedding3D`; ``norm`` -> :class:`LayerNorm3D`;
    ``replicate`` Linear taking the hidden -> :class:`Head3D` (hidden -> hidden
    when it also returns the hidden size, else hidden -> replicated);
    ``replicate`` LearnedTensor whose last dim is the hidden -> :class:`LearnedTensor3D`.
    Other ``replicate`` layers stay whole.
    """
    return parallelize_module(model, spec, MODE, cube(mesh))
