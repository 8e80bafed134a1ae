"""2D tensor parallelism (Optimus, Xu et al., arXiv 2104.05343) on a q x q grid of the ``tp`` group.

**Grid.** Tensor rank ``t = i q + j`` sits at row i, column j of the mesh's
``tp_grid``; ``tp_row`` is its row (q ranks with the same i, indexed by j),
``tp_col`` its column (same j, indexed by i); see :class:`.grid.Grid`.

**Layout.** An activation (B, T, H) lies in blocks: rank (i, j) holds
``X[i, j]`` = (B/q, T, H/q), batch block i and hidden block j. Model inputs
(ids, masks, labels, pixels) are batch-split alike (:func:`split_input`) and
replicated over the row. Every layer below maps that layout to itself:

==================  ==============================  ======================================
layer               parameter on rank (i, j)        activation in -> out
==================  ==============================  ======================================
Linear2D            W (out, in): (out/q, in/q) =    (.., in/q) block j -> (.., out/q) block j
(column, row,       rows block j, columns block i;  (``input_is_parallel=False``: (.., in)
column_qkv)         b (out,): (out/q^2) = piece     whole features -> (.., out/q))
                    j q + i (packed=3: of each of
                    the 3 segments)
LayerNorm2D         w, b (H,): piece j q + i        (.., H/q) -> (.., H/q)
VocabEmbedding2D    (V, H) padded to Vp rows:       ids (B/q, T) -> (B/q, T, H/q); head:
                    (Vp/q, H/q) = vocab block j,    (.., H/q) -> logits (.., Vp/q) vocab
                    hidden block i                  block j (the head's SUMMA layout)
VocabTensor2D       (.., V): piece j q + i of Vp    () -> (.., Vp/q) vocab block j
Embedding2D         (n, H): (n, H/q^2) piece jq+i   ids (any) -> (.., H/q) block j
Tensor2D            (.., H): (.., H/q^2) piece      () -> (.., H/q) block j
Head2D              W (C, H): (C, H/q^2) piece      (.., H/q) -> (.., C) whole, replicated
                    j q + i; b (C,) whole           over the row
==================  ==============================  ======================================

Every split parameter is cut over *both* grid axes (its q^2 shards lie on the
``tp`` group, so a norm or an optimizer state sums over ``tp``); only
Head2D's small bias is replicated. A parameter whose last dim is hidden is
stored as 1/q^2 pieces and all-gathered over ``tp_col`` where it is used (its
gradient reduce-scattered back), as Colossal-AI does for biases and norms.

**SUMMA.** With A = W^T, ``Y[i, j] = sum_k X[i, k] A[k, j]``: the q
broadcast steps of each row and column are fused into one all-gather of X
over ``tp_row`` (the whole ``in`` dim of batch block i) and one of W over
``tp_col`` (output block j, whole ``in``); the bytes sent are those of the q
broadcasts. Backward is the two reduce-scatters (``comm.all_gather_to``'s
pair). The gathered tensors are kept for backward; ``recompute=True`` keeps
only the local blocks and gathers them again in backward (Optimus' memory, at
twice the traffic).

**Communication** per rank, in :mod:`cuboid.parallel.comm`'s convention, for
a local activation of N rows (N = B T / q), elements of b bytes,
``a = (q - 1) / q``:

- ``Linear2D`` (in -> out): forward ``a b (N in + out in / q + out / q)``
  (all-gather of x over ``tp_row``, of W and of the bias over ``tp_col``);
  backward the same bytes as reduce-scatters (the ``N in`` term only when the
  input needs a gradient; no ``out / q`` without bias). ``recompute=True``:
  backward adds the forward's bytes. ``input_is_parallel=False``: no
  ``N in`` term forward; backward ``2 a b N in`` (all-reduce over ``tp_row``)
  in its place.
- ``LayerNorm2D`` (H): forward ``2 * 2 a * 4 N`` (fp32 mean, then variance,
  all-reduced over ``tp_row``) ``+ 2 a b H / q`` (gathers of w, b); backward
  the same bytes (two all-reduces, two reduce-scatters).
- ``VocabEmbedding2D`` lookup: forward ``a b (Vp H / q + N H)`` (the table's
  vocab block j gathered over ``tp_col``, then a reduce-scatter of the (N, H)
  partial sums over ``tp_row``); backward the same.
- ``lm_logits(gather=False)``: forward ``a b (N H + Vp H / q)`` (``+ a b Vp / q``
  with a :class:`VocabTensor2D` bias); backward the same. ``gather=True`` /
  ``gather_logits`` add forward ``a b N Vp`` (vocab blocks over ``tp_row``)
  ``+ (q - 1) b N V`` (batch blocks over ``tp_col``).
- ``lm_loss`` (N label rows): ``lm_logits`` ``+ 2 a * 12 N`` (cross-entropy
  statistics over ``tp_row``) ``+ 2 a * 8`` (loss sum and count over
  ``tp_col``); backward as ``lm_logits``. The logits are never gathered.
- ``Embedding2D`` (n, H): ``a b n H / q`` each way; ``Tensor2D`` of M
  elements: ``a b M / q`` each way.
- ``Head2D`` (H -> C): forward ``a b C H / q + 2 a b N C``; backward
  ``a b C H / q + 2 a b C`` (``input_is_parallel=False`` adds ``a b N H``, the
  input grad's all-gather). Its ``loss_from_logits`` adds ``2 a * 8``.

A pre-LN block (qkv, proj, fc, proj of width 4H; biases and norms aside)
thus sends ``a b (7 N H + 12 H^2 / q)`` each way, against 1D's
``4 (p-1)/p b B T H`` on p = q^2 ranks: the activation traffic per rank
shrinks about as 1/q, the price being the weight gathers.

**Padding.** A vocabulary V is padded to ``Vp = ceil(V / q^2) q^2`` rows (so
both the table's row blocks and the bias' pieces split); pad rows are zero,
masked to -inf in the loss, cut from gathered logits, absent from
:meth:`full_tensor` and checkpoints, and get exactly zero gradient.

**Limits.** H and every Linear's ``out`` (per packed segment) must divide by
q^2, its ``in`` by q, the heads by q (each rank runs whole heads of batch
block i), the batch by q. Losses must go through the layers
(``loss_from_logits`` / ``lm_loss`` of the vocab layer or of a Head2D: a mean
over the whole batch), never a single-device cross-entropy of local rows.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.tensor.d1 import _has_row_sibling, _VocabParallelCE
from cuboid.parallel.tensor.grid import (Grid, _Cut, _GridSharded, batch_mean, copy_from_full, cross_entropy,
                                         gather_output, split_input)

__all__ = ["Linear2D", "LayerNorm2D", "VocabEmbedding2D", "VocabTensor2D", "Embedding2D", "Tensor2D", "Head2D",
           "shard_2d", "split_input", "gather_output", "cross_entropy", "batch_mean", "Grid"]

_BOTH = ("row", "col")  # a hidden-like dim cut into q^2 pieces, j outer, i inner


def _row_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` whose backward also sums (every rank uses the total)."""
    return comm.copy_to(comm.reduce_from(t, group), group)


