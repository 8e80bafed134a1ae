"""The one base under every tensor mode: named axes, cuts, and the sharded-layer machinery.

A tensor-parallel layer holds *pieces* of single-device parameters. Where the
pieces lie is said by two small objects, the same in every mode:

- :class:`Axes`: the tensor axes of this rank, each a (process group, size,
  index): 1D has ``tp``; the 2D / 2.5D grid and the 3D cube have ``tp_row``,
  ``tp_col`` and ``tp_dep`` (the mesh's groups of those names). ``shard``
  names the axes (major first) whose ranks together hold every distinct
  piece, and ``shard_group`` is their joint group (1D: ``tp``; 2D / 2.5D: the
  q x q plane of this depth; 3D: the whole cube).
  ``tensor_group`` is the group of every tensor rank (each holds a distinct
  piece of a block's activations: batch rows, heads; 2.5D: the plane and the
  depth together), over which a whole parameter used on those pieces sums
  its gradient (:class:`HeadNorm`).
- :class:`Cut`: one dim of a parameter cut over one or more axes (piece index
  = the axes' indices read as digits, major first), optionally made of
  ``parts`` packed segments cut alike (fused QKV), optionally padded.
  **One padding rule**: the dim is padded up to a multiple of ``pad`` (a
  vocabulary: ``pad`` = the number of pieces its rows or logits are split
  into), and the padded size must split into ``parts * pieces`` equal
  lengths, else a ``ValueError`` names the layer and the dim. Pad rows are
  zero in the local tensor and absent from every full tensor.

:class:`Sharded` implements the single-device full-tensor interface of
:class:`cuboid.parallel.layers.ShardedModule` once for any set of cuts:
``full_shape``, ``shard_slices`` (a list of slice tuples when a parameter
holds several pieces, e.g. packed segments), ``local_part`` / ``load_full``
(from a tensor or a safetensors slice, reading only this rank's pieces),
``full_tensor`` / ``full_tensor_like`` (one all-gather over ``shard_group``)
and ``norm_placement`` (:class:`~cuboid.parallel.layers.Placement` of the
shard group and the number of its ranks holding each piece; None for whole
parameters). Every mode's layers are thin users of it: they declare their
cuts in ``__init__`` and write ``forward``.

Also here, for every mode's table: :class:`HeadNorm` (the ``head_norm``
role) and :func:`rms_offset` (the ``c`` of a norm scaling by ``c + weight``:
Gemma's), and for every mode's forward: :func:`to_compute` (under autocast a
tensor bound for a matmul is cast to the autocast dtype *before* it is
gathered, so bf16 runs move 2-byte tensors), the vocab-parallel
cross-entropy and the :class:`VocabParallel` table (lookup and tied head).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.parallel import comm
from cuboid.parallel import layers as L
from cuboid.parallel.head import flat_rows, mean_of

__all__ = ["Axes", "Cut", "Sharded", "VocabParallel", "HeadNorm", "rms_offset", "to_compute", "compute_dtype",
           "check_ids", "vocab_parallel_cross_entropy", "vocab_parallel_ce_sum"]


class Axes:
    """This rank's tensor axes: name -> (group, size, index); deep copies of a model share it.

    ``shard``: the axes (major first) over which a cut parameter's distinct
    pieces lie; ``shard_group``: their joint process group, whose rank is the
    indices along ``shard`` read as mixed-radix digits. Sizes and indices are
    kept apart from the groups, so a layout-only mesh (no groups) still gives
    sharded shapes. Unknown axes have size 1, index 0 and no group.
    """

    def __init__(self, axes: dict, shard: tuple, shard_group=None, tensor_group=None) -> None:
        self.axes = {a: tuple(v) for a, v in axes.items()}
        self.shard, self.shard_group = tuple(shard), shard_group
        self.tensor_group = shard_group if tensor_group is None else tensor_group

    @classmethod
    def of_mesh(cls, mesh, names: tuple, shard: Optional[tuple] = None, shard_group=None) -> "Axes":
        """The axes ``names`` of a :class:`~cuboid.parallel.Mesh` (its groups, sizes and coordinates)."""
        return cls({a: (mesh.group(a), mesh.size(a), mesh.coords.get(a, 0)) for a in names},
                   names if shard is None else shard, shard_group)

    def group(self, name: str):
        return self.axes[name][0] if name in self.axes else None

    def size(self, name: str) -> int:
        return self.axes[name][1] if name in self.axes else 1

    def index(self, name: str) -> int:
        return self.axes[name][2] if name in self.axes else 0

    @property
    def shard_size(self) -> int:
        return math.prod(self.size(a) for a in self.shard)

    def coords(self) -> dict:
        return {a: v[2] for a, v in self.axes.items()}

    def coords_of(self, t: int) -> dict:
        """The indices of rank ``t`` of ``shard_group`` (axes outside ``shard``: this rank's)."""
        out = self.coords()
        for a in reversed(self.shard):
            out[a], t = t % self.size(a), t // self.size(a)
        return out

    def all_gather(self, t: torch.Tensor) -> list:
        """Every ``shard_group`` rank's ``t``, in that group's rank order: one all-gather over it (or, when
        only the axes' own groups are known, one per shard axis, minor first)."""
        if self.shard_group is not None or self.shard_size == 1:
            return comm.all_gather_list(t, self.shard_group)
        x = t.unsqueeze(0)
        for a in reversed(self.shard):
            x = torch.stack(comm.all_gather_list(x.contiguous(), self.group(a)))
        return list(x.reshape(-1, *t.shape).unbind(0))

    def pieces(self, names: tuple) -> int:
        """How many pieces a cut over ``names`` makes."""
        return math.prod(self.size(a) for a in names)

    def piece(self, names: tuple, coords: dict) -> int:
        """The piece of a cut over ``names`` held at ``coords``: indices as digits, major first."""
        idx = 0
        for a in names:
            idx = idx * self.size(a) + coords.get(a, 0)
        return idx

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={v[2]}/{v[1]}" for a, v in self.axes.items())
        return f"{type(self).__name__}({inner})"


@dataclass(frozen=True)
class Cut:
    """One dim of a parameter cut over ``axes`` (major first), in ``parts`` packed segments, padded to ``pad``."""

    dim: int                 # the cut dim of the full tensor (negative counts from the end)
    axes: tuple = ("tp",)    # the axes whose indices number the pieces, major first
    parts: int = 1           # packed segments along dim, each cut alike ([W_q; W_k; W_v]: 3)
    pad: int = 1             # pad the dim up to a multiple of this (vocabularies); 1: no padding


def compute_dtype(t: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype for ``t``'s device when autocast is on there, else None."""
    try:
        dev = t.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except (RuntimeError, ValueError, TypeError):  # a device autocast does not know (meta)
        return None


def to_compute(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` in the autocast dtype when autocast is on and ``t`` is a float of another dtype.

    Called on a weight or activation bound for a matmul *before* it is
    gathered: the matmul would cast it anyway, so values are unchanged and the
    collective moves the narrower tensor (its backward moves the gradient in
    that dtype too; the cast's own backward restores the parameter's dtype).
    Tensors used in fp32 (norm weights, embedding lookups, loss statistics) are
    left alone.
    """
    if t is None or not t.is_floating_point():
        return t
    dt = compute_dtype(t)
    return t.to(dt) if dt is not None and dt != t.dtype else t


def check_ids(ids: torch.Tensor, n: int) -> None:
    if ids.numel() and not ids.is_meta and (int(ids.min()) < 0 or int(ids.max()) >= n):
        raise IndexError(f"ids must lie in [0, {n}), got min {int(ids.min())}, max {int(ids.max())}")


def _ctor_args(cls, old: nn.Module) -> tuple:
    """The positional constructor arguments of ``cls`` that describe single-device layer ``old``."""
    if issubclass(cls, L.Linear):
        return old.in_features, old.out_features, old.bias is not None
    if issubclass(cls, L.Embedding):
        return old.num_embeddings, old.dim
    if issubclass(cls, L.LayerNorm):  # an RMSNorm source has no bias
        return old.dim, old.eps, getattr(old, "bias", None) is not None
    return tuple(old.weight.shape)  # a LearnedTensor


class Sharded(L.ShardedModule):
    """Base of every tensor-parallel layer: parameters cut by :class:`Cut` over the layer's :class:`Axes`.

    A subclass calls :meth:`_setup` with its axes, declares each parameter
    with :meth:`_cut` (full shape and cuts; no cut: whole on every rank) and
    creates it with :meth:`_init_params`. ``_where`` names the constructor
    keyword the mode's layers take their axes by (``group``, ``grid``,
    ``mesh``), so :meth:`from_full` builds any of them.
    """

    _where = "axes"

    def _setup(self, axes: Axes) -> None:
        self.axes = axes
        self._cuts: dict = {}        # name -> tuple of Cut (dims normalised); absent: whole
        self._full_shapes: dict = {}

    # ------------------------------------------------------------ cuts

    def _cut(self, name: str, full_shape, *cuts: Cut) -> tuple:
        """Register parameter ``name``'s full shape and cuts; returns its local shape."""
        full_shape = tuple(full_shape)
        cuts = tuple(replace(c, dim=c.dim % len(full_shape)) for c in cuts)
        self._cuts[name] = cuts
        self._full_shapes[name] = torch.Size(full_shape)
        shape = list(full_shape)
        for c in cuts:
            shape[c.dim] = self._lengths(name, c, full_shape[c.dim])[1] * c.parts
        return tuple(shape)

    def _lengths(self, name: str, c: Cut, full: int) -> tuple[int, int]:
        """(padded segment length, piece length) of cut ``c`` of a dim of ``full`` elements."""
        pieces, padded = self.axes.pieces(c.axes), -(-full // c.pad) * c.pad
        if padded % (c.parts * pieces):
            raise ValueError(f"{type(self).__name__}.{name}: dim {c.dim} of size {full} does not split into "
                             f"{c.parts} segment(s) over {pieces} ranks of {' x '.join(c.axes)}")
        return padded // c.parts, padded // c.parts // pieces

    def _pieces(self, name: str, coords: dict) -> list:
        """[(full slices, local slices)] of the pieces of ``name`` held at ``coords``: real (unpadded) rows only."""
        shape = self.full_shape(name)
        spans = []  # per cut: [(dim, full start, full stop, local start)], one per packed segment
        for c in self._cuts[name]:
            full = shape[c.dim]
            seg, n = self._lengths(name, c, full)
            at = self.axes.piece(c.axes, coords) * n
            spans.append([(c.dim, min(g * seg + at, full), min(g * seg + at + n, full), g * n)
                          for g in range(c.parts)])
        out = []
        for combo in itertools.product(*spans):
            fsl = [slice(0, s) for s in shape]
            lsl = list(fsl)
            for dim, a, b, at in combo:
                fsl[dim], lsl[dim] = slice(a, b), slice(at, at + b - a)
            out.append((tuple(fsl), tuple(lsl)))
        return out

    def _local_shape(self, name: str) -> tuple:
        shape = list(self.full_shape(name))
        for c in self._cuts.get(name, ()):
            shape[c.dim] = self._lengths(name, c, shape[c.dim])[1] * c.parts
        return tuple(shape)

    def replicas(self, name: str) -> int:
        """How many ranks of ``shard_group`` hold the same piece of parameter ``name``."""
        return self.axes.shard_size // math.prod(self.axes.pieces(c.axes) for c in self._cuts.get(name, ()))

    # ------------------------------------------------------------ ShardedModule

    def full_shape(self, name: str) -> torch.Size:
        return self._full_shapes.get(name) or super().full_shape(name)

    def shard_slices(self, name: str) -> Union[tuple, list]:
        """Slices of the full tensor held here: a tuple, or a list of tuples (one per piece, e.g. packed segment).

        Along a padded dim a slice covers real rows only (it may be empty); the
        local tensor holds them, then zero rows.
        """
        if not self._cuts.get(name):
            return super().shard_slices(name)
        out = [f for f, _ in self._pieces(name, self.axes.coords())]
        return out[0] if len(out) == 1 else out

    def local_part(self, name: str, full: Any) -> torch.Tensor:
        """This rank's local tensor (packed, zero-padded) from a full tensor or a safetensors slice."""
        if not self._cuts.get(name):
            return torch.as_tensor(full[tuple(slice(0, n) for n in self.full_shape(name))])
        shape = self._local_shape(name)
        pieces = [(lsl, torch.as_tensor(full[fsl])) for fsl, lsl in self._pieces(name, self.axes.coords())
                  if all(s.stop > s.start for s in fsl)]
        if len(pieces) == 1 and tuple(pieces[0][1].shape) == shape:
            return pieces[0][1]
        is_t = isinstance(full, torch.Tensor)
        dtype = pieces[0][1].dtype if pieces else (full.dtype if is_t else torch.float32)
        device = pieces[0][1].device if pieces else (full.device if is_t else None)
        out = torch.zeros(shape, dtype=dtype, device=device)
        for lsl, piece in pieces:
            out[lsl] = piece
        return out

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one shaped like parameter ``name`` (its grad, its Adam state).

        A collective over ``shard_group``: every rank of it calls this, in the same order.
        """
        if not self._cuts.get(name):
            return local.detach()
        shards = self.axes.all_gather(local.detach())
        full = torch.zeros(self.full_shape(name), dtype=local.dtype, device=local.device)
        for t, shard in enumerate(shards):  # (a single shard: no groups, this rank's pieces only)
            for fsl, lsl in self._pieces(name, self.axes.coords_of(t) if len(shards) > 1 else self.axes.coords()):
                full[fsl] = shard[lsl]
        return full

    def full_tensor(self, name: str) -> torch.Tensor:
        return self.full_tensor_like(name, self.local_tensor(name))

    def norm_placement(self, name: str) -> Optional[L.Placement]:
        """Cut parameters: pieces over ``shard_group``, each on ``replicas(name)`` of its ranks; whole ones: None."""
        copies = self.replicas(name)
        return None if copies == self.axes.shard_size else L.Placement(self.axes.shard_group, copies)

    # ------------------------------------------------------------ construction

    def _init_params(self, specs: dict, device, dtype) -> None:
        """Create parameters ``{name: (local shape or None, "normal" | "ones" | "zeros")}`` and fill them
        from a full N(0, 0.02) / ones / zeros tensor (nothing to fill on meta)."""
        for name, (shape, _) in specs.items():
            if shape is None:
                self.register_parameter(name, None)
            else:
                setattr(self, name, nn.Parameter(torch.empty(shape, device=device, dtype=dtype)))
        self.tag_placements()
        if any(p.device.type == "meta" for p in self.parameters(recurse=False)):
            return
        for name, (shape, kind) in specs.items():
            if shape is not None:
                full = torch.zeros(self.full_shape(name))
                if kind == "normal":
                    full.normal_(0.0, 0.02)
                elif kind == "ones":
                    full.fill_(1.0)
                self.load_full(name, full)

    @classmethod
    def from_full(cls, old: nn.Module, where, **kwargs):
        """The layer for single-device ``old`` on ``where`` (the mode's group / grid / mesh), holding this
        rank's pieces of ``old``'s parameters; a meta ``old`` gives a meta layer."""
        w = old.weight
        new = cls(*_ctor_args(cls, old), **{cls._where: where}, device="meta", dtype=w.dtype, **kwargs)
        if w.device.type != "meta":
            new = new.to_empty(device=w.device)
        for name, p in old.named_parameters(recurse=False):
            q = new._param(name)
            q.requires_grad_(p.requires_grad)
            if p.device.type != "meta" and q.device.type != "meta":
                new.load_full(name, p.detach())
        new.role = kwargs.get("role", old.role)
        return new.train(old.training)


# ---------------------------------------------------------------- norms


class HeadNorm:
    """The layer of a ``head_norm`` in every mode: a norm over each attention head's features (Qwen3's and
    Gemma 3's q/k norms), applied after the head-split q/k projections.

    Every mode splits the heads (1D), or the heads and the batch rows (2D, 2.5D, 3D), over its tensor ranks, so
    each rank normalises a distinct piece of q and k with the whole (head_dim,) weight. The module stays itself,
    whole on every rank (an :class:`~L.RMSNorm` or a subclass such as Gemma's), with its ``seq_group`` (the
    group its forward enters with ``comm.copy_to``) set to the axes' ``tensor_group``: its weight's gradient is
    summed over every piece, as one device's is, and every copy takes the same step. Megatron's sequence split
    sets the same group on it (1D), so the sum is taken once.
    """

    @staticmethod
    def from_full(old: nn.Module, where: Axes) -> nn.Module:
        if where.tensor_group is None and any(where.group(a) is not None and where.size(a) > 1 for a in where.axes):
            raise ValueError("a head_norm sums its gradient over every tensor rank: build the layers on the mesh, "
                             "or give the Grid its tp group")
        old.seq_group = where.tensor_group
        return old


def rms_offset(norm: nn.Module) -> float:
    """The constant ``c`` of an RMS norm computing ``normed(x) * (c + weight)``: the class's ``offset`` (0 for
    :class:`~L.RMSNorm`, 1 for Gemma's, whose stored weight 0 scales by 1). The 2D, 2.5D and 3D norms compute
    it so (their ``offset``). A subclass that computes its own forward must state its ``offset``; one that does
    not is a ``TypeError``: no mode can shard a form it does not know."""
    for cls in type(norm).__mro__:
        if "offset" in vars(cls):
            return float(cls.offset)
        if "forward" in vars(cls):
            raise TypeError(f"{type(norm).__name__} is not an RMS norm the tensor modes can shard: it computes its "
                            "own forward without stating its offset c of normed(x) * (c + weight)")
    raise TypeError(f"{type(norm).__name__} is not an RMS norm")


# ---------------------------------------------------------------- vocabulary


class _VocabParallelCE(torch.autograd.Function):
    """Sum over rows of cross-entropy of vocab-split logits; statistics in fp32, backward local."""

    @staticmethod
    def forward(ctx, logits, labels, group, start: int, vocab: int, ignore_index: int):
        n_local = logits.shape[-1]
        x = logits.float()
        cols = torch.arange(start, start + n_local, device=x.device)
        x = x.masked_fill(cols >= vocab, float("-inf"))  # padding never wins
        m = x.max(-1).values  # (N,)
        comm.all_reduce_(m, group, "max")
        x = x - m.unsqueeze(-1)
        valid = labels != ignore_index
        local = labels - start
        here = valid & (local >= 0) & (local < n_local)
        idx = local.clamp(0, n_local - 1).unsqueeze(-1)
        target = torch.where(here, x.gather(-1, idx).squeeze(-1), torch.zeros_like(m))
        e = x.exp_()
        stats = torch.stack([e.sum(-1), target], -1)  # (N, 2)
        comm.all_reduce_(stats, group, "sum")
        rows = torch.where(valid, stats[:, 0].log() - stats[:, 1], torch.zeros_like(m))
        e.div_(stats[:, :1])  # softmax, (N, Vl)
        ctx.save_for_backward(e, idx, here, valid)
        ctx.dtype = logits.dtype
        return rows.sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, idx, here, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, idx, -here.to(g.dtype).unsqueeze(-1))
        g.mul_(valid.to(g.dtype).unsqueeze(-1) * grad)
        return g.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_ce_sum(local_logits: torch.Tensor, labels: torch.Tensor, group, start: int, vocab_size: int,
                          ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of cross-entropy over rows, number of counted rows) of logits split on the vocab dim over ``group``.

    ``local_logits`` (.., Vl) are columns [start, start + Vl) of the full
    logits; columns at or past ``vocab_size`` (padding) are ignored; rows whose
    label is ``ignore_index`` count for nothing. Traffic: one all-reduce of an
    fp32 max (N,) and one of fp32 sums (N, 2) over ``group``; backward is local.
    """
    logits, labels = flat_rows(local_logits, labels, vocab_size, ignore_index)
    total = _VocabParallelCE.apply(logits, labels, group, start, vocab_size, ignore_index)
    return total, (labels != ignore_index).sum()


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group, start: int,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (``ignore_index`` skipped, NaN if all are) of logits split on the vocab dim.

    Every rank returns the same loss; no rank ever holds the full (.., V) logits.
    """
    total, count = vocab_parallel_ce_sum(local_logits, labels, group, start, vocab_size, ignore_index)
    return mean_of(total, count)


class VocabParallel:
    """Mixin of the vocab-parallel token table of every mode (lookup and tied LM head).

    This rank's table rows (once gathered as the mode requires) are the padded
    vocabulary rows [local_start, local_start + local_vocab); the real ones
    are [vocab_start, vocab_end). They are also the columns of its local
    logits, so the loss never gathers the logits.
    """

    def _set_vocab(self, local_vocab: int, local_start: int) -> None:
        self.local_vocab, self.local_start = local_vocab, local_start
        self.vocab_start = min(local_start, self.num_embeddings)
        self.vocab_end = min(local_start + local_vocab, self.num_embeddings)

    def _lookup(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of ``table`` (this rank's vocab block) for ``ids``; zero where an id lies in another block."""
        check_ids(ids, self.num_embeddings)
        local = ids - self.local_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), table)  # (.., H): a partial sum over vocab blocks
        return out.masked_fill(outside.unsqueeze(-1), 0.0)

    def _ce_sum(self, logits: torch.Tensor, labels: torch.Tensor, group, ignore_index: int):
        return vocab_parallel_ce_sum(logits, labels, group, self.local_start, self.num_embeddings, ignore_index)

    # The head (``lm_outputs``, ``lm_logits``: :class:`cuboid.parallel.head.TiedHead`) over the mode's hooks:
    # ``_head_input`` (h copied or gathered into the head's rows), ``_head_weight`` (the local vocab table),
    # ``_head_group`` (the vocab slices' group), ``_head_mean`` (the mean over the mode's batch layout).

    def _vocab_slice(self) -> tuple:
        return self.local_start, self.num_embeddings

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of local logits (``lm_logits(gather=False)``) against labels laid out as their
        rows; vocab-parallel, never gathering them. Every rank returns the same loss (NaN if every label of
        the batch is ignored)."""
        return self._head_mean(*self._ce_sum(logits, labels, self._head_group(), ignore_index))

    def lm_loss(self, h: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the tied head's logits for ``h`` against ``labels`` (laid out as ``h``'s
        rows) through the fused linear cross-entropy (``lm_outputs``): vocab-parallel, a chunk of rows at a
        time, never holding the logits. Every rank returns the same loss."""
        return self.lm_outputs(h, labels, bias, ignore_index=ignore_index)[0]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {tuple(self.weight.shape)}, rows {self.vocab_start}:{self.vocab_end}),"
                f" {self.dim}, {self.axes}")
