"""1D tensor parallelism (Megatron-LM, Shoeybi et al., arXiv 1909.08053) over the ``tp`` group.

**Layout.** Activations between blocks, (B, T, H), are *replicated*: every
tensor rank holds the whole tensor. Inside a block the hidden dim of the
attention heads and of the MLP is split over the p ranks of ``tp``: a
:class:`ColumnLinear` takes the replicated input and produces its 1/p slice of
the output features; a :class:`RowLinear` takes that slice and produces a
partial sum of the full output, summed over ranks. Hence:

==================  ===========================  ====================================
layer               weight on rank r             activation in -> out
==================  ===========================  ====================================
ColumnLinear        (out/p, in): rows r of out   (.., in) replicated -> (.., out/p)
                    (packed=3: rows r of each    (or (.., out) replicated with
                    of the 3 segments)           gather_output=True)
RowLinear           (out, in/p); bias whole      (.., in/p) -> (.., out) replicated
VocabEmbedding      (Vp/p, H): vocab rows r      ids (..) -> (.., H) replicated
lm_logits / lm_loss same table, tied             (.., H) -> (.., Vp/p) local logits
norms, pos. emb.    whole (replicated)           replicated -> replicated
head_norm           whole; gradient summed       (.., heads/p, D) -> same
                    over tp
==================  ===========================  ====================================

Every cut is one :class:`~.base.Cut` over the ``tp`` axis (see :mod:`.base`);
gradients of replicated parameters come out whole and identical on every rank
(their inputs and output grads are replicated), so no extra reduction is
needed; a ``head_norm`` (q/k norms over each head's features) sees only this
rank's heads, so its gradient is summed over ``tp`` (:class:`~.base.HeadNorm`).
Split parameters carry ``Placement(tp)``.

**Communication** (exact bytes: :class:`Costs`, in :mod:`cuboid.parallel.comm`'s
convention). With ``A`` one all-reduce of a (B, T, H) activation:

- ColumnLinear: forward nothing (``gather_output`` all-gathers its output);
  backward one all-reduce of the input's gradient, ``A``.
- RowLinear: forward one all-reduce of the output, ``A``; backward nothing.
- a Column -> Row pair (MLP, attention) is ``A`` forward + ``A`` backward, so
  a transformer block costs ``4 A`` per step (Megatron's 4 all-reduces).
- VocabEmbedding: forward ``A`` (the rows found on each rank are summed).
- lm_loss: backward ``A`` (the head's input gradient); forward one
  all-reduce of three fp32 statistics per row (a max, a sum of exponentials
  and the target logit). Full logits are never gathered.

Under bf16 autocast the matmul operands travel in bf16 (the column input is
cast before it enters the region, so its gradient's all-reduce is 2-byte);
the embedding lookup's sum stays in the table's dtype.

**Padding.** A vocabulary V that does not divide p is padded to
``Vp = ceil(V/p) * p`` rows; the pad rows are zero, masked to -inf in the loss,
cut from gathered logits, and never appear in :meth:`full_tensor` or
checkpoints (their gradients are exactly zero, so they stay zero).

**Packed QKV.** The zoo's fused qkv weight is [W_q; W_k; W_v] on the output dim.
``ColumnLinear(packed=3)`` gives rank r the r-th 1/p of *each* segment, i.e.
whole heads of q, k and v, stored [q_r; k_r; v_r], so the attention code runs
its local heads unchanged. Its ``shard_slices`` is then a *list* of three slice
tuples (one per segment).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.tensor import engine
from cuboid.parallel.tensor.base import (Axes, Cut, HeadNorm, Sharded, VocabParallel, to_compute,
                                         vocab_parallel_cross_entropy)
from cuboid.parallel.tensor.engine import ANY, Mode, Style, no_row_sibling, parallelize_module, rms, step_bytes

__all__ = ["ColumnLinear", "ReplicatedKVLinear", "KVColumn", "RowLinear", "VocabEmbedding", "VocabTensor", "vocab_parallel_cross_entropy",
           "shard_1d", "tp_axes", "Costs", "bytes_per_step", "STYLES", "MODE"]


def tp_axes(where) -> Axes:
    """The ``tp`` axis of a Mesh, a process group (None: one rank) or :class:`~.base.Axes` (as it is)."""
    if isinstance(where, Axes):
        return where
    if hasattr(where, "plan"):  # a Mesh (layout-only meshes too: sizes without groups)
        return Axes.of_mesh(where, ("tp",), shard_group=where.group("tp"))
    return Axes({"tp": (where, comm.group_size(where), comm.group_rank(where))}, ("tp",), where)


class _Tp(Sharded):
    """A 1D layer: built on ``group=`` (a process group, a Mesh or Axes)."""

    _where = "group"

    @property
    def group(self):
        return self.axes.group("tp")

    @property
    def tp_size(self) -> int:
        return self.axes.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.axes.index("tp")


# ---------------------------------------------------------------- linear layers


class ColumnLinear(_Tp, L.Linear):
    """Linear with W (out, in) split on the out dim: replicated input, output features r of p.

    ``packed=3`` splits each of 3 stacked segments (fused QKV) separately.
    ``gather_output=True`` all-gathers the output into a replicated (.., out),
    in the full tensor's feature order.
    """

    role = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None, packed: int = 1,
                 gather_output: bool = False, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._setup(tp_axes(group))
        self.in_features, self.out_features = in_features, out_features
        self.packed, self.gather_output = packed, gather_output
        w = self._cut("weight", (out_features, in_features), Cut(0, parts=packed))
        b = self._cut("bias", (out_features,), Cut(0, parts=packed)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    seq_dim: Optional[int] = None  # sequence-sharded input (Megatron sequence parallelism): all-gather it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_compute(x)
        x = comm.copy_to(x, self.group) if self.seq_dim is None else comm.all_gather_to(x, self.group, self.seq_dim)
        y = F.linear(x, self.weight, self.bias)  # (.., out/p)
        if not self.gather_output or self.tp_size == 1:
            return y
        y = comm.gather_from(y, self.group, -1)  # (.., p * out/p), rank-major
        if self.packed > 1:  # rank-major [r][segment] -> segment-major [segment][r]
            y = y.unflatten(-1, (self.tp_size, self.packed, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"packed={self.packed}, gather_output={self.gather_output}, tp={self.tp_size}")


class ReplicatedKVLinear(ColumnLinear):
    """A key or value projection when ``tp`` is a multiple of the key/value heads (Megatron's rule for
    grouped-query attention): the weight is whole on every rank, and rank r computes only the head its
    query heads read, ``r // (tp / kv_heads)``. Each rank's weight gradient covers that head; the
    gradients are summed over ``tp`` (the copies of each head add up, the other rows add zeros), so every
    copy takes the same step. Replicated input and its gradient as :class:`ColumnLinear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None, head_dim: int,
                 device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._setup(tp_axes(group))
        self.in_features, self.out_features, self.head_dim = in_features, out_features, head_dim
        self.packed, self.gather_output = 1, False
        heads = out_features // head_dim
        if self.tp_size % heads:
            raise ValueError(f"{heads} key/value heads neither divide nor are divided by tp={self.tp_size}")
        head = self.tp_rank // (self.tp_size // heads)
        self.rows = slice(head * head_dim, (head + 1) * head_dim)
        w = self._cut("weight", (out_features, in_features))
        b = self._cut("bias", (out_features,)) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = to_compute(x)
        x = comm.copy_to(x, self.group) if self.seq_dim is None else comm.all_gather_to(x, self.group, self.seq_dim)
        w = comm.copy_to(self.weight, self.group)[self.rows]  # backward: the gradient summed over tp
        b = comm.copy_to(self.bias, self.group)[self.rows] if self.bias is not None else None
        return F.linear(x, w, b)  # (.., head_dim): this rank's head

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (rows {self.rows.start}:{self.rows.stop}), tp={self.tp_size}"


class KVColumn:
    """The 1D layer of a ``column_kv`` projection: :class:`ColumnLinear` where the key/value heads divide
    over ``tp``, :class:`ReplicatedKVLinear` where ``tp`` is a multiple of them."""

    @staticmethod
    def from_full(old, where, *, head_dim: int):
        heads = old.out_features // head_dim
        if heads % where.size("tp") == 0:
            return ColumnLinear.from_full(old, where)
        return ReplicatedKVLinear.from_full(old, where, head_dim=head_dim)


class RowLinear(_Tp, L.Linear):
    """Linear with W (out, in) split on the in dim: input features r of p, output summed over ranks.

    The bias is whole and added once, after the sum. ``input_is_parallel=False``
    takes a replicated input and keeps its own slice first.
    """

    role = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._setup(tp_axes(group))
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        w = self._cut("weight", (out_features, in_features), Cut(1))
        self._init_params({"weight": (w, "normal"), "bias": ((out_features,) if bias else None, "zeros")},
                          device, dtype)

    seq_dim: Optional[int] = None  # sequence-sharded output (Megatron sequence parallelism): reduce-scatter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to(to_compute(x), self.group, -1)
        if self.seq_dim is not None:  # (.., T/p, out): this rank's tokens, summed over ranks
            y = comm.reduce_scatter_to(F.linear(x, self.weight), self.group, self.seq_dim)
            return y + comm.copy_to(self.bias, self.group) if self.bias is not None else y  # bias grad: all tokens
        y = comm.reduce_from(F.linear(x, self.weight), self.group)  # (.., out) replicated
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"tp={self.tp_size}")


# ---------------------------------------------------------------- vocabulary


class VocabEmbedding(VocabParallel, _Tp, L.Embedding):
    """Embedding table (V, H) split on the vocab rows, padded to a multiple of p; also the tied LM head.

    Rank r holds padded rows [r Vp/p, (r+1) Vp/p); the real ones are
    [vocab_start, vocab_end). Lookups of ids outside that range give zero,
    and the ranks' results are summed (one all-reduce).
    """

    role = "vocab"

    def __init__(self, num_embeddings: int, dim: int, *, group=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._setup(tp_axes(group))
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._cut("weight", (num_embeddings, dim), Cut(0, pad=self.tp_size))
        self._set_vocab(w[0], self.tp_rank * w[0])
        self._init_params({"weight": (w, "normal")}, device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return comm.reduce_from(self._lookup(ids, self.weight), self.group)  # (.., H)

    # The tied head (``lm_outputs`` / ``lm_logits`` / ``lm_loss``): ``h @ W.T (+ bias)`` on the replicated h,
    # local (.., Vp/p) logits (``bias`` local: a VocabTensor's output), the loss vocab-parallel over tp.

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        return comm.copy_to(to_compute(h), self.group)  # backward: the input's gradient all-reduced

    def _head_group(self):
        return self.group

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (.., V) logits from local ones, padding cut."""
        return comm.gather_from(logits, self.group, -1)[..., :self.num_embeddings]


class VocabTensor(_Tp, L.LearnedTensor):
    """A learned tensor whose last dim is the vocabulary (BERT's MLM bias), split like VocabEmbedding."""

    role = "vocab"

    def __init__(self, *shape: int, group=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._setup(tp_axes(group))
        w = self._cut("weight", tuple(shape), Cut(-1, pad=self.tp_size))
        self._init_params({"weight": (w, "zeros")}, device, dtype)


# ---------------------------------------------------------------- traffic


class Costs(engine.Costs):
    """(forward, backward) bytes per rank of each 1D layer, for ``n`` rows (B T), on ``tp`` ranks."""

    def __init__(self, tp: int, dtype: torch.dtype = torch.float32, autocast: Optional[torch.dtype] = None) -> None:
        super().__init__(dtype, autocast)
        self.ar = 2 * (tp - 1) / tp  # an all-reduce sends this many times the tensor's bytes

    @classmethod
    def of(cls, plan, dtype=torch.float32, autocast=None) -> "Costs":
        return cls(plan.tp, dtype, autocast)

    def linear(self, role: str, k: int, o: int, n: int, *, dx: bool = True, gather_output: bool = False,
               input_is_parallel: bool = True) -> tuple:
        if role == "row":  # the output's all-reduce; a replicated input's gradient is gathered
            return self.ar * n * o * self.c, (0.0 if input_is_parallel or not dx else self.ar / 2 * n * k * self.c)
        return (self.ar / 2 * n * o * self.c if gather_output else 0.0), (self.ar * n * k * self.c if dx else 0.0)

    def lookup(self, v: int, h: int, n: int) -> tuple:
        return self.ar * n * h * self.b, 0.0

    def lm_loss(self, v: int, h: int, n: int, labels: int) -> tuple:
        """The tied head over ``n`` rows and the loss over ``labels`` rows (12 bytes of fp32 statistics each)."""
        return self.ar * 12 * labels, self.ar * n * h * self.c


def bytes_per_step(config, plan, batch: int, seq: int, *, dtype=torch.float32, autocast=None) -> float:
    """Bytes one rank sends in a GPT-shaped training step under 1D (:func:`.engine.step_bytes`)."""
    return step_bytes(Costs.of(plan, dtype, autocast), config, batch, seq)


# ---------------------------------------------------------------- whole models

STYLES = (
    # a column layer with no row sibling (ViT's patch projection) gathers its output back to replicated
    Style(("column", "column_qkv"), L.Linear, ColumnLinear,
          lambda s: {"packed": s.packed, "gather_output": no_row_sibling(s)}),
    Style(("column_kv",), L.Linear, KVColumn, lambda s: {"head_dim": s.model.config.head_dim}),
    Style(("row",), L.Linear, RowLinear),
    Style(("vocab",), L.Embedding, VocabEmbedding),
    Style(("vocab",), L.LearnedTensor, VocabTensor),
    Style(("norm", "embedding", "replicate", "experts"), ANY, None),  # whole on every rank (experts: over ep)
    Style(("head_norm",), ANY, HeadNorm, when=rms),  # whole, its gradient summed over tp (the ranks' heads)
)
MODE = Mode("1D", STYLES, tp_axes, Costs.of)


def shard_1d(model, spec, mesh_or_group):
    """:func:`.engine.parallelize_module` with the 1D table (``mesh_or_group``: a Mesh, a tp group or Axes)."""
    return parallelize_module(model, spec, MODE, tp_axes(mesh_or_group))