def _check_ids(ids: torch.Tensor, n: int) -> None:
    if ids.numel() and not ids.is_meta and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"ids must lie in [0, {n}), got min {int(ids.min())}, max {int(ids.max())}")


class Linear2D(_GridSharded, L.Linear):
    """SUMMA linear ``y = x W^T + b``: (.., in/q) hidden block j -> (.., out/q) block j, batch block i.

    The same layer serves the ``column``, ``row`` and (``packed=3``)
    ``column_qkv`` roles: with packed segments [W_q; W_k; W_v] rank column j
    holds the j-th 1/q of each, so its output is [q_j, k_j, v_j], whole heads.
    ``input_is_parallel=False`` takes an input with all ``in`` features
    (replicated over the row: ViT's flattened patches). ``recompute=True``
    trades traffic for memory (see the module docstring).
    """

    role = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, grid=None, packed: int = 1,
                 input_is_parallel: bool = True, recompute: bool = False, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.in_features, self.out_features = in_features, out_features
        self.packed, self.input_is_parallel, self.recompute = packed, input_is_parallel, recompute
        w = self._add_cuts("weight", (out_features, in_features), _Cut(0, out_features, ("row",), packed),
                           _Cut(1, in_features, ("col",)))
        b = self._add_cuts("bias", (out_features,), _Cut(0, out_features, _BOTH, packed)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    @classmethod
    def from_full(cls, linear: L.Linear, mesh_or_grid, **kwargs) -> "Linear2D":
        return copy_from_full(cls, linear, mesh_or_grid, linear.in_features, linear.out_features,
                              linear.bias is not None, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled() and self.grid.q > 1:
            return checkpoint(self._summa, x, use_reentrant=False)
        return self._summa(x)

    def _summa(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        x = comm.all_gather_to(x, g.row, -1) if self.input_is_parallel else comm.copy_to(x, g.row)  # (.., in)
        w = comm.all_gather_to(self._dep(self.weight), g.col, 1)  # (out/q, in): output block j
        return F.linear(x, w, self._vec(self.bias, self.packed))  # (.., out/q)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"packed={self.packed}, input_is_parallel={self.input_is_parallel}, role={self.role}, "
                f"{self.grid}")


class LayerNorm2D(_GridSharded, L.LayerNorm):
    """Layer norm over a hidden dim split over the row: (.., H/q) -> (.., H/q), fp32 statistics.

    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``, as
    :class:`cuboid.parallel.layers.LayerNorm`. Mean and variance are two
    all-reduces over ``tp_row`` (two-pass, as one device computes them).
    """

    role = "norm"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, grid=None, device=None,
                 dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.dim, self.eps = dim, eps
        s = self._add_cuts("weight", (dim,), _Cut(0, dim, _BOTH))
        if bias:
            self._add_cuts("bias", (dim,), _Cut(0, dim, _BOTH))
        self._init_params({"weight": (s, "ones"), "bias": (s if bias else None, "zeros")}, device, dtype)

    @classmethod
    def from_full(cls, norm: L.LayerNorm, mesh_or_grid) -> "LayerNorm2D":
        return copy_from_full(cls, norm, mesh_or_grid, norm.dim, norm.eps, norm.bias is not None)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
        row = self.grid.row
        h = x.float()
        mean = _row_sum(h.sum(-1, keepdim=True), row) / self.dim
        h = h - mean
        var = _row_sum((h * h).sum(-1, keepdim=True), row) / self.dim
        h = h * torch.rsqrt(var + self.eps) * self._vec(self.weight).float()
        if self.bias is not None:
            h = h + self._vec(self.bias).float()
        y = h.to(x.dtype)
        return y if residual is None else (y, x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, {self.grid}"


class VocabEmbedding2D(_GridSharded, L.Embedding):
    """Vocab-parallel table (V, H), padded to Vp rows; also the tied LM head. Lookup -> (.., H/q).

    Rank (i, j) holds vocab block j (padded rows [j Vp/q, (j+1) Vp/q), real
    ones [vocab_start, vocab_end)) and hidden block i: the head Linear(H, Vp)
    in :class:`Linear2D`'s layout, so the head is one SUMMA product. A lookup
    gathers the vocab block over ``tp_col``, embeds the ids of batch block i
    that fall in it and reduce-scatters the partial rows over ``tp_row``.
    """

    role = "vocab"

    def __init__(self, num_embeddings: int, dim: int, *, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.num_embeddings, self.dim = num_embeddings, dim
        q = self.grid.q
        w = self._add_cuts("weight", (num_embeddings, dim), _Cut(0, num_embeddings, ("row",), pad=q * q),
                           _Cut(1, dim, ("col",)))
        self.local_vocab = w[0]
        self.padded_vocab = w[0] * q
        self.local_start = self.grid.j * self.local_vocab  # first (padded) vocab index of block j
        self.vocab_start = min(self.local_start, num_embeddings)
        self.vocab_end = min(self.local_start + self.local_vocab, num_embeddings)
        self._init_params({"weight": (w, "normal")}, device, dtype)

    @classmethod
    def from_full(cls, emb: L.Embedding, mesh_or_grid) -> "VocabEmbedding2D":
        return copy_from_full(cls, emb, mesh_or_grid, emb.num_embeddings, emb.dim)

    def _table(self) -> torch.Tensor:
        return comm.all_gather_to(self._dep(self.weight), self.grid.col, 1)  # (Vp/q, H): vocab block j

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings)
        local = ids - self.local_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self._table())  # (.., H), partial over vocab blocks
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_scatter_to(out, self.grid.row, -1)  # (.., H/q)

    def lm_logits(self, h: torch.Tensor, bias: Optional[torch.Tensor] = None, gather: bool = True) -> torch.Tensor:
        """Tied head of ``h`` (.., H/q): local (.., Vp/q) logits (vocab block j of the local rows) or,
        with ``gather``, the full (B, .., V) logits of the whole batch on every rank.

        ``bias`` is local (a :class:`VocabTensor2D`'s output). Training should
        use :meth:`lm_loss` / :meth:`loss_from_logits`, which never gather.
        """
        x = comm.all_gather_to(h, self.grid.row, -1)  # (.., H)
        logits = F.linear(x, self._table(), bias)  # (.., Vp/q): vocab block j
        return self.gather_logits(logits) if gather else logits

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (B, .., V) logits from local ones: vocab blocks over ``tp_row`` (padding cut), then the batch."""
        full = comm.gather_from(logits, self.grid.row, -1)[..., :self.num_embeddings]
        return gather_output(full, self.grid, 0)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over the whole batch of local (.., Vp/q) logits; ``labels`` batch-split alike.

        Every rank returns the same loss (NaN if every label of the batch is
        ignored); a batch block without labels is fine.
        """
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1).to(torch.long)
        if labels.shape[0] != logits.shape[0]:
            raise ValueError(f"lm_loss: {labels.shape[0]} labels for {logits.shape[0]} rows of logits")
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= self.num_embeddings))
        if not labels.is_meta and bool(bad.any()):
            raise IndexError(f"lm_loss: label {int(labels[bad][0])} outside [0, {self.num_embeddings})")
        total = _VocabParallelCE.apply(logits, labels, self.grid.row, self.local_start, self.num_embeddings,
                                       ignore_index)
        return batch_mean(total, (labels != ignore_index).sum(), self.grid)

    def lm_loss(self, h: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over the whole batch of the tied head's logits for ``h``; never gathers them."""
        return self.loss_from_logits(self.lm_logits(h, bias, gather=False), labels, ignore_index)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.local_vocab}, rows {self.vocab_start}:{self.vocab_end}), "
                f"{self.dim}, {self.grid}")


