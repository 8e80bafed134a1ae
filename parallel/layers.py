"""The layers the zoo is built from, on one device.

Each layer is a plain ``nn.Module`` that calls the kernels beneath it, plus the
small interface every parallel mode needs (:class:`ShardedModule`):

- ``role``: what the layer *is* (``column``, ``row``, ``vocab``, ``norm``,
  ``replicate``), assigned from the model's sharding spec, never from model
  code;
- ``full_shape(name)`` / ``shard_slices(name)``: the shape of a parameter's full
  (unsharded) tensor and which slice of it this rank holds;
- ``full_tensor(name)``: the full tensor, gathered where it is sharded (a
  collective under the tensor modes: every rank calls it in the same order);
  ``full_tensor_like(name, local)`` does the same for a tensor shaped like the
  parameter (its gradient, its optimizer state);
- ``load_full(name, full)``: copy this rank's slice in from a full tensor, or
  from anything indexable by ``shard_slices`` (a safetensors ``get_slice``
  object), so a rank reads only what it owns; ``local_part(name, full)``
  returns that slice without copying it in.

On one device a shard is the whole tensor. The tensor modes subclass these
layers and override the four methods, so checkpoints and initialisation work
the same under every plan.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

import cuboid.kernels as kernels
from cuboid.parallel import comm
from cuboid.parallel.head import TiedHead, cross_entropy
from cuboid.parallel.mask import Mask

ROLES = ("column", "column_qkv", "column_kv", "row", "vocab", "norm", "replicate", "embedding")


@dataclass(frozen=True, eq=False)
class Placement:
    """Where the pieces of a sharded parameter live, as far as norms are concerned.

    ``group``: the process group over which the parameter's distinct shards
    lie (a squared norm sums over it); ``copies``: how many ranks of that group
    hold each shard (the sum is divided by it). A parameter without a
    placement is whole on every rank that holds it. Every cuboid layer sets
    ``param.placement`` on its parameters (again after ``to``/``to_empty``,
    which make new parameter objects), so optimizers, clipping and checkpoints
    find it from the parameter alone.
    """

    group: Any
    copies: int = 1


def placement_of(param: torch.Tensor) -> Optional[Placement]:
    """The :class:`Placement` a cuboid layer gave ``param`` (None: whole on every rank)."""
    return getattr(param, "placement", None)


@dataclass(frozen=True)
class LayerRef:
    """The cuboid layer that holds a parameter, and the parameter's name there: an optimizer that needs the
    whole tensor (Muon's orthogonalisation) reaches the layer's full-tensor interface from the parameter alone.
    The layer is held weakly (a parameter must not keep its module alive)."""

    layer: Any   # weakref.ref to the ShardedModule
    name: str


def layer_of(param: torch.Tensor) -> Optional[tuple]:
    """``(layer, name)`` of the cuboid layer holding ``param`` (None: not a cuboid layer's, or the layer is gone)."""
    ref = getattr(param, "layer_ref", None)
    layer = ref.layer() if ref is not None else None
    return None if layer is None else (layer, ref.name)


def to_empty(module: nn.Module, device) -> nn.Module:
    """``module.to_empty(device=device)``: every parameter and buffer allocated, uninitialised, on ``device``
    with its shape, strides and dtype. A plain dense tensor's ``empty_like`` is its ``empty_strided``, which
    skips the Python reference path ``empty_like`` of a meta tensor takes; tensor subclasses (a DTensor) and
    other layouts take ``empty_like``."""
    def empty(t: torch.Tensor) -> torch.Tensor:
        if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and t.is_contiguous():
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    return module._apply(empty)


class ShardedModule(nn.Module):
    """Mixin: the full-tensor interface of a layer whose parameters may be sharded."""

    role: str = "replicate"

    def norm_placement(self, name: str) -> Optional[Placement]:
        """The :class:`Placement` of parameter ``name`` (None on one device: it is whole)."""
        return None

    def tag_placements(self) -> None:
        """Set ``placement`` on this layer's own parameters (see :class:`Placement`)."""
        seen = set()  # named_parameters(recurse=False)'s order and names, without its generator stack
        for name, p in self._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                p.placement = self.norm_placement(name)
                p.layer_ref = LayerRef(weakref.ref(self), name)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.tag_placements()  # .to() / .to_empty() may have made new parameter objects
        return out

    def full_shape(self, name: str) -> torch.Size:
        return self._param(name).shape

    def shard_slices(self, name: str) -> tuple[slice, ...]:
        return tuple(slice(0, n) for n in self.full_shape(name))

    def full_tensor(self, name: str) -> torch.Tensor:
        return self.local_tensor(name).detach()

    def full_tensor_like(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one shaped like parameter ``name`` (its grad, its Adam state)."""
        return local.detach()

    def local_part(self, name: str, full: Any) -> torch.Tensor:
        """This rank's local tensor of ``name`` from a full tensor or a sliceable (safetensors) object."""
        return torch.as_tensor(full[self.shard_slices(name)])

    def load_full(self, name: str, full: Any) -> None:
        """Copy this rank's part of ``full`` (a tensor or a sliceable object) into ``name``."""
        param = self._param(name)
        shape = tuple(self.full_shape(name))
        full_shape = tuple(full.shape) if isinstance(full, torch.Tensor) else tuple(full.get_shape())
        if full_shape != shape:
            raise ValueError(f"{name}: expected full shape {shape}, got {full_shape}")
        part = self.local_part(name, full).to(param.dtype)
        with torch.no_grad():
            if type(param).__name__ == "DTensor":  # ZeRO-3 (FSDP2): this dp rank's rows
                from .zero import piece_of

                param._local_tensor.copy_(piece_of(param, part))
            else:
                param.copy_(part)

    def local_tensor(self, name: str) -> torch.Tensor:
        """Parameter ``name`` as this tensor-parallel rank holds it: whole over dp (a ZeRO-3 parameter is
        all-gathered over dp, a collective)."""
        t = self._param(name)
        return t.full_tensor() if type(t).__name__ == "DTensor" else t

    def _param(self, name: str) -> torch.Tensor:
        t = self._parameters.get(name)
        if t is None:
            t = self._buffers.get(name)
        if t is None:
            raise KeyError(f"{type(self).__name__} has no parameter {name!r}")
        return t


class Linear(ShardedModule):
    """``y = x @ W.T + b`` with W (out_features, in_features), as ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    # As a classifier head. Tensor modes whose activations are batch-split
    # override these to average over the whole batch and gather the rows.

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        return cross_entropy(logits, labels, ignore_index)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, role={self.role}"


class Embedding(TiedHead, ShardedModule):
    """Lookup table (num_embeddings, dim); also the tied LM head (:class:`~cuboid.parallel.head.TiedHead`)."""

    role = "embedding"

    def __init__(self, num_embeddings: int, dim: int, device=None, dtype=None) -> None:
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))
        if self.weight.device.type != "meta":
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # the range check reads the ids on the host; a compiled graph leaves it to the lookup itself (an
        # IndexError on CPU, a device assert on CUDA) rather than sync and break the graph
        if (ids.numel() and not ids.is_meta and not torch.compiler.is_compiling()
                and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings)):
            raise IndexError(
                f"ids must lie in [0, {self.num_embeddings}), got min {int(ids.min())}, max {int(ids.max())}"
            )
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dim}, role={self.role}"


class LayerNorm(ShardedModule):
    """Layer norm over the last dim, with the residual add fused.

    ``forward(x)`` returns ``norm(x)``; ``forward(x, residual)`` returns
    ``(norm(x + residual), x + residual)``.
    """

    role = "norm"

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    seq_group = None  # set under Megatron sequence parallelism: tokens are split over it, weight grads summed

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None and residual.dtype != x.dtype:
            x = x.to(residual.dtype)  # under autocast the residual stream keeps its (wider) dtype
        w, b = self.weight, self.bias
        if self.seq_group is not None:  # each rank normalises its tokens: the parameters' gradients sum over ranks
            w, b = comm.copy_to(w, self.seq_group), comm.copy_to(b, self.seq_group)
        return kernels.layer_norm(x, w, b, self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


class RMSNorm(ShardedModule):
    """RMS norm over the last dim, with the residual add fused (as :class:`LayerNorm`)."""

    role = "norm"
    seq_group = None  # as LayerNorm's: set under Megatron sequence parallelism
    offset = 0.0  # the output is normed(x) * (offset + weight); a subclass with another offset states it

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None and residual.dtype != x.dtype:
            x = x.to(residual.dtype)  # under autocast the residual stream keeps its (wider) dtype
        w = self.weight if self.seq_group is None else comm.copy_to(self.weight, self.seq_group)
        return kernels.rms_norm(x, w, self.eps, residual=residual)


class LearnedTensor(ShardedModule):
    """A learned tensor of no other layer (ViT's CLS token and position table, BERT's MLM bias) as a layer.

    A layer so that the spec gives it a role: ``replicate`` when its last dim
    is the model's hidden dim (modes that split the hidden dim shard it like a
    norm weight), ``vocab`` when its last dim is the vocabulary (split like
    the token table). ``forward()`` returns the tensor.
    """

    role = "replicate"

    def __init__(self, *shape: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape, device=device, dtype=dtype))

    def forward(self) -> torch.Tensor:
        return self.weight


class Dropout(nn.Module):
    """Dropout whose masks follow the activation's layout under tensor parallelism (Megatron's RNG idea).

    ``sharded_rank`` None (one device, and 1D, whose dropouts all act on
    replicated activations): masks come from the default generator, which
    :func:`sync_rng` makes equal on every rank of a tensor-parallel group, so
    the replicas of an activation drop the same elements (and a 1D run drops
    exactly what one device with the same seed drops). An int (2D, 2.5D, 3D,
    where each rank holds a distinct block): the mask comes from a generator
    seeded by one draw of the default generator and this rank's index, so the
    blocks get independent masks. Both draw from the default generator, whose
    state activation checkpointing saves and restores, so a recomputed block
    drops the same elements.
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.sharded_rank: Optional[int] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.sharded_rank is None:
            return F.dropout(x, self.p, True)
        draw = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))  # replayed under checkpoint recompute
        g = torch.Generator(device=x.device).manual_seed((draw * 1_000_003 + self.sharded_rank) % (1 << 63))
        keep = torch.empty(x.shape, device=x.device).bernoulli_(1.0 - self.p, generator=g)
        return x * keep.to(x.dtype) / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}" + ("" if self.sharded_rank is None else f", sharded_rank={self.sharded_rank}")


