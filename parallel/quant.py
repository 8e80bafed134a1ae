"""A frozen 4-bit NF4 base under LoRA (QLoRA, Dettmers et al., arXiv 2305.14314), under the plans.

:func:`quantize_linears` turns linears of a (meta, cut) model into NF4
layers: the class of each gains :class:`NF4Layer` (as LoRA's experts gain
their mixin), the ``weight`` parameter leaves and the 4-bit tensors of
kernels/nf4.py take its place as buffers (``weight_nf4``, ``weight_absmax``,
``weight_nested_absmax``, ``weight_nested_quant_map``, ``weight_offset``,
``weight_quant_map``). Buffers are never parameters: no optimizer state, no
gradient bucket, no gradient all-reduce, no ZeRO shard. :meth:`NF4Layer.set_full`
then quantizes the full weight (one tensor, read by the caller) exactly as one
device does (bitsandbytes' layout) and keeps this rank's part.

**Under tensor parallelism** each rank keeps its slice of the one-device
codes and the scales of its blocks, undone to fp32 (the double quantization's
groups of 256 scales and their mean span all ranks' blocks), so every rank's
dequantized slice is bit-equal to the same slice of the one-device weight and
a tp run takes one device's step. Beside them it keeps, for writing one
device's layout (:func:`gathered_nf4`, ``cuboid.zoo.to_hf`` under tp), its
blocks' one-device scale codes (``weight_absmax_codes``) and the whole
weight's second level (nested scales and offset: a few bytes per 16384
values). A slice must hold whole blocks of 64
values (column cuts: the input width a multiple of 64; row cuts: each rank's
columns a multiple of 64); a cut that splits a block is refused in one
sentence rather than quantized differently from one device. 1D tensor
parallelism is built (column, row and the replicated key/value layer), the
2D/2.5D/3D grids are refused.

Forward: ``x @ dequantize(W).T`` through :func:`cuboid.kernels.nf4_linear.nf4_linear`
(the fused Triton kernel on CUDA; the torch reference elsewhere), whose
backward re-dequantizes the weight for ``dx`` instead of saving a 16-bit copy.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
from torch import nn

from cuboid.kernels.nf4 import BLOCKSIZE, NESTED_BLOCKSIZE, NF4Weight, nf4_code, nf4_nbytes, pack, quantize_nf4, unpack
from cuboid.kernels.nf4_linear import dequantize_nf4, nf4_linear
from cuboid.parallel import comm
from cuboid.parallel import layers as L

__all__ = ["NF4Layer", "quantize_linears", "quantized_layers", "QUANTIZE_CHOICES", "check_quantize", "check_plan",
           "nf4_weight_of", "quantized_bytes", "held_nf4_bytes", "gathered_nf4", "gathered_nf4_meta", "BlockCutError",
           "check_whole_blocks"]

QUANTIZE_CHOICES = ("nf4",)
_BUFFERS = ("nf4", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "offset", "absmax_codes")


def check_quantize(quantize: Optional[str]) -> Optional[str]:
    """``quantize`` checked: None or one of :data:`QUANTIZE_CHOICES` (a one-sentence error otherwise)."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize={quantize!r}: the 4-bit base cuboid builds is 'nf4' (bitsandbytes' NF4 with "
                         f"double quantization)")
    return quantize


GRID_REFUSAL = ("a 4-bit NF4 base is built for one device and 1D tensor parallelism (with dp, ZeRO, pp and sp), "
                "not for the 2D/2.5D/3D grids")


def check_plan(plan) -> None:
    """A 4-bit base under ``plan``: a 2D/2.5D/3D grid is refused in one sentence, from the plan alone, so every
    rank refuses (a pipeline stage holding no block would find no grid layer of its own)."""
    if plan is not None and plan.tp > 1 and plan.tp_mode != "1d":
        raise NotImplementedError(f"tp_mode={plan.tp_mode}: {GRID_REFUSAL}")


def _kind(layer: nn.Module) -> str:
    """The layout of a linear the NF4 base replaces (:func:`cuboid.parallel.lora.linear_kind`): one device's or
    1D tensor parallelism's; the 2D/2.5D/3D grids are refused."""
    from cuboid.parallel.lora import linear_kind

    try:
        kind = linear_kind(layer)
    except NotImplementedError:
        kind = "3d"
    if kind in ("plain", "kv", "column", "row"):
        return kind
    raise NotImplementedError(f"{type(layer).__name__}: {GRID_REFUSAL}")