class VocabTensor2D(_GridSharded, L.Tensor):
    """A learned tensor whose last dim is the vocabulary (BERT's MLM bias); returns (.., Vp/q), vocab block j."""

    role = "vocab"

    def __init__(self, *shape: int, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        q = self.grid.q
        w = self._add_cuts("weight", tuple(shape), _Cut(-1, shape[-1], _BOTH, pad=q * q))
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    @classmethod
    def from_full(cls, t: L.Tensor, mesh_or_grid) -> "VocabTensor2D":
        return copy_from_full(cls, t, mesh_or_grid, *t.weight.shape)

    def forward(self) -> torch.Tensor:
        return self._vec(self.weight)


class Embedding2D(_GridSharded, L.Embedding):
    """A position / token-type table (n, H), hidden split: ids of any shape -> (.., H/q), hidden block j."""

    role = "embedding"

    def __init__(self, num_embeddings: int, dim: int, *, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._add_cuts("weight", (num_embeddings, dim), _Cut(1, dim, _BOTH))
        self._init_params({"weight": (w, "normal")}, device, dtype)

    from_full = classmethod(VocabEmbedding2D.from_full.__func__)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids(ids, self.num_embeddings)
        return F.embedding(ids, self._vec(self.weight))


class Tensor2D(_GridSharded, L.Tensor):
    """A free-standing learned tensor whose last dim is hidden (ViT's CLS token, positions): -> (.., H/q)."""

    role = "replicate"

    def __init__(self, *shape: int, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        w = self._add_cuts("weight", tuple(shape), _Cut(-1, shape[-1], _BOTH))
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    from_full = classmethod(VocabTensor2D.from_full.__func__)

    def forward(self) -> torch.Tensor:
        return self._vec(self.weight)


class Head2D(_GridSharded, L.Linear):
    """Classifier head for small C: (.., H/q) hidden block j -> (.., C) whole, replicated over the row.

    The partial products of the hidden blocks are all-reduced over ``tp_row``;
    the bias is whole on every rank (its gradient all-reduced over the batch
    blocks). ``input_is_parallel=False`` takes a (.., H) input with all features.
    """

    role = "replicate"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, grid=None,
                 input_is_parallel: bool = True, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        w = self._add_cuts("weight", (out_features, in_features), _Cut(1, in_features, _BOTH))
        self._init_params({"weight": (w, "normal"), "bias": ((out_features,) if bias else None, "zeros")},
                          device, dtype)

    from_full = classmethod(Linear2D.from_full.__func__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        if not self.input_is_parallel:
            x = comm.scatter_to(x, g.row, -1)
        y = comm.reduce_from(F.linear(x, self._vec(self.weight)), g.row)  # (.., C)
        if self.bias is None:
            return y
        return y + comm.copy_to(comm.copy_to(self.bias, g.col), g.dep)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy over the whole batch of this head's batch-split logits (:func:`.grid.cross_entropy`)."""
        return cross_entropy(logits, labels, self.grid, ignore_index)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The (B, .., C) logits of the whole batch on every rank."""
        return gather_output(logits, self.grid, 0)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.grid}"


# ---------------------------------------------------------------- whole models

CLASSES = {"linear": Linear2D, "norm": LayerNorm2D, "vocab": VocabEmbedding2D, "vocab_tensor": VocabTensor2D,
           "embedding": Embedding2D, "tensor": Tensor2D, "head": Head2D}


def _shard(model: nn.Module, spec, grid: Grid, classes: dict, mode: str) -> nn.Module:
    for path, mod in list(model.named_modules()):
        role = spec.role_of(path) if path else None
        if role is None or isinstance(mod, _GridSharded):
            continue
        kind = type(mod)
        if role in ("column", "column_qkv", "row") and kind is L.Linear:
            kw = {"packed": 3} if role == "column_qkv" else {}
            if role == "column" and not _has_row_sibling(spec, path, model):
                kw["input_is_parallel"] = False  # a model-input projection (ViT patches)
            new = classes["linear"].from_full(mod, grid, **kw)
        elif role == "vocab" and kind is L.Embedding:
            new = classes["vocab"].from_full(mod, grid)
        elif role == "vocab" and kind is L.Tensor:
            new = classes["vocab_tensor"].from_full(mod, grid)
        elif role == "embedding" and kind is L.Embedding:
            new = classes["embedding"].from_full(mod, grid)
        elif role == "norm" and kind is L.LayerNorm:
            new = classes["norm"].from_full(mod, grid)
        elif role == "replicate" and kind is L.Linear:  # hidden -> hidden stays in the layout (pooler)
            cls = classes["linear"] if mod.in_features == mod.out_features else classes["head"]
            new = cls.from_full(mod, grid)
        elif role == "replicate" and kind is L.Tensor:
            new = classes["tensor"].from_full(mod, grid)
        else:
            raise TypeError(f"{path}: role {role!r} does not apply to a {kind.__name__} in {mode} tensor parallelism")
        new.role = role
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def shard_2d(model: nn.Module, spec, mesh_or_grid) -> nn.Module:
    """Replace the layers named by ``spec`` with their 2D counterparts, in place; returns ``model``.

    Roles: ``column`` / ``column_qkv`` (packed=3) / ``row`` -> :class:`Linear2D`
    (a ``column`` whose parent has no ``row`` layer takes whole input
    features: ViT's patch embedding); ``vocab`` -> :class:`VocabEmbedding2D`
    (an Embedding) or :class:`VocabTensor2D` (a Tensor); ``embedding`` ->
    :class:`Embedding2D`; ``norm`` -> :class:`LayerNorm2D`; ``replicate``
    Linear -> :class:`Linear2D` when in == out (pooler, MLM dense: the output
    stays hidden-split) else :class:`Head2D`; ``replicate`` Tensor ->
    :class:`Tensor2D`. A materialised model's weights are sliced into the new
    layers; a meta model stays on meta (``to_empty`` + ``init_weights`` fill
    it through ``load_full``). ``mesh_or_grid``: a 2D Mesh or a :class:`Grid`.
    """
    grid = Grid.of(mesh_or_grid)
    if grid.d > 1:
        raise ValueError(f"shard_2d on a grid of depth {grid.d}: use d2p5.shard_2p5d")
    return _shard(model, spec, grid, CLASSES, "2D")
