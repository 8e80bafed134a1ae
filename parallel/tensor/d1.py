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
==================  ===========================  ====================================

Gradients of replicated parameters come out whole and identical on every rank
(their inputs and output grads are replicated), so no extra reduction is needed.

**Communication** per rank, in the convention of :mod:`cuboid.parallel.comm`
(ring all-reduce of n bytes = ``2 (p-1)/p * n``), for an activation of shape
(B, T, H) in dtype of b bytes, ``A = 2 (p-1)/p * B T H b``:

- ColumnLinear (in = H): forward 0; backward one all-reduce of the input's
  gradient, ``A`` (only when the input needs a gradient). With
  ``gather_output`` the forward also all-gathers the output:
  ``(p-1)/p * B T out b``.
- RowLinear (out = H): forward one all-reduce of the output, ``A``; backward 0.
  (``input_is_parallel=False`` adds a backward all-gather of the input grad,
  ``(p-1)/p * B T in b``.)
- a Column -> Row pair (MLP, attention): ``A`` forward + ``A`` backward, so a
  transformer block costs ``4 A`` per step (Megatron's 4 all-reduces).
- VocabEmbedding: forward ``A``; backward 0.
- lm_loss over N = B T rows: backward ``A`` (the head's input gradient);
  forward three fp32 statistics per row, all-reduced as one max of (N,) and
  one sum of (N, 2): ``2 (p-1)/p * 12 N`` bytes; backward of the loss is local.
  Full logits are never gathered.

**Padding.** A vocabulary V that does not divide p is padded to
``Vp = ceil(V/p) * p`` rows; the pad rows are zero, masked to -inf in the loss,
cut from gathered logits, and never appear in :meth:`full_tensor` or
checkpoints (their gradients are exactly zero, so they stay zero).

**Packed QKV.** The zoo's fused qkv weight is [W_q; W_k; W_v] on the output dim.
``ColumnLinear(packed=3)`` gives rank r the r-th 1/p of *each* segment, i.e.
whole heads of q, k and v, stored [q_r; k_r; v_r], so the attention code runs
its local heads unchanged. Its ``shard_slices`` is then a *list* of three slice
tuples (one per segment); :meth:`local_part` / :meth:`load_full` assemble the
local tensor from them, and :meth:`full_tensor_like` reorders the gathered
shards back to [W_q; W_k; W_v].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from cuboid.parallel import comm
from cuboid.parallel import layers as L

__all__ = ["ColumnLinear", "RowLinear", "VocabEmbedding", "VocabTensor", "vocab_parallel_cross_entropy",
           "shard_1d", "tp_sharded_params", "grad_norm_reducer"]


class _Group:
    """Holds a process group; deep copies of a model share it (groups cannot be copied)."""

    def __init__(self, group) -> None:
        self.group = group

    def __deepcopy__(self, memo):
        return self


@dataclass(frozen=True)
class _Split:
    dim: int           # the sharded dim of the full tensor
    full: int          # its full (unpadded) size
    parts: int = 1     # packed segments along dim, each split over the ranks
    pad: bool = False  # pad ``full`` up to a multiple of p (vocab); else it must divide


class _Sharded(L.ShardedModule):
    """The full-tensor interface for parameters split along one dim over the ``tp`` group."""

    _splits: dict  # name -> _Split; names not in it are replicated

    def _set_group(self, group) -> None:
        self._tp = _Group(group)
        self.tp_size, self.tp_rank = comm.group_size(group), comm.group_rank(group)
        self._splits, self._full_shapes = {}, {}

    @property
    def group(self):
        return self._tp.group

    def _local_len(self, s: _Split) -> int:
        p = self.tp_size
        if s.pad:
            return -(-s.full // p)
        if s.full % (s.parts * p):
            raise ValueError(f"{type(self).__name__}: size {s.full} does not split into {s.parts} segment(s) "
                             f"over {p} tensor-parallel ranks")
        return s.full // s.parts // p

    def _ranges(self, s: _Split) -> list[tuple[int, int]]:
        """The [start, stop) of the full tensor's dim that this rank holds, per segment (real rows only)."""
        n, r = self._local_len(s), self.tp_rank
        if s.pad:
            return [(min(r * n, s.full), min((r + 1) * n, s.full))]
        seg = s.full // s.parts
        return [(g * seg + r * n, g * seg + (r + 1) * n) for g in range(s.parts)]

    def _local_shape(self, full_shape, s: _Split) -> tuple:
        shape = list(full_shape)
        shape[s.dim] = self._local_len(s) * s.parts
        return tuple(shape)

    def _add_split(self, name: str, full_shape, dim: int, parts: int = 1, pad: bool = False) -> tuple:
        s = _Split(dim % len(full_shape), full_shape[dim], parts, pad)
        self._splits[name] = s
        self._full_shapes[name] = torch.Size(full_shape)
        return self._local_shape(full_shape, s)

    # ------------------------------------------------------------ ShardedModule

    def full_shape(self, name: str) -> torch.Size:
        return self._full_shapes.get(name) or super().full_shape(name)

    def shard_slices(self, name: str) -> Union[tuple, list]:
        """Slices of the full tensor held here: a tuple, or a list of tuples (one per packed segment).

        With padding the slice covers the real rows only (it may be empty); the
        local tensor is that slice followed by zero rows.
        """
        s = self._splits.get(name)
        if s is None:
            return super().shard_slices(name)
        shape = self.full_shape(name)
        out = [tuple(slice(a, b) if d == s.dim else slice(0, n) for d, n in enumerate(shape))
               for a, b in self._ranges(s)]
        return out[0] if s.parts == 1 else out

    def local_part(self, name: str, full: Any) -> torch.Tensor:
        """This rank's local tensor (packed, zero-padded) from a full tensor or a safetensors slice."""
        s = self._splits.get(name)
        if s is None:
            return torch.as_tensor(full[tuple(slice(0, n) for n in self.full_shape(name))])
        shape = list(self.full_shape(name))
        pieces = []
        for sl, (a, b) in zip(self._list_slices(name), self._ranges(s)):
            if b > a:
                pieces.append(torch.as_tensor(full[sl]))
        dtype = pieces[0].dtype if pieces else (full.dtype if isinstance(full, torch.Tensor) else torch.float32)
        device = full.device if isinstance(full, torch.Tensor) else None
        have = sum(p.shape[s.dim] for p in pieces)
        want = self._local_len(s) * s.parts
        if have < want:
            shape[s.dim] = want - have
            pieces.append(torch.zeros(shape, dtype=dtype, device=device))
        return torch.cat(pieces, s.dim) if len(pieces) > 1 else pieces[0]

    def _list_slices(self, name: str) -> list:
        sl = self.shard_slices(name)
        return sl if isinstance(sl, list) else [sl]

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one shaped like parameter ``name`` (its grad, its Adam state)."""
        s = self._splits.get(name)
        if s is None:
            return local.detach()
        shards = comm.all_gather_list(local.detach(), self.group)
        if s.parts > 1:
            segs = [t.chunk(s.parts, s.dim) for t in shards]
            shards = [segs[r][g] for g in range(s.parts) for r in range(len(shards))]
        full = torch.cat(shards, s.dim) if len(shards) > 1 else shards[0]
        return full.narrow(s.dim, 0, s.full)

    def full_tensor(self, name: str) -> torch.Tensor:
        return self.full_tensor_like(name, self._param(name))

    def norm_placement(self, name: str) -> Optional[L.Placement]:
        """Split parameters: their shards lie over the ``tp`` group; the rest are whole."""
        return L.Placement(self.group) if name in self._splits and self.tp_size > 1 else None

    def _init_params(self, specs: dict, device, dtype) -> None:
        """Create parameters (local shapes) and fill them from a N(0, 0.02)/zeros full tensor draw."""
        for name, (shape, kind) in specs.items():
            if shape is None:
                self.register_parameter(name, None)
                continue
            p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
            setattr(self, name, p)
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


def _copy_params(new: _Sharded, old: nn.Module) -> _Sharded:
    """Fill ``new`` from the full parameters of ``old`` (nothing to copy on meta)."""
    for name, p in old.named_parameters(recurse=False):
        q = new._param(name)
        q.requires_grad_(p.requires_grad)
        if p.device.type != "meta" and q.device.type != "meta":
            new.load_full(name, p.detach())
    new.role = old.role
    new.train(old.training)
    return new


# ---------------------------------------------------------------- linear layers


class ColumnLinear(_Sharded, L.Linear):
    """Linear with W (out, in) split on the out dim: replicated input, output features r of p.

    ``packed=3`` splits each of 3 stacked segments (fused QKV) separately.
    ``gather_output=True`` all-gathers the output into a replicated (.., out),
    in the full tensor's feature order.
    """

    role = "column"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None, packed: int = 1,
                 gather_output: bool = False, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_group(group)
        self.in_features, self.out_features = in_features, out_features
        self.packed, self.gather_output = packed, gather_output
        w = self._add_split("weight", (out_features, in_features), 0, packed)
        b = self._add_split("bias", (out_features,), 0, packed) if bias else None
        self._init_params({"weight": (w, "normal"), "bias": (b, "zeros")}, device, dtype)

    @classmethod
    def from_full(cls, linear: L.Linear, group, **kwargs) -> "ColumnLinear":
        w = linear.weight
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                  device="meta", dtype=w.dtype, **kwargs)
        return _copy_params(new.to_empty(device=w.device) if w.device.type != "meta" else new, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(comm.copy_to(x, self.group), self.weight, self.bias)  # (.., out/p)
        if not self.gather_output or self.tp_size == 1:
            return y
        y = comm.gather_from(y, self.group, -1)  # (.., p * out/p), rank-major
        if self.packed > 1:  # rank-major [r][segment] -> segment-major [segment][r]
            y = y.unflatten(-1, (self.tp_size, self.packed, -1)).transpose(-3, -2).flatten(-3)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
                f"packed={self.packed}, gather_output={self.gather_output}, tp={self.tp_size}")


class RowLinear(_Sharded, L.Linear):
    """Linear with W (out, in) split on the in dim: input features r of p, output summed over ranks.

    The bias is whole and added once, after the sum. ``input_is_parallel=False``
    takes a replicated input and keeps its own slice first.
    """

    role = "row"

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_group(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        w = self._add_split("weight", (out_features, in_features), 1)
        self._init_params({"weight": (w, "normal"), "bias": ((out_features,) if bias else None, "zeros")},
                          device, dtype)

    from_full = classmethod(ColumnLinear.from_full.__func__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_to(x, self.group, -1)
        y = comm.reduce_from(F.linear(x, self.weight), self.group)  # (.., out) replicated
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
                f"tp={self.tp_size}")


# ---------------------------------------------------------------- vocabulary


class VocabEmbedding(_Sharded, L.Embedding):
    """Embedding table (V, H) split on the vocab rows, padded to a multiple of p; also the tied LM head.

    Rank r holds padded rows [r Vp/p, (r+1) Vp/p); the real ones are
    [vocab_start, vocab_end). Lookups of ids outside that range give zero,
    and the ranks' results are summed (one all-reduce).
    """

    role = "vocab"

    def __init__(self, num_embeddings: int, dim: int, *, group=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_group(group)
        self.num_embeddings, self.dim = num_embeddings, dim
        w = self._add_split("weight", (num_embeddings, dim), 0, pad=True)
        self.vocab_start, self.vocab_end = self._ranges(self._splits["weight"])[0]
        self.local_vocab = w[0]
        self._init_params({"weight": (w, "normal")}, device, dtype)

    @classmethod
    def from_full(cls, emb: L.Embedding, group) -> "VocabEmbedding":
        w = emb.weight
        new = cls(emb.num_embeddings, emb.dim, group=group, device="meta", dtype=w.dtype)
        return _copy_params(new.to_empty(device=w.device) if w.device.type != "meta" else new, emb)

    @property
    def local_start(self) -> int:
        """First (padded) vocab index held here."""
        return self.tp_rank * self.local_vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and not ids.is_meta and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"ids must lie in [0, {self.num_embeddings}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        local = ids - self.local_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (.., H)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_from(out, self.group)

    def lm_logits(self, h: torch.Tensor, bias: Optional[torch.Tensor] = None, gather: bool = True) -> torch.Tensor:
        """Tied head ``h @ W.T (+ bias)``: full (.., V) logits (gathered, padding cut) or local (.., Vp/p).

        ``bias`` is local (a :class:`VocabTensor`'s output). Training should use
        :meth:`lm_loss`, which never gathers.
        """
        logits = F.linear(comm.copy_to(h, self.group), self.weight, bias)  # (.., Vp/p)
        if not gather:
            return logits
        return comm.gather_from(logits, self.group, -1)[..., :self.num_embeddings]

    def lm_loss(self, h: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor] = None,
                ignore_index: int = -100) -> torch.Tensor:
        """Mean cross-entropy of the tied head's logits for ``h`` (.., H) against ``labels`` (..)."""
        return self.loss_from_logits(self.lm_logits(h, bias, gather=False), labels, ignore_index)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Vocab-parallel cross-entropy of local (.., Vp/p) logits; never gathers them."""
        return vocab_parallel_cross_entropy(logits, labels, self.group, self.local_start, self.num_embeddings,
                                            ignore_index)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full (.., V) logits from local ones, padding cut."""
        return comm.gather_from(logits, self.group, -1)[..., :self.num_embeddings]

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (local {self.local_vocab}, rows {self.vocab_start}:{self.vocab_end}), "
                f"{self.dim}, tp={self.tp_size}")


class VocabTensor(_Sharded, L.Tensor):
    """A learned tensor whose last dim is the vocabulary (BERT's MLM bias), split like VocabEmbedding."""

    role = "vocab"

    def __init__(self, *shape: int, group=None, device=None, dtype=None) -> None:
        L.ShardedModule.__init__(self)
        self._set_group(group)
        w = self._add_split("weight", tuple(shape), -1, pad=True)
        self._init_params({"weight": (w, "zeros")}, device, dtype)

    @classmethod
    def from_full(cls, t: L.Tensor, group) -> "VocabTensor":
        w = t.weight
        new = cls(*w.shape, group=group, device="meta", dtype=w.dtype)
        return _copy_params(new.to_empty(device=w.device) if w.device.type != "meta" else new, t)


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
        e.div_(stats[:, :1])  # softmax, (N, Vp/p)
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


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group, start: int,
                                 vocab_size: int, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy (``ignore_index`` skipped, NaN if all are) of logits split on the vocab dim.

    ``local_logits`` (.., Vl) are columns [start, start + Vl) of the full logits;
    columns at or past ``vocab_size`` (padding) are ignored. Every rank returns
    the same loss; no rank ever holds the full (.., V) logits.
    """
    vl = local_logits.shape[-1]
    logits = local_logits.reshape(-1, vl)
    labels = labels.reshape(-1).to(torch.long)
    if labels.shape[0] != logits.shape[0]:
        raise ValueError(f"cross_entropy: {labels.shape[0]} labels for {logits.shape[0]} rows of logits")
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if not labels.is_meta and bool(bad.any()):
        raise IndexError(f"cross_entropy: label {int(labels[bad][0])} outside [0, {vocab_size})")
    total = _VocabParallelCE.apply(logits, labels, group, start, vocab_size, ignore_index)
    return total / (labels != ignore_index).sum()


# ---------------------------------------------------------------- whole models


def _has_row_sibling(spec, path: str, model: nn.Module) -> bool:
    parent = path.rpartition(".")[0]
    mod = model.get_submodule(parent) if parent else model
    return any(spec.role_of(f"{parent}.{n}" if parent else n) == "row" for n, _ in mod.named_children())


def shard_1d(model: nn.Module, spec, mesh_or_group) -> nn.Module:
    """Replace the layers named by ``spec`` with their 1D counterparts, in place; returns ``model``.

    Roles: ``column`` / ``column_qkv`` (packed=3) -> :class:`ColumnLinear`
    (gathering its output when its parent module has no ``row`` layer, as
    ViT's patch embedding); ``row`` -> :class:`RowLinear`; ``vocab`` ->
    :class:`VocabEmbedding` (an Embedding) or :class:`VocabTensor` (a Tensor);
    ``norm``, ``embedding``, ``replicate`` stay whole. A materialised model's
    weights are sliced into the new layers; a meta model stays on meta
    (``to_empty`` then ``init_weights`` fill it through ``load_full``).
    ``mesh_or_group`` is a Mesh (its ``tp`` group) or a process group.
    """
    group = mesh_or_group.group("tp") if hasattr(mesh_or_group, "group") else mesh_or_group
    for path, mod in list(model.named_modules()):
        role = spec.role_of(path) if path else None
        if role is None:
            continue
        if role in ("column", "column_qkv", "row") and type(mod) is L.Linear:
            if role == "row":
                new = RowLinear.from_full(mod, group)
            else:
                new = ColumnLinear.from_full(mod, group, packed=3 if role == "column_qkv" else 1,
                                             gather_output=not _has_row_sibling(spec, path, model))
        elif role == "vocab" and type(mod) is L.Embedding:
            new = VocabEmbedding.from_full(mod, group)
        elif role == "vocab" and type(mod) is L.Tensor:
            new = VocabTensor.from_full(mod, group)
        elif role in ("norm", "embedding", "replicate") and isinstance(mod, L.ShardedModule):
            mod.role = role
            continue
        elif isinstance(mod, _Sharded):
            continue  # already sharded
        else:
            raise TypeError(f"{path}: role {role!r} does not apply to a {type(mod).__name__} in 1D tensor parallelism")
        new.role = role
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model


def tp_sharded_params(model: nn.Module) -> set[int]:
    """ids of the parameters of ``model`` that are split over tp (the rest are replicated)."""
    return {id(p) for mod in model.modules() if isinstance(mod, _Sharded)
            for name, p in mod.named_parameters(recurse=False) if name in mod._splits}


def grad_norm_reducer(model: nn.Module, params, group):
    """A ``norm_reducer`` for :func:`cuboid.parallel.optim.clip_grad_norm_` (``params``, same list):

    sums the squared norms of tp-split parameters over ``group``, so the global
    norm is the single-device one; replicated parameters are counted once.
    """
    params, split = list(params), tp_sharded_params(model)

    def reduce(sq: torch.Tensor) -> torch.Tensor:
        with_grad = [p for p in params if p.grad is not None]
        mask = torch.tensor([id(p) in split for p in with_grad], dtype=torch.bool, device=sq.device)
        part = sq[:, mask].contiguous()
        comm.all_reduce_(part, group)
        sq = sq.clone()
        sq[:, mask] = part
        return sq

    return reduce