def sync_rng(group) -> None:
    """Give every rank of ``group`` the default (CPU and current CUDA) generator state of its first rank."""
    from cuboid.parallel import comm

    if comm.group_size(group) <= 1:
        return
    state = torch.get_rng_state()
    comm.broadcast_(state, group, 0)
    torch.set_rng_state(state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state().cuda()
        comm.broadcast_(cuda, group, 0)
        torch.cuda.set_rng_state(cuda.cpu())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              key_padding_mask: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
              window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The attention core: q (B, H, T, D), k and v (B, Hkv, S, D) with H a multiple of Hkv (grouped-query
    attention), out (B, H, T, D), through the kernel; ``doc_ids`` (B, T): a query sees only keys of its
    document; ``window``: only the ``window`` keys ending at its own (sliding-window attention); ``sinks``
    (H,): gpt-oss's per-head logits in every softmax's denominator."""
    if sinks is None:
        return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                                 window=window)
    return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, doc_ids=doc_ids,
                             window=window, sinks=sinks)


class Rotary(nn.Module):
    """Rotary position embeddings (RoPE) of q and k; no parameters.

    ``forward(q, k, positions)`` rotates (B, H, T, D) ``q`` and (B, Hkv, T, D)
    ``k`` by the angles of ``positions`` (LongTensor (T,) or (B, T)), HF
    Llama's ``rotate_half`` layout, through the fused kernel. The positions
    are the attention core's to give: it knows where its tokens sit in the
    sequence (one device: ``0 .. T-1``; a sequence-parallel rank: its zigzag
    chunks). The cos/sin tables are computed in fp32 (``scaling``: HF's
    ``rope_scaling`` dict, type ``llama3``) and cast to q's dtype, as
    ``transformers`` does; when the core names its positions the tables are kept, shared by all layers, one entry
    per key (a few at most: Gemma 3's local and global bases alternate, and a recomputed block must find
    the tables its forward found).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Optional[dict] = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    _cached: dict = {}  # key -> tables, shared by every layer: the blocks of a model reuse them
    CACHED = 8  # entries kept; the least recently used goes first (a recompute finds what its forward used)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype, key: Optional[tuple] = None) -> tuple:
        """(cos, sin) of ``positions`` in ``dtype``; ``key`` names the positions (e.g. ``("range", T)``), so the
        next layer with the same key reuses them."""
        if key is not None:
            key = (positions.device, dtype, self.head_dim, self.theta, str(self.scaling), *key)
            hit = Rotary._cached.get(key)
            if hit is not None:
                if not torch.compiler.is_compiling():  # eager: the newest, so a later miss evicts another key
                    Rotary._cached[key] = Rotary._cached.pop(key)  # (Dynamo would guard on the order: recompiles)
                return hit
        cos, sin = kernels.rope_tables(positions, self.head_dim, self.theta, self.scaling)
        out = (cos.to(dtype), sin.to(dtype))
        if key is not None:  # unnamed positions (a cache's step, a mask's) leave the shared entries as they were
            while len(Rotary._cached) >= Rotary.CACHED:
                Rotary._cached.pop(next(iter(Rotary._cached)))
            Rotary._cached[key] = out
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, key: Optional[tuple] = None) -> tuple:
        cos, sin = self.tables(positions, q.dtype, key)
        return kernels.rope(q, k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, scaling={self.scaling}"


class Attention(nn.Module):
    """The attention core as a layer (no parameters; role ``attention``): (B, H, T, D) q, (B, Hkv, T, D) k
    and v in, (B, H, T, D) out; with ``rope`` (a :class:`Rotary`), q and k are rotated first by their
    positions: ``mask.positions`` where the batch gave them, else 0 .. T-1.

    ``mask`` (a :class:`~cuboid.parallel.mask.Mask` or None) is what the model built from its inputs, laid
    out like this core's tokens: its key padding mask and, for packed rows, the document of each token (a
    query sees only keys of its own document).

    ``window`` (None: every earlier key): sliding-window attention as transformers' (Mistral, Qwen2,
    Gemma 3's local layers): a query at position ``i`` attends keys ``j`` with ``i - window < j <= i``,
    positions counted in its own document of a packed row.

    A layer so that a plan can swap it: sequence parallelism replaces it by
    ring or all-to-all attention over the ``sp`` group (:mod:`.sequence_split`),
    generation by a cached core (:mod:`cuboid.zoo.generation`), the model code
    unchanged; a swapped core takes the same call and carries ``window`` over. ``sinks`` (H,): gpt-oss's
    per-head sink logits (this rank's heads), passed by the model only when it has them.
    """

    role = "attention"

    def __init__(self, window: Optional[int] = None) -> None:
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"Attention: window must be an int >= 1 (keys a query sees, itself included) or None, "
                             f"got {window!r}")
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                mask: Optional[Mask] = None, rope: Optional[Rotary] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(f"an attention core takes a cuboid.parallel.mask.Mask, got {type(mask).__name__}")
        if rope is not None:
            if mask is not None and mask.positions is not None:
                q, k = rope(q, k, mask.positions)
            else:
                T = q.shape[2]
                q, k = rope(q, k, torch.arange(T, device=q.device), ("range", T))
        if mask is None:
            return attention(q, k, v, causal=causal, window=self.window, sinks=sinks)
        return attention(q, k, v, causal=causal, key_padding_mask=mask.keep, doc_ids=mask.docs, window=self.window,
                         sinks=sinks)

    def extra_repr(self) -> str:
        return "" if self.window is None else f"window={self.window}"


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU, exact (BERT, ViT) or tanh-approximated (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate=approximate)