class NF4Layer:
    """Mixin placed before a linear's class: the frozen weight is NF4 buffers, the bias (if any) stays."""

    nf4_kind: str = "plain"

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in with the local weight's shape, dtype and device (what adapters and reprs read): one
        element expanded, no values (they are :meth:`dequantized`)."""
        return torch.zeros((), dtype=self.nf4_dtype, device=self.weight_nf4.device).expand(self.nf4_local_shape)

    def local_tensor(self, name: str) -> torch.Tensor:
        """The dequantized local weight for ``"weight"`` (what checkpoint writers and merges read)."""
        return self.dequantized() if name == "weight" else super().local_tensor(name)

    def full_shape(self, name: str) -> torch.Size:
        return torch.Size(self.nf4_full_shape) if name == "weight" else super().full_shape(name)

    def nf4_weight(self) -> NF4Weight:
        """The local weight as an :class:`NF4Weight` over this layer's buffers."""
        b = {k: getattr(self, f"weight_{k}") for k in _BUFFERS}
        nested = b["absmax"].dtype == torch.uint8  # a tp slice keeps fp32 scales (and one device's codes apart)
        return NF4Weight(b["nf4"], b["absmax"], b["quant_map"], tuple(self.nf4_local_shape), self.nf4_dtype,
                         64, b["nested_absmax"] if nested else None, b["nested_quant_map"] if nested else None,
                         b["offset"].reshape(()) if nested else None)

    def dequantized(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The local weight in ``dtype`` (default: the dtype it was read in)."""
        return dequantize_nf4(self.nf4_weight(), dtype or self.nf4_dtype)

    def set_full(self, full: torch.Tensor) -> None:
        """Quantize the full (out, in) weight ``full`` as one device does and keep this rank's part."""
        shape = tuple(self.full_shape("weight"))
        if tuple(full.shape) != shape:
            raise ValueError(f"expected a full weight of {shape}, got {tuple(full.shape)}")
        self.set_quantized(quantize_nf4(full))

    def set_quantized(self, qw: NF4Weight) -> None:
        """Keep this rank's part of the full weight ``qw``, already quantized (a bitsandbytes folder's)."""
        shape = tuple(self.full_shape("weight"))
        if tuple(qw.shape) != shape:
            raise ValueError(f"expected a quantized weight of {shape}, got {tuple(qw.shape)}")
        if tuple(self.nf4_local_shape) != shape:  # a tensor-parallel slice: its codes and its blocks' fp32 scales
            local, blocks = _local_part(self, qw, qw.weight.device)
            self._set_buffers(local)
            if qw.double_quant:  # one device's scale codes of its blocks and the whole second level: to_hf's
                self.weight_absmax_codes = qw.absmax[blocks].contiguous()
                self.weight_nested_absmax, self.weight_nested_quant_map = qw.nested_absmax, qw.nested_quant_map
                self.weight_offset = qw.offset.reshape(1)
            return
        self._set_buffers(qw)

    def load_full(self, name: str, full) -> None:
        """``"weight"``: the layer leaves NF4 and takes this rank's part of ``full`` as its weight parameter again
        (what merging adapters into a dequantized base does); other names as the base layer loads them."""
        if name != "weight":
            return super().load_full(name, full)
        part = torch.as_tensor(self.local_part("weight", full)).to(self.nf4_dtype)
        for b in _BUFFERS:
            del self._buffers[f"weight_{b}"]
        self.__class__ = self.nf4_plain_class
        self.weight = nn.Parameter(part.detach().clone(), requires_grad=False)
        self.tag_placements()

    def _set_buffers(self, qw: NF4Weight) -> None:
        empty = qw.quant_map.new_empty((0,))
        self.weight_nf4, self.weight_absmax, self.weight_quant_map = qw.weight, qw.absmax, qw.quant_map
        self.weight_absmax_codes = empty.to(torch.uint8)
        self.weight_nested_absmax = qw.nested_absmax if qw.double_quant else empty
        self.weight_nested_quant_map = qw.nested_quant_map if qw.double_quant else empty
        self.weight_offset = qw.offset.reshape(1) if qw.double_quant else empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cuboid.parallel.tensor.base import to_compute

        kind = self.nf4_kind
        x = to_compute(x)  # under autocast the weight is dequantized straight to the autocast dtype
        if kind == "plain":
            return nf4_linear(x, self.nf4_weight(), self.bias)
        if kind in ("column", "kv"):
            g = self.group
            x = comm.copy_to(x, g) if self.seq_dim is None else comm.all_gather_to(x, g, self.seq_dim)
            if kind == "kv":  # this rank's head of the whole weight
                w = self.dequantized(x.dtype)[self.rows]
                b = comm.copy_to(self.bias, g)[self.rows] if self.bias is not None else None
                return torch.nn.functional.linear(x, w, b)
            y = nf4_linear(x, self.nf4_weight(), self.bias)  # (.., out/p)
            if not self.gather_output or self.tp_size == 1:
                return y
            y = comm.gather_from(y, g, -1)
            if self.packed > 1:
                y = y.unflatten(-1, (self.tp_size, self.packed, -1)).transpose(-3, -2).flatten(-3)
            return y
        if not self.input_is_parallel:  # row
            x = comm.scatter_to(x, self.group, -1)
        y = nf4_linear(x, self.nf4_weight())
        if self.seq_dim is not None:
            y = comm.reduce_scatter_to(y, self.group, self.seq_dim)
            return y + comm.copy_to(self.bias, self.group) if self.bias is not None else y
        y = comm.reduce_from(y, self.group)
        return y + self.bias if self.bias is not None else y


class BlockCutError(ValueError):
    """A tensor-parallel slice of an NF4 layer that cuts through its blocks of 64 values."""


def _cut_error(layer: nn.Module) -> BlockCutError:
    return BlockCutError(f"{type(layer).__name__} {tuple(layer.full_shape('weight'))}: this rank's slice "
                         f"{tuple(layer.nf4_local_shape)} cuts through NF4's blocks of 64 values; a 4-bit base under "
                         f"tensor parallelism needs whole blocks per rank (in_features, and each rank's share of "
                         f"a row cut, multiples of 64)")


def check_whole_blocks(layer: nn.Module) -> None:
    """:class:`BlockCutError` where this rank's slice of the NF4 layer's weight cuts a block of 64, read from the
    layer's shard slices alone (no tensor made: the planner asks it of meta models). The rule :func:`_local_part`
    applies: each run of 64 local values is one block of the flattened one-device weight."""
    if not _sliced(layer):
        return
    full = tuple(layer.nf4_full_shape)
    inner = math.prod(full[1:])  # values per row
    pieces = layer.shard_slices("weight")
    for sl in pieces if isinstance(pieces, list) else [pieces]:
        rows = sl[0]
        cols = sl[1] if len(sl) > 1 else slice(0, inner)
        n_rows, width = rows.stop - rows.start, cols.stop - cols.start
        if n_rows <= 0 or width <= 0:
            continue
        if width == inner:  # whole rows: one contiguous run
            ok = rows.start * inner % 64 == 0 and n_rows * inner % 64 == 0
        else:  # a run per row, each whole blocks (two rows aligned: every row is)
            ok = width % 64 == 0 and all((r * inner + cols.start) % 64 == 0
                                         for r in range(rows.start, min(rows.stop, rows.start + 2)))
        if not ok:
            raise _cut_error(layer)


def _local_part(layer: nn.Module, qw: NF4Weight, device) -> tuple:
    """(this rank's part of the one-device quantized weight ``qw``: the codes of its slice and the fp32 scales
    of its blocks, the indices of those blocks in ``qw``); a cut through a block is refused."""
    n = qw.numel
    codes = torch.stack([qw.weight.view(-1) >> 4, qw.weight.view(-1) & 15], 1).view(-1)[:n].view(qw.shape)
    blocks = (torch.arange(n, device=device) // qw.blocksize).view(qw.shape)
    local_codes = layer.local_part("weight", codes).reshape(-1)
    local_blocks = layer.local_part("weight", blocks).reshape(-1)
    m = local_blocks.numel()
    per = local_blocks[: m - m % 64].view(-1, 64) if m >= 64 else local_blocks.view(1, -1)
    if m % 64 or bool((per != per[:, :1]).any()):
        raise _cut_error(layer)
    scales = qw.scales().float()[per[:, 0]]
    return NF4Weight(pack(local_codes), scales.contiguous(), qw.quant_map, tuple(layer.nf4_local_shape),
                     qw.dtype), per[:, 0]


_NF4_CLASSES: dict = {}


def _nf4_class(cls: type) -> type:
    if cls not in _NF4_CLASSES:
        _NF4_CLASSES[cls] = type(f"NF4{cls.__name__}", (NF4Layer, cls), {"__module__": __name__})
    return _NF4_CLASSES[cls]


def block_linears(model: nn.Module, blocks: str = "blocks") -> List[str]:
    """transformers' choice of what a 4-bit load quantizes: every linear inside the blocks, except routers
    (embeddings, norms, the LM head and the stacked experts are not linears of the blocks)."""
    out = []
    for path, mod in model.named_modules():
        if not path.startswith(blocks + ".") or getattr(mod, "placeholder", False):
            continue
        if isinstance(mod, L.Linear) and not isinstance(mod, NF4Layer) and "router" not in path.split(".")[-1]:
            out.append(path)
    return out


def quantize_linears(model: nn.Module, paths: Iterable[str]) -> List[str]:
    """Make the linears at ``paths`` NF4 layers (on any device; their buffers are empty until
    :meth:`NF4Layer.set_full`). Returns the paths done."""
    done = []
    mods = dict(model.named_modules())
    for path in paths:
        layer = mods[path]
        kind = _kind(layer)
        layer.nf4_full_shape = tuple(layer.full_shape("weight"))
        w = layer._parameters.pop("weight")
        layer.nf4_local_shape, layer.nf4_dtype = tuple(w.shape), w.dtype
        layer.nf4_plain_class = type(layer)
        layer.__class__ = _nf4_class(type(layer))
        layer.nf4_kind = kind
        dev = w.device if w.device.type != "meta" else torch.device("cpu")
        for name in _BUFFERS:
            layer.register_buffer(f"weight_{name}", torch.empty(0, device=dev), persistent=False)
        layer.weight_quant_map = nf4_code(dev)
        done.append(path)
    return done


def quantized_layers(model: nn.Module) -> list:
    """[(path, layer)] of the NF4 layers of ``model``, in module order."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, NF4Layer)]


def nf4_weight_of(layer: nn.Module) -> NF4Weight:
    """The :class:`NF4Weight` an NF4 layer holds (its local part under tensor parallelism)."""
    if not isinstance(layer, NF4Layer):
        raise TypeError(f"{type(layer).__name__} is not an NF4 layer")
    return layer.nf4_weight()


def quantized_bytes(model: nn.Module) -> tuple:
    """(bytes of the NF4 buffers this rank keeps, elements of its largest local NF4 weight), from the layers'
    shapes alone (a meta model's too: what the cost model prices), for a double-quantized base. A whole weight
    keeps bitsandbytes' layout (:func:`cuboid.kernels.nf4.nf4_nbytes`, about 0.516 bytes a value); a
    tensor-parallel slice keeps its codes and its blocks' fp32 scales (0.5625 bytes a value), and for writing
    one device's layout its blocks' scale codes and the whole weight's second level (:meth:`NF4Layer.set_quantized`)."""
    total, largest = 0, 0
    for _, layer in quantized_layers(model):
        local, full = math.prod(layer.nf4_local_shape), math.prod(layer.nf4_full_shape)
        if local == full:
            total += nf4_nbytes(local)
        else:
            blocks = -(-full // BLOCKSIZE)
            total += (nf4_nbytes(local, double_quant=False) + local // BLOCKSIZE
                      + -(-blocks // NESTED_BLOCKSIZE) * 4 + 256 * 4 + 4)
        largest = max(largest, local)
    return total, largest


def held_nf4_bytes(layer: nn.Module) -> int:
    """Bytes of every NF4 buffer ``layer`` holds (what :func:`quantized_bytes` prices)."""
    return sum(b.numel() * b.element_size() for n, b in layer.named_buffers(recurse=False) if n.startswith("weight_"))


def _sliced(layer: nn.Module) -> bool:
    return tuple(layer.nf4_local_shape) != tuple(layer.nf4_full_shape)


def gathered_nf4(layer: nn.Module) -> NF4Weight:
    """The whole weight of an NF4 layer as one device quantizes it (bitsandbytes' layout, bit for bit): its own
    on one device; under tensor parallelism the ranks' codes and scale codes gathered, with the second level
    every rank keeps. A collective over the layer's tensor group where it is sliced (every rank, same order)."""
    local = layer.nf4_weight()
    if not _sliced(layer):
        return local
    shape, bs = tuple(layer.nf4_local_shape), local.blocksize
    codes = layer.full_tensor_like("weight", unpack(local.weight, local.numel).to(torch.uint8).view(shape))
    double = layer.weight_absmax_codes.numel() > 0
    per_block = layer.weight_absmax_codes if double else local.absmax
    scales = layer.full_tensor_like("weight", per_block.repeat_interleave(bs).view(shape)).reshape(-1)[::bs]
    qw = NF4Weight(pack(codes.reshape(-1)), scales.contiguous(), local.quant_map, tuple(layer.nf4_full_shape),
                   local.dtype, bs)
    if double:
        qw.nested_absmax, qw.nested_quant_map = layer.weight_nested_absmax, layer.weight_nested_quant_map
        qw.offset = layer.weight_offset.reshape(())
    return qw


def gathered_nf4_meta(layer: nn.Module) -> NF4Weight:
    """:func:`gathered_nf4`'s shapes and small tensors without the collective (the codes and the scales on the
    meta device): what a writer plans its files with."""
    if not _sliced(layer):
        return layer.nf4_weight()
    n, double = math.prod(layer.nf4_full_shape), layer.weight_absmax_codes.numel() > 0
    blocks = -(-n // BLOCKSIZE)
    qw = NF4Weight(torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device="meta"),
                   torch.empty(blocks, dtype=torch.uint8 if double else torch.float32, device="meta"),
                   layer.weight_quant_map, tuple(layer.nf4_full_shape), layer.nf4_dtype, BLOCKSIZE)
    if double:
        qw.nested_absmax, qw.nested_quant_map = layer.weight_nested_absmax, layer.weight_nested_quant_map
        qw.offset = layer.weight_offset.reshape(())
    return qw
