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

**Communication** per rank in :mod:`cuboid.parallel.comm`'s convention, with N
the rows of the *full* activation (B T), b bytes per element (activations and
weights alike), q the cube side:

- Linear3D (K in, O out): forward ``(q-1)/q^3 * b * (N K + K O + N O)``;
  backward ``(q-1)/q^3 * b * (N O + K O + N K) + 2 (q-1)/q^2 * O b``
  (the ``N K`` term only when the input needs a gradient, the last term only
  with a bias). The four linears of a block of width H, MLP 4H, move
  ``2 (q-1)/q^3 * b * 16 N H`` per step when N >> H (1D: ``8 (p-1)/p * N H b``).
- LayerNorm3D (width H; fp32 statistics): forward ``16 (q-1) N / q^3``
  (an all-reduce over tp_col of (N/q^2, 2) fp32 sums); backward the same plus
  ``8 (q-1) H b / q^2`` (weight and bias grads all-reduced over tp_dep and
  tp_row; ``4 (q-1) H b / q^2`` without a bias).
- VocabEmbedding3D (Vp padded rows, int64 ids) lookup: forward
  ``(q-1)/q^3 * b * (Vp H + N H) + 8 (q-1) N / q^2``, backward
  ``(q-1)/q^3 * b * (N H + Vp H)``. ``lm_logits(gather=False)`` costs a
  column Linear3D with K = H, O = Vp, no bias; ``lm_loss`` adds the labels'
  gather ``8 (q-1) N / q^2``, the vocab-parallel statistics over tp_row
  ``24 (q-1) N / q^3`` and two all-reduces of an fp32 (sum, count) pair
  ``2 * 2 (q-1)/q * 8``; a bias adds ``4 (q-1) Vp b / q^2`` backward.
- Embedding3D (P x H) and Tensor3D (M elements, hidden-last): forward 0,
  backward ``4 (q-1) P H b / q^2`` (``4 (q-1) M b / q^2``).
- Head3D ``hidden -> replicated`` (C outputs): forward
  ``(q-1) N K b / q^3 + (q-1) N K b / q^2 + 2 (q-1)/q * N C b``, backward 0;
  ``hidden -> hidden``: forward ``(q-1) N K b / q^3``, backward the same plus
  ``4 (q-1) (O K + O) b / q^2``; ``full -> hidden``: forward 0, backward
  ``4 (q-1) (O K + O) b / q^2`` (+ ``2 (q-1) N K b / q^3`` for an input grad).

**Parameters.** Every layer keeps the single-device full-tensor interface
(``full_shape``, ``shard_slices`` — a list for packed qkv —, ``local_part``,
``load_full``, ``full_tensor``, ``full_tensor_like``), generalising
:class:`~cuboid.parallel.tensor.d1._Sharded` to cuts along one or two dims,
each over one or two cube axes. Gradients of replicated copies come out whole
and equal on every copy. ``replicas(name)`` says how many tp ranks hold the
same shard (for norms: :func:`grad_norm_reducer`).

**Padding.** A vocabulary V is padded to ``Vp = ceil(V / q^2) q^2`` rows; pad
rows are zero, never looked up, masked out of the loss (-inf), cut from
gathered logits and absent from ``full_tensor`` / checkpoints; their
gradients are exactly zero.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.tensor.d1 import _copy_params, _Group, _has_row_sibling, _Sharded, _VocabParallelCE

__all__ = ["Linear3D", "LayerNorm3D", "VocabEmbedding3D", "VocabTensor3D", "Embedding3D", "Tensor3D", "Head3D",
           "split_input", "gather_output", "shard_3d", "grad_norm_reducer", "LAYOUTS"]

AXES = ("tp_dep", "tp_col", "tp_row")
# layout -> (batch axes, major first; feature axis)
LAYOUTS = {"block": (("tp_dep", "tp_row"), "tp_col"), "inner": (("tp_dep", "tp_col"), "tp_row")}


