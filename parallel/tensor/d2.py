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
LearnedTensor2D     (.., H): (.., H/q^2) piece      () -> (.., H/q) block j
Head2D              W (C, H): (C, H/q^2) piece      (.., H/q) -> (.., C) whole, replicated
                    j q + i; b (C,) whole           over the row
head_norm (q/k      (D,) whole; gradient summed     (B/q, T, heads/q, D) -> same
norms)              over the grid (and depth)
==================  ==============================  ======================================

Every split parameter is cut over *both* grid axes (its q^2 pieces lie on the
``tp`` group, so a norm or an optimizer state sums over ``tp``:
``Placement(plane)``); only Head2D's small bias and the head norms
(:class:`~.base.HeadNorm`: each rank normalises its batch block's heads) are
replicated. A parameter
whose last dim is hidden is stored as 1/q^2 pieces and all-gathered over
``tp_col`` where it is used (its gradient reduce-scattered back), as
Colossal-AI does for biases and norms.

**SUMMA.** With A = W^T, ``Y[i, j] = sum_k X[i, k] A[k, j]``: the q
broadcast steps of each row and column are fused into one all-gather of X
over ``tp_row`` (the whole ``in`` dim of batch block i) and one of W over
``tp_col`` (output block j, whole ``in``); the bytes sent are those of the q
broadcasts. Backward is the two reduce-scatters (``comm.all_gather_to``'s
pair). The gathered tensors are kept for backward; ``recompute=True`` keeps
only the local blocks and gathers them again in backward (Optimus' memory, at
twice the traffic).

**Communication** (exact bytes per layer: :class:`.grid.Costs`; per training
step: :func:`bytes_per_step`). A Linear2D gathers its input over the row and
its weight and bias over the column, and reduce-scatters their gradients in
backward; a LayerNorm2D all-reduces two fp32 statistics per row over the row
and gathers its weight and bias; the vocab table gathers its vocab block over
the column and reduce-scatters the looked-up rows over the row; the head is a
SUMMA product and the loss all-reduces fp32 statistics over the row and an
fp32 (sum, count) pair over the column. A pre-LN block thus sends about
``(q-1)/q b (7 N H / q + 12 H^2 / q)`` each way (N = B T), against 1D's
``4 (p-1)/p b N H`` on p = q^2 ranks: the activation traffic per rank shrinks
about as 1/q, the price being the weight gathers. Under bf16 autocast the
matmul operands (activations, weights, biases) are gathered in bf16.

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
from torch.utils.checkpoint import checkpoint

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.tensor.base import Cut, VocabParallel, check_ids, to_compute
from cuboid.parallel.tensor.engine import Mode, parallelize_module, step_bytes
from cuboid.parallel.tensor.grid import (Costs, Grid, GridSharded, batch_mean, cross_entropy, gather_output,
                                         split_input, styles)

__all__ = ["Linear2D", "LayerNorm2D", "VocabEmbedding2D", "VocabTensor2D", "Embedding2D", "LearnedTensor2D", "Head2D",
           "shard_2d", "bytes_per_step", "split_input", "gather_output", "cross_entropy", "batch_mean", "Grid",
           "CLASSES", "STYLES", "MODE"]

_BOTH = ("tp_row", "tp_col")  # a hidden-like dim cut into q^2 pieces, j outer, i inner


def _row_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` whose backward also sums (every rank uses the total)."""
    return comm.copy_to(comm.reduce_from(t, group), group)


class Linear2D(GridSharded, L.Linear):
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
        w = self._cut("weight", (out_features, in_features), Cut(0, ("tp_row",), packed), Cut(1, ("tp_col",)))
        b = self._cut("bias", (out_features,), Cut(0, _BOTH, packed)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled() and self.grid.q > 1:
            return checkpoint(self._summa, x, use_reentrant=False)
        return self._summa(x)

    def _summa(self, x: torch.Tensor) -> torch.Tensor:
        g, x = self.grid, to_compute(x)
        x = comm.all_gather_to(x, g.row, -1) if self.input_is_parallel else comm.copy_to(x, g.row)  # (.., in)
        w = comm.all_gather_to(to_compute(self._dep(self.weight)), g.col, 1)  # (out/q, in): output block j
        return F.linear(x, w, self._vec(self.bias, self.packed, matmul=True))  # (.., out/q)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {tuple(self.weight.shape)}), "
                f"packed={self.packed}, input_is_parallel={self.input_is_parallel}, role={self.role}, "
                f"{self.grid}")


class LayerNorm2D(GridSharded, L.LayerNorm):
    """Layer norm over a hidden dim split over the row: (.., H/q) -> (.., H/q), fp32 statistics.

    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``, as
    :class:`cuboid.parallel.layers.LayerNorm`. Mean and variance are two
    all-reduces over ``tp_row`` (two-pass, as one device computes them).
    ``rms=True`` is the RMS norm of :class:`cuboid.parallel.layers.RMSNorm`: no
    mean, no bias, one all-reduce; ``offset``: the output scales by
    ``offset + weight`` (Gemma's norms: 1; :func:`~.base.rms_offset`).
    """

    role = "norm"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, *, grid=None, rms: bool = False,
                 offset: float = 0.0, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.dim, self.eps, self.rms, self.offset = dim, eps, rms, offset
        s = self._cut("weight", (dim,), Cut(0, _BOTH))
        if bias:
            self._cut("bias", (dim,), Cut(0, _BOTH))
        self._init_params({"weight": (s, "ones"), "bias": (s if bias else None, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
        row = self.grid.row
        h = x.float()
        if not self.rms:  # RMS norm (Llama): no centring
            h = h - _row_sum(h.sum(-1, keepdim=True), row) / self.dim
        var = _row_sum((h * h).sum(-1, keepdim=True), row) / self.dim
        w = self._vec(self.weight).float()
        h = h * torch.rsqrt(var + self.eps) * (w + self.offset if self.offset else w)
        if self.bias is not None:
            h = h + self._vec(self.bias).float()
        y = h.to(x.dtype)
        return y if residual is None else (y, x)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, rms={self.rms}, offset={self.offset}, {self.grid}"


class VocabEmbedding2D(VocabParallel, GridSharded, L.Embedding):
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
        w = self._cut("weight", (num_embeddings, dim), Cut(0, ("tp_row",), pad=q * q), Cut(1, ("tp_col",)))
        self.padded_vocab = w[0] * q
        self._set_vocab(w[0], self.grid.j * w[0])  # vocab block j
        self._init_params({"weight": (w, "normal")}, device, dtype)

    def _table(self, matmul: bool = False) -> torch.Tensor:
        w = self._dep(self.weight)
        return comm.all_gather_to(to_compute(w) if matmul else w, self.grid.col, 1)  # (Vp/q, H): vocab block j

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_to(self._lookup(ids, self._table()), self.grid.row, -1)  # (.., H/q)

    # The tied head (``lm_outputs`` / ``lm_logits`` / ``lm_loss``) of ``h`` (.., H/q): local (.., Vp/q) logits,
    # vocab block j of the local rows (``bias`` local: a VocabTensor2D's output), gathered to the full
    # (B, .., V) logits of the whole batch only when read; the loss is vocab-parallel over the row and a
    # mean over the whole batch. The fused loss takes the same operands, so it composes as the unfused one.

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        return comm.all_gather_to(to_compute(h), self.grid.row, -1)  # (.., H)

    def _head_weight(self) -> torch.Tensor:
        return self._table(matmul=True)  # (Vp/q, H): vocab block j

    def _head_group(self):
        return self.grid.row

    def _head_mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return batch_mean(total, count, self.grid)  # every batch block: NaN only if the whole batch has no label

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (B, .., V) logits from local ones: vocab blocks over ``tp_row`` (padding cut), then the batch."""
        full = comm.gather_from(logits, self.grid.row, -1)[..., :self.num_embeddings]
        return gather_output(full, self.grid, 0)



class LearnedTensor2D(GridSharded, L.LearnedTensor):
    """A free-standing learned tensor whose last dim is hidden (ViT's CLS token, positions): -> (.., H/q).

    Stored as piece j q + i of the last dim, gathered over ``tp_col`` where it is used.
    """

    role = "replicate"
    _pad = False  # the vocabulary variant pads its last dim to a multiple of q^2

    def __init__(self, *shape: int, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        w = self._cut("weight", tuple(shape), Cut(-1, _BOTH, pad=self.grid.q ** 2 if self._pad else 1))
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    def forward(self) -> torch.Tensor:
        return self._vec(self.weight)


class VocabTensor2D(LearnedTensor2D):
    """A learned tensor whose last dim is the vocabulary (BERT's MLM bias); returns (.., Vp/q), vocab block j."""

    role = "vocab"
    _pad = True


class Embedding2D(GridSharded, L.Embedding):
    """A position / token-type table (n, H), hidden split: ids of any shape -> (.., H/q), hidden block j."""

    role = "embedding"

    def __init__(self, num_embeddings: int, dim: int, *, grid=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_grid(grid)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._cut("weight", (num_embeddings, dim), Cut(1, _BOTH))
        self._init_params({"weight": (w, "normal")}, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings)
        return F.embedding(ids, self._vec(self.weight))


class Head2D(GridSharded, L.Linear):
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
        w = self._cut("weight", (out_features, in_features), Cut(1, _BOTH))
        self._init_params({"weight": (w, "normal"), "bias": ((out_features,) if bias else None, "zeros")},
                          device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.grid
        if not self.input_is_parallel:
            x = comm.scatter_to(to_compute(x), g.row, -1)
        y = comm.reduce_from(F.linear(x, self._vec(self.weight, matmul=True)), g.row)  # (.., C)
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
           "embedding": Embedding2D, "tensor": LearnedTensor2D, "head": Head2D}
STYLES = styles(CLASSES)


def _place(mesh_or_grid) -> Grid:
    grid = Grid.of(mesh_or_grid)
    if grid.d > 1:
        raise ValueError(f"shard_2d on a grid of depth {grid.d}: use d2p5.shard_2p5d")
    return grid


MODE = Mode("2D", STYLES, _place, Costs.of)


def shard_2d(model, spec, mesh_or_grid):
    """Replace the layers named by ``spec`` with their 2D counterparts (:data:`STYLES`), in place.

    ``column`` / ``column_qkv`` / ``row`` -> :class:`Linear2D` (a ``column``
    whose parent has no ``row`` layer takes whole input features: ViT's patch
    embedding); ``vocab`` -> :class:`VocabEmbedding2D` / :class:`VocabTensor2D`;
    ``embedding`` -> :class:`Embedding2D`; ``norm`` -> :class:`LayerNorm2D`;
    ``replicate`` Linear -> :class:`Linear2D` when in == out (pooler, MLM
    dense) else :class:`Head2D`; ``replicate`` LearnedTensor -> :class:`LearnedTensor2D`.
    ``mesh_or_grid``: a 2D Mesh or a :class:`Grid`.
    """
    return parallelize_module(model, spec, MODE, _place(mesh_or_grid))


def bytes_per_step(config, plan, batch: int, seq: int, *, dtype=torch.float32, autocast=None) -> float:
    """Bytes one rank sends in a GPT-shaped training step under 2D (:func:`.engine.step_bytes`)."""
    return step_bytes(Costs.of(plan, dtype, autocast), config, batch, seq)