@dataclass(frozen=True)
class _Cut:
    dim: int           # the cut dim of the full tensor
    full: int          # its real (unpadded) size
    axes: tuple        # cube axes whose coordinates index the block, major first
    parts: int = 1     # packed segments, each cut alike
    pad_to: int = 1    # pad ``full`` up to a multiple of this (vocab)


def _layout(name: str) -> tuple:
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


class _Sharded3D(_Sharded):
    """The full-tensor interface for parameters cut over the cube's axes (replicated over the others)."""

    _splits: dict  # name -> tuple of _Cut; names not in it are whole on every rank

    def _set_mesh(self, mesh) -> None:
        self._set_group(mesh.group("tp"))
        self._cube = _Group(mesh)
        self.q = mesh.size("tp_row")
        if self.q ** 3 != mesh.size("tp") or not all(mesh.size(a) == self.q for a in AXES):
            raise ValueError(f"3D layers need a q x q x q tensor mesh (tp_mode 3d), got tp={mesh.size('tp')} "
                             f"with grid {[mesh.size(a) for a in AXES]}")
        self.coord = {a: mesh.coords.get(a, 0) for a in AXES}

    def _g(self, axis: str):
        return self._cube.group.group(axis)

    def _rep(self, t: Optional[torch.Tensor], *axes: str) -> Optional[torch.Tensor]:
        """``t`` replicated over ``axes``: identity forward, gradient summed over those groups."""
        for a in axes:
            t = comm.copy_to(t, self._g(a)) if t is not None else None
        return t

    def _coords_of(self, t: int) -> dict:
        q = self.q
        return {"tp_dep": t // (q * q), "tp_col": t // q % q, "tp_row": t % q}

    # ------------------------------------------------------------ cuts

    def _cut(self, name: str, full_shape, *cuts) -> tuple:
        """Register cuts ``(dim, axes[, parts[, pad_to]])`` of parameter ``name``; returns its local shape."""
        made = tuple(_Cut(c[0] % len(full_shape), full_shape[c[0]], *c[1:]) for c in cuts)
        self._splits[name] = made
        self._full_shapes[name] = torch.Size(full_shape)
        shape = list(full_shape)
        for c in made:
            shape[c.dim] = self._block(c) * c.parts
        return tuple(shape)

    def _padded(self, c: _Cut) -> int:
        return -(-c.full // c.pad_to) * c.pad_to

    def _block(self, c: _Cut) -> int:  # local length of each packed segment along c.dim
        n, blocks = self._padded(c), self.q ** len(c.axes)
        if n % (c.parts * blocks):
            raise ValueError(f"{type(self).__name__}: size {c.full} does not split into {c.parts} segment(s) "
                             f"over {blocks} ranks of {'x'.join(c.axes)}")
        return n // c.parts // blocks

    def _starts(self, c: _Cut, coords: dict) -> list[int]:
        """Padded start of the block held at ``coords``, per packed segment."""
        n, seg = self._block(c), self._padded(c) // c.parts
        idx = sum(coords[a] * self.q ** (len(c.axes) - 1 - d) for d, a in enumerate(c.axes))
        return [g * seg + idx * n for g in range(c.parts)]

    @classmethod
    def from_full(cls, old: nn.Module, mesh, **kwargs):
        """The layer for single-device ``old`` (meta stays meta), holding this rank's part of its weights."""
        w = old.weight
        new = cls(*cls._args(old), mesh=mesh, device="meta", dtype=w.dtype, **kwargs)
        role = new.role
        new = _copy_params(new.to_empty(device=w.device) if w.device.type != "meta" else new, old)
        if isinstance(new, Linear3D):  # its role is its orientation, not the old layer's label
            new.role = role
        return new

    def norm_placement(self, name: str) -> Optional[L.Placement]:
        """Every parameter: shards over ``tp``, each held by ``replicas(name)`` ranks of it."""
        copies = self.replicas(name)
        return None if copies == self.q ** 3 else L.Placement(self.group, copies)

    def replicas(self, name: str) -> int:
        """How many tp ranks hold the same copy of parameter ``name``'s local tensor."""
        cuts = self._splits.get(name, ())
        return self.q ** (3 - sum(len(c.axes) for c in cuts))

    # ------------------------------------------------------------ ShardedModule

    def shard_slices(self, name: str) -> Union[tuple, list]:
        """Slices of the real full tensor held here: a tuple, or a list (one per packed segment).

        Along a padded dim the slice covers real rows only (it may be empty); the
        local tensor is that slice followed by zero rows.
        """
        cuts = self._splits.get(name)
        if cuts is None:
            return L.ShardedModule.shard_slices(self, name)
        out = [[slice(0, n) for n in self.full_shape(name)]]
        for c in cuts:
            n = self._block(c)
            spans = [slice(min(s, c.full), min(s + n, c.full)) for s in self._starts(c, self.coord)]
            out = [sl[:c.dim] + [sp] + sl[c.dim + 1:] for sl in out for sp in spans]
        out = [tuple(sl) for sl in out]
        return out[0] if len(out) == 1 else out

    def local_part(self, name: str, full: Any) -> torch.Tensor:
        """This rank's local tensor (packed, zero-padded) from a full tensor or a safetensors slice."""
        cuts = self._splits.get(name)
        if cuts is None:
            return torch.as_tensor(full[tuple(slice(0, n) for n in self.full_shape(name))])
        shape = list(self.full_shape(name))
        for c in cuts:
            shape[c.dim] = self._block(c) * c.parts
        packed = next((c for c in cuts if c.parts > 1), None)
        pieces = []
        for g, sl in enumerate(self._list_slices(name)):
            if all(s.stop > s.start for s in sl):
                pieces.append((g, torch.as_tensor(full[sl])))
        dtype = pieces[0][1].dtype if pieces else (full.dtype if isinstance(full, torch.Tensor) else torch.float32)
        device = full.device if isinstance(full, torch.Tensor) else None
        out = torch.zeros(shape, dtype=dtype, device=device)
        for g, piece in pieces:
            dst = [slice(0, n) for n in piece.shape]
            if packed is not None:
                n = self._block(packed)
                dst[packed.dim] = slice(g * n, (g + 1) * n)
            out[tuple(dst)] = piece
        return out

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one shaped like parameter ``name`` (its grad, its Adam state)."""
        cuts = self._splits.get(name)
        if cuts is None:
            return local.detach()
        shards = comm.all_gather_list(local.detach(), self.group)
        shape = list(self.full_shape(name))
        for c in cuts:
            shape[c.dim] = self._padded(c)
        full = torch.zeros(shape, dtype=local.dtype, device=local.device)
        for t, shard in enumerate(shards):
            coords = self._coords_of(t)
            dst, src = [[slice(None)] * len(shape)], [[slice(None)] * len(shape)]
            for c in cuts:
                n = self._block(c)
                spans = [(slice(s, s + n), slice(g * n, (g + 1) * n)) for g, s in enumerate(self._starts(c, coords))]
                dst = [d[:c.dim] + [a] + d[c.dim + 1:] for d in dst for a, _ in spans]
                src = [s[:c.dim] + [b] + s[c.dim + 1:] for s in src for _, b in spans]
            for d, s in zip(dst, src):
                full[tuple(d)] = shard[tuple(s)]
        for c in cuts:
            full = full.narrow(c.dim, 0, c.full)
        return full


def _check_ids(ids: torch.Tensor, n: int) -> None:
    if ids.numel() and not ids.is_meta and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"ids must lie in [0, {n}), got min {int(ids.min())}, max {int(ids.max())}")


_LINEAR_ARGS = staticmethod(lambda m: (m.in_features, m.out_features, m.bias is not None))
_TABLE_ARGS = staticmethod(lambda m: (m.num_embeddings, m.dim))

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


class Linear3D(_Sharded3D, L.Linear):
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
        w = self._cut("weight", (out_features, in_features), (0, (self.out_axis,), self.packed),
                      (1, (self.in_axis, "tp_dep")))
        b = self._cut("bias", (out_features,), (0, (self.out_axis,), self.packed)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    _args = _LINEAR_ARGS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear3DFn.apply(x, self.weight, self.bias, self._g(self.in_axis), self._g(self.out_axis),
                                 self._g("tp_dep"))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"role={self.role}, packed={self.packed}, q={self.q}")


# ---------------------------------------------------------------- norm


class LayerNorm3D(_Sharded3D, L.LayerNorm):
    """Layer norm over a hidden dim split over ``tp_col`` (block layout), residual add fused.

    ``forward(x)`` -> ``norm(x)``; ``forward(x, residual)`` -> ``(norm(x + residual), x + residual)``.
    Statistics are fp32 sums all-reduced over ``tp_col``; weight and bias (H/q
    each) are replicated over ``tp_dep`` and ``tp_row``.
    """

    role = "norm"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.dim, self.eps = dim, eps
        w = self._cut("weight", (dim,), (0, ("tp_col",)))
        b = self._cut("bias", (dim,), (0, ("tp_col",))) if bias else None
        self._init_params({"weight": (w, "ones"), "bias": (b, "zeros")}, device, dtype)

    _args = staticmethod(lambda m: (m.dim, m.eps, m.bias is not None))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        h = x if residual is None else x + residual
        col = self._g("tp_col")
        h32 = h.float()
        stats = torch.stack([h32.sum(-1), (h32 * h32).sum(-1)], -1)     # (.., 2) local sums
        stats = comm.copy_to(comm.reduce_from(stats, col), col) / self.dim  # all-reduce both ways
        mean, sq = stats[..., :1], stats[..., 1:]
        y = (h32 - mean) * torch.rsqrt((sq - mean * mean).clamp_min(0.0) + self.eps)
        params = torch.stack([self.weight] + ([self.bias] if self.bias is not None else []))
        params = self._rep(params, "tp_dep", "tp_row").float()
        y = y * params[0] + (params[1] if self.bias is not None else 0.0)
        y = y.to(x.dtype)
        return y if residual is None else (y, h)

    def extra_repr(self) -> str:
        return f"{self.dim} (local {self.weight.shape[0]}), eps={self.eps}, q={self.q}"


# ---------------------------------------------------------------- vocabulary


class VocabEmbedding3D(_Sharded3D, L.Embedding):
    """Token table (V, H), also the tied LM head: rank (k, i, j) holds vocab chunk j q + k, features i.

    Lookup takes ids in the block layout and returns (.., H/q) in the block layout.
    """

    role = "vocab"

    def __init__(self, num_embeddings: int, dim: int, *, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._cut("weight", (num_embeddings, dim), (0, ("tp_row", "tp_dep"), 1, self.q ** 2), (1, ("tp_col",)))
        self.local_vocab = w[0] * self.q  # rows of the tp_dep-gathered block j
        self.local_start = self.coord["tp_row"] * self.local_vocab
        self._init_params({"weight": (w, "normal")}, device, dtype)

    _args = _TABLE_ARGS

    def _block_weight(self) -> torch.Tensor:
        return comm.all_gather_to(self.weight, self._g("tp_dep"), 0)  # (Vp/q, H/q): vocab block j

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings)
        row = self._g("tp_row")
        with torch.no_grad():
            ids = comm.gather_from(ids, row, 0)                    # (N/q, ..): batch block k
        local = ids - self.local_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self._block_weight())
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)         # (N/q, .., H/q) partial over j
        return comm.reduce_scatter_to(out, row, 0)                # (N/q^2, .., H/q): block layout

    def lm_logits(self, h: torch.Tensor, bias: Optional[torch.Tensor] = None, gather: bool = True) -> torch.Tensor:
        """Tied head ``h @ W.T (+ bias)`` for ``h`` in the block layout.

        ``gather=False``: local (N/q^2, .., Vp/q) logits in the *inner* layout
        (batch chunk k q + i, vocab block j; ``bias`` is a
        :class:`VocabTensor3D`'s output). ``gather=True``: the full (B, .., V)
        logits on every rank, padding cut. Training should use :meth:`lm_loss`.
        """
        hg = comm.all_gather_to(h, self._g("tp_row"), 0)             # (N/q, .., H/q)
        logits = comm.reduce_scatter_to(F.linear(hg, self._block_weight()), self._g("tp_col"), 0)
        if bias is not None:
            logits = logits + bias
        return logits if not gather else self.gather_logits(logits)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (B, .., V) logits on every rank from the local inner-layout ones, padding cut."""
        full = comm.gather_from(logits, self._g("tp_row"), -1)[..., :self.num_embeddings]
        return gather_output(full, self._cube.group, 0, layout="inner")

    def lm_loss(self, h: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the tied head for ``h`` (.., H/q) and ``labels`` (..), both in the block layout.

        Logits stay split (vocab over ``tp_row``, rows over ``tp_dep`` x
        ``tp_col``); every rank returns the same loss (NaN if every label is ignored).
        """
        return self.loss_from_logits(self.lm_logits(h, bias, gather=False), labels, ignore_index)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Vocab-parallel cross-entropy of local inner-layout logits against block-layout labels; never gathers."""
        with torch.no_grad():  # block-layout labels (chunk k q + j) -> the logits' chunk k q + i
            labels = comm.gather_from(labels, self._g("tp_row"), 0)
            labels = labels.chunk(self.q, 0)[self.coord["tp_col"]] if self.q > 1 else labels
        vl = logits.shape[-1]
        flat, labels = logits.reshape(-1, vl), labels.reshape(-1).to(torch.long)
        if labels.shape[0] != flat.shape[0]:
            raise ValueError(f"lm_loss: {labels.shape[0]} labels for {flat.shape[0]} rows of logits")
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= self.num_embeddings))
        if not labels.is_meta and bool(bad.any()):
            raise IndexError(f"lm_loss: label {int(labels[bad][0])} outside [0, {self.num_embeddings})")
        total = _VocabParallelCE.apply(flat, labels, self._g("tp_row"), self.local_start, self.num_embeddings,
                                       ignore_index)
        stats = torch.stack([total, (labels != ignore_index).sum().to(total.dtype)])
        stats = comm.reduce_from(comm.reduce_from(stats, self._g("tp_col")), self._g("tp_dep"))
        return stats[0] / stats[1]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local {tuple(self.weight.shape)}), {self.dim}, q={self.q}"


class Tensor3D(_Sharded3D, L.Tensor):
    """A free-standing hidden-last tensor (ViT's CLS token, position table): last dim cut over ``tp_col``."""

    role = "replicate"
    _axis, _others, _vocab = "tp_col", ("tp_dep", "tp_row"), False

    def __init__(self, *shape: int, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        w = self._cut("weight", tuple(shape), (-1, (self._axis,), 1, self.q ** 2 if self._vocab else 1))
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    _args = staticmethod(lambda m: tuple(m.weight.shape))

    def forward(self) -> torch.Tensor:
        return self._rep(self.weight, *self._others)


class VocabTensor3D(Tensor3D):
    """A learned vocab-last tensor (BERT's MLM bias) cut like the head's logits: block j of Vp/q over ``tp_row``."""

    role = "vocab"
    _axis, _others, _vocab = "tp_row", ("tp_dep", "tp_col"), True


# ---------------------------------------------------------------- hidden-split tables


class Embedding3D(_Sharded3D, L.Embedding):
    """Position / type table (P, H) with features cut over ``tp_col``, replicated over tp_dep x tp_row.

    Ids may be in the block layout (B/q^2, T) or broadcast (1, T); the output is (.., H/q).
    """

    role = "embedding"

    def __init__(self, num_embeddings: int, dim: int, *, mesh, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_mesh(mesh)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._cut("weight", (num_embeddings, dim), (1, ("tp_col",)))
        self._init_params({"weight": (w, "normal")}, device, dtype)

    _args = _TABLE_ARGS

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings)
        return F.embedding(ids, self._rep(self.weight, "tp_dep", "tp_row"))


class Head3D(_Sharded3D, L.Linear):
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
            w, b = self._cut("weight", shape, (1, ("tp_col",))), ((out_features,) if bias else None)
        else:
            w = self._cut("weight", shape, (0, ("tp_col",)))
            b = self._cut("bias", (out_features,), (0, ("tp_col",))) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    _args = _LINEAR_ARGS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        col = self._g("tp_col")
        if self.out_layout == "replicated":
            xg = gather_output(x, self._cube.group, 0)                  # (B, .., K/q)
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


# ---------------------------------------------------------------- whole models


def shard_3d(model: nn.Module, spec, mesh) -> nn.Module:
    """Replace the layers named by ``spec`` with their 3D counterparts, in place; returns ``model``.

    Roles: ``column`` / ``column_qkv`` / ``row`` -> :class:`Linear3D` (a column
    layer with no ``row`` sibling, as ViT's patch embedding, -> :class:`Head3D`
    full -> hidden); ``vocab`` -> :class:`VocabEmbedding3D` / :class:`VocabTensor3D`;
    ``embedding`` -> :class:`Embedding3D`; ``norm`` -> :class:`LayerNorm3D`;
    ``replicate`` Linear taking the hidden -> :class:`Head3D` (hidden -> hidden
    when it also returns the hidden size, else hidden -> replicated);
    ``replicate`` Tensor whose last dim is the hidden -> :class:`Tensor3D`.
    Other ``replicate`` layers stay whole. A materialised model's weights are
    sliced into the new layers; a meta model stays on meta (``to_empty`` then
    ``init_weights`` fill it through ``load_full``).
    """
    hidden = getattr(getattr(model, "config", None), "dim", None)  # else the first norm's width
    hidden = hidden or next((m.dim for m in model.modules() if isinstance(m, L.LayerNorm)), None)
    for path, mod in list(model.named_modules()):
        role = spec.role_of(path) if path else None
        if role is None or isinstance(mod, _Sharded3D):
            continue
        kind = type(mod)
        if role in ("column", "column_qkv", "row") and kind is L.Linear:
            if role == "column" and not _has_row_sibling(spec, path, model):
                new = Head3D.from_full(mod, mesh, in_layout="full", out_layout="hidden")
            else:
                new = Linear3D.from_full(mod, mesh, role=role)
        elif role == "vocab" and kind is L.Embedding:
            new = VocabEmbedding3D.from_full(mod, mesh)
        elif role == "vocab" and kind is L.Tensor:
            new = VocabTensor3D.from_full(mod, mesh)
        elif role == "embedding" and kind is L.Embedding:
            new = Embedding3D.from_full(mod, mesh)
        elif role == "norm" and kind is L.LayerNorm:
            new = LayerNorm3D.from_full(mod, mesh)
        elif role == "replicate" and kind is L.Linear and mod.in_features == hidden:
            out = "hidden" if mod.out_features == hidden else "replicated"
            new = Head3D.from_full(mod, mesh, in_layout="hidden", out_layout=out)
        elif role == "replicate" and kind is L.Tensor and mod.weight.shape[-1] == hidden:
            new = Tensor3D.from_full(mod, mesh)
        elif role == "replicate" and isinstance(mod, L.ShardedModule):
            mod.role = role
            continue
        else:
            raise TypeError(f"{path}: role {role!r} does not apply to a {kind.__name__} in 3D tensor parallelism")
        new.role = role
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def grad_norm_reducer(model: nn.Module, params, mesh):
    """A ``norm_reducer`` for :func:`cuboid.parallel.optim.clip_grad_norm_` (``params``, same list).

    Sums the squared norms over ``tp``, each weighted by 1 / (its copies), so a
    shard replicated on r ranks counts once and the global norm is the
    single-device one.
    """
    params, tp = list(params), mesh.size("tp")
    copies = {id(p): mod.replicas(name) if isinstance(mod, _Sharded3D) else tp
              for mod in model.modules() for name, p in mod.named_parameters(recurse=False)}

    def reduce(sq: torch.Tensor) -> torch.Tensor:
        w = [1.0 / copies.get(id(p), tp) for p in params if p.grad is not None]
        return comm.all_reduce_((sq * torch.tensor(w, dtype=sq.dtype, device=sq.device)).contiguous(), mesh.group("tp"))

    return reduce
