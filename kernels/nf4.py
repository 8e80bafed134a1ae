"""NF4 (4-bit NormalFloat) weights with double-quantized scales, in bitsandbytes' layout (QLoRA).

QLoRA (Dettmers et al. 2023, arXiv 2305.14314) stores a frozen weight as
4-bit codes into a 16-value table of normal-distribution quantiles, one fp32
scale (the block's absolute maximum) per block of 64 values, and compresses
those scales again ("double quantization"). This file is that format, bit for
bit as bitsandbytes 0.50 writes it (its ``functional.quantize_4bit`` with
``compress_statistics=True, quant_type="nf4"``, on CPU), in plain torch:

- the weight is flattened (row-major) and cut into blocks of ``blocksize``
  (64) values, the last block possibly short; each block's scale is
  ``max |w|`` in fp32, each value ``w * (1 / scale)`` clamped to [-1, 1] and
  rounded to the nearest of :data:`NF4_CODE` (a value exactly between two
  codes takes the lower one);
- two codes per byte, the first value in the high nibble; the packed weight
  is a ``((numel + 1) // 2, 1)`` uint8 column (an odd count pads the code of 0);
- double quantization: ``offset = mean(scales)``; ``scales - offset`` is cut
  into blocks of 256, each with its fp32 absolute maximum (``nested_absmax``),
  and every value times its reciprocal is stored as the index (uint8) of an
  entry of the signed 8-bit dynamic map (:func:`dynamic_map`, Dettmers 2015,
  arXiv 1511.04561): the entry nearest to the value's point on a 65536-point
  grid of [-1, 1] (:func:`quantize_8bit`);
- dequantizing: ``scale = dynamic[absmax_code] * nested_absmax + offset`` and
  ``w = NF4_CODE[code] * scale``, both in fp32, cast to the weight's dtype.

:class:`NF4Weight` holds the tensors under bitsandbytes' state-dict names
(``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.nested_absmax``,
``weight.nested_quant_map``, ``weight.quant_state.bitsandbytes__nf4``: the
last is the JSON of the non-tensor fields as uint8 bytes); :meth:`state_dict`
and :meth:`from_state_dict` write and read that layout. The Triton dequantize
and the fused dequantize-matmul are in kernels/nf4_linear.py.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

Tensor = torch.Tensor

BLOCKSIZE = 64  # values per scale (bitsandbytes' default for 4-bit)
NESTED_BLOCKSIZE = 256  # scales per second-level scale (double quantization)

# The 16 NF4 values: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (QLoRA, appendix E), as fp32.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def nf4_code(device=None) -> Tensor:
    """The 16-entry NF4 table as an fp32 tensor (bitsandbytes' ``quant_map``)."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def dynamic_map() -> Tensor:
    """The signed 8-bit dynamic quantization map (256 sorted fp32 values in [-0.993, 1]).

    Dynamic tree quantization: 7 exponent levels 10^-6 .. 10^0, each holding
    2^i linearly spaced fractions in (0.1, 1) (the midpoints of a linspace)
    and their
    negatives, plus 0 and 1; all in fp32, as bitsandbytes computes it.
    """
    values = [0.0, 1.0]
    for level in range(7):
        edges = torch.linspace(0.1, 1.0, 2 ** level + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (level - 6)
        values += (mids * scale).tolist() + (mids * -scale).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _block_scales(flat: Tensor, blocksize: int) -> Tensor:
    """Per-block ``max |x|`` (fp32) of a flat fp32 tensor, the last block possibly short."""
    n = flat.numel()
    full = n - n % blocksize
    scales = flat[:full].view(-1, blocksize).abs().amax(dim=1)
    if full < n:
        scales = torch.cat([scales, flat[full:].abs().amax().view(1)])
    return scales


def _per_element(scales: Tensor, n: int, blocksize: int) -> Tensor:
    """Each block's scale repeated over its values (length n)."""
    return scales.repeat_interleave(blocksize)[:n]


_CHUNK_BLOCKS = 4096  # blocks quantized at a time: bounds the temporaries of one large tensor (262,144 values)


def _quantize_codes(flat: Tensor, blocksize: int) -> Tuple[Tensor, Tensor]:
    """(packed codes, fp32 block scales) of a flat tensor: nearest NF4 value of ``x * (1 / scale)``, ties down.

    Chunks of whole blocks at a time, each cast to fp32 only there (the scales are exact in any float dtype)."""
    scales = _block_scales(flat, blocksize).float()
    inv = 1.0 / scales.clamp(min=1e-38)  # multiply by the reciprocal, as bitsandbytes' CPU quantizer does
    code = nf4_code(flat.device)
    midpoints = (code[:-1] + code[1:]) / 2
    n, step = flat.numel(), blocksize * _CHUNK_BLOCKS
    packed = torch.empty(((n + 1) // 2, 1), dtype=torch.uint8, device=flat.device)
    for start in range(0, n, step):
        chunk = flat[start:start + step].float()
        first = start // blocksize
        scale = _per_element(inv[first:first + _CHUNK_BLOCKS], chunk.numel(), blocksize)
        codes = torch.bucketize(torch.clamp(chunk * scale, -1.0, 1.0), midpoints, out_int32=True)
        packed[start // 2:start // 2 + (chunk.numel() + 1) // 2] = pack(codes)
    return packed, scales


_LUT_SIZE = 65536  # grid points over [-1, 1] of the 8-bit quantizer's nearest-entry table


def _grid_table(code: Tensor) -> Tensor:
    """For each of 65536 evenly spaced points of [-1, 1], the index of the nearest ``code`` entry (fp32 midpoints;
    a point past a midpoint by any amount goes up): the table bitsandbytes' CPU 8-bit quantizer looks values up in."""
    i = torch.arange(_LUT_SIZE, dtype=torch.float32)
    grid = (2.0 * i) / float(_LUT_SIZE - 1) - 1.0
    midpoints = 0.5 * (code[:-1] + code[1:])
    return torch.searchsorted(midpoints, grid, side="left").to(torch.uint8)  # midpoints strictly below the point


@functools.lru_cache(maxsize=None)
def _dynamic_table(device: torch.device) -> Tensor:
    """:func:`_grid_table` of :func:`dynamic_map` on ``device``: a constant, built once per device rather than
    for every tensor quantized."""
    return _grid_table(dynamic_map().to(device)).to(device)


def _grid_index(normed: Tensor) -> Tensor:
    """The table row of each fp32 value in [-1, 1]: ``(v + 1) * 0.5 * 65535 + 0.5`` truncated, in fp32 steps."""
    v = normed.clamp(-1.0, 1.0)
    return ((((v + 1.0) * 0.5) * float(_LUT_SIZE - 1)) + 0.5).to(torch.int64)


def quantize_8bit(x: Tensor, blocksize: int) -> Tuple[Tensor, Tensor]:
    """Blockwise 8-bit quantization onto :func:`dynamic_map`: (uint8 indices, fp32 block absmax).

    A value is scaled by the reciprocal of its block's absmax, placed on a
    65536-point grid of [-1, 1], and given the map entry nearest to that grid
    point (bitsandbytes 0.50's CPU rule); a block of zeros stores absmax 0 and
    index 0.
    """
    flat = x.reshape(-1).float()
    absmax = _block_scales(flat, blocksize)
    inv = 1.0 / absmax  # inf for an all-zero block, whose codes are set to 0 below
    normed = flat * _per_element(inv, flat.numel(), blocksize)
    table = _dynamic_table(flat.device)
    idx = table[_grid_index(torch.nan_to_num(normed, nan=0.0))]
    zero = _per_element(absmax == 0, flat.numel(), blocksize)
    return torch.where(zero, torch.zeros_like(idx), idx), absmax


def _quantize_scales(scales: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Double quantization: (uint8 indices into :func:`dynamic_map`, fp32 nested absmax, fp32 offset)."""
    offset = scales.mean()
    codes, nested = quantize_8bit(scales - offset, NESTED_BLOCKSIZE)
    return codes, nested, offset


ZERO_CODE = 7  # the NF4 index of 0.0: an odd count of values is padded with it


def pack(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte, the first in the high nibble: a ``((n + 1) // 2, 1)`` uint8 column."""
    c = codes.to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), ZERO_CODE)])
    return ((c[0::2] << 4) | c[1::2]).view(-1, 1)


def unpack(packed: Tensor, n: int) -> Tensor:
    """The first ``n`` 4-bit codes (int64) of a packed uint8 tensor."""
    b = packed.reshape(-1).to(torch.int64)
    return torch.stack([b >> 4, b & 0xF], dim=1).reshape(-1)[:n]


@dataclass
class NF4Weight:
    """One NF4 weight: the packed codes and what dequantizing them needs (bitsandbytes' QuantState).

    ``absmax`` is uint8 (indices into ``nested_quant_map``) when double
    quantized, else the fp32 scales; ``nested_absmax``, ``nested_quant_map``
    and ``offset`` are None without double quantization.
    """

    weight: Tensor  # ((numel + 1) // 2, 1) uint8, two codes a byte, high nibble first
    absmax: Tensor  # (blocks,) uint8 codes of the block scales, or their fp32 values
    quant_map: Tensor  # (16,) fp32 NF4 table
    shape: Tuple[int, ...]
    dtype: torch.dtype  # the dtype dequantizing returns
    blocksize: int = BLOCKSIZE
    nested_absmax: Optional[Tensor] = None  # (ceil(blocks / 256),) fp32
    nested_quant_map: Optional[Tensor] = None  # (256,) fp32 dynamic map
    offset: Optional[Tensor] = None  # () fp32 mean of the block scales
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    def nbytes(self) -> int:
        """Bytes of every tensor this weight keeps (codes, scales, maps, offset)."""
        ts = [self.weight, self.absmax, self.quant_map, self.nested_absmax, self.nested_quant_map, self.offset]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def scales(self) -> Tensor:
        """The fp32 block scales (double quantization undone)."""
        if not self.double_quant:
            return self.absmax.float()
        blocks, group = self.absmax.numel(), self.nested_blocksize
        first = self.nested_quant_map.index_select(0, self.absmax.to(torch.int32))
        padded = torch.nn.functional.pad(first, (0, -blocks % group)).view(-1, group)  # rows of one group
        return (padded * self.nested_absmax[:, None]).view(-1)[:blocks] + self.offset

    def to(self, device) -> "NF4Weight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return NF4Weight(move(self.weight), move(self.absmax), move(self.quant_map), self.shape, self.dtype,
                         self.blocksize, move(self.nested_absmax), move(self.nested_quant_map), move(self.offset),
                         self.nested_blocksize)

    def state_dict(self, prefix: str = "weight") -> Dict[str, Tensor]:
        """bitsandbytes' serialized layout (``Linear4bit`` with a packed quant state) under ``prefix``."""
        out = {prefix: self.weight, f"{prefix}.absmax": self.absmax, f"{prefix}.quant_map": self.quant_map}
        meta = {"quant_type": "nf4", "blocksize": self.blocksize, "dtype": _DTYPE_NAMES[self.dtype],
                "shape": list(self.shape)}
        if self.double_quant:
            out[f"{prefix}.nested_absmax"] = self.nested_absmax
            out[f"{prefix}.nested_quant_map"] = self.nested_quant_map
            meta.update(nested_blocksize=self.nested_blocksize, nested_dtype="float32",
                        nested_offset=float(self.offset))
        raw = json.dumps(meta).encode("utf-8")
        out[f"{prefix}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(raw), dtype=torch.uint8)
        return out

    @classmethod
    def from_state_dict(cls, tensors: Dict[str, Tensor], prefix: str = "weight") -> "NF4Weight":
        """Read bitsandbytes' layout (the keys :meth:`state_dict` writes); a clear error names what is wrong."""
        key = f"{prefix}.quant_state.bitsandbytes__nf4"
        if key not in tensors:
            other = [k for k in tensors if k.startswith(f"{prefix}.quant_state.")]
            raise ValueError(f"{prefix}: expected an NF4 quant state {key!r}, found "
                             f"{other or 'none'} (only nf4 4-bit weights are read)")
        meta = json.loads(bytes(tensors[key].to(torch.uint8).tolist()).decode("utf-8"))
        if meta.get("quant_type") != "nf4":
            raise ValueError(f"{prefix}: quant_type {meta.get('quant_type')!r} is not nf4")
        dtype = getattr(torch, meta["dtype"])
        nested = f"{prefix}.nested_absmax" in tensors
        offset = torch.tensor(float(meta["nested_offset"]), dtype=torch.float32) if nested else None
        return cls(tensors[prefix].view(torch.uint8).reshape(-1, 1), tensors[f"{prefix}.absmax"],
                   tensors[f"{prefix}.quant_map"].float(), tuple(meta["shape"]), dtype, int(meta["blocksize"]),
                   tensors.get(f"{prefix}.nested_absmax"), tensors.get(f"{prefix}.nested_quant_map"), offset,
                   int(meta.get("nested_blocksize", NESTED_BLOCKSIZE)))


def quantize_nf4(w: Tensor, *, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> NF4Weight:
    """Quantize ``w`` (fp32/fp16/bf16, any shape) to NF4, bit-equal to bitsandbytes 0.50's CPU quantizer."""
    if w.dtype not in _DTYPE_NAMES:
        raise TypeError(f"quantize_nf4: w has dtype {w.dtype}, expected float32, float16 or bfloat16")
    if blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
        raise ValueError(f"quantize_nf4: blocksize must be a power of two in 32..4096, got {blocksize}")
    if w.numel() == 0:
        raise ValueError("quantize_nf4: w has no elements")
    packed, scales = _quantize_codes(w.detach().reshape(-1), blocksize)
    qw = NF4Weight(packed, scales, nf4_code(w.device), tuple(w.shape), w.dtype, blocksize)
    if double_quant:
        qw.absmax, qw.nested_absmax, qw.offset = _quantize_scales(scales)
        qw.nested_quant_map = dynamic_map().to(w.device)
    return qw


def nf4_nbytes(numel: int, *, blocksize: int = BLOCKSIZE, double_quant: bool = True,
               nested_blocksize: int = NESTED_BLOCKSIZE) -> int:
    """Bytes :func:`quantize_nf4` keeps for a weight of ``numel`` values (what :meth:`NF4Weight.nbytes` counts):
    the packed codes (``ceil(n / 2)``), one scale per block (a uint8 code with double quantization, else fp32),
    the 16-entry fp32 table and, with double quantization, an fp32 scale per ``nested_blocksize`` blocks, the
    256-entry fp32 dynamic map and the fp32 offset. Per value: 0.5 + 1/64 + 4/(64 x 256), about 0.516 bytes
    (0.5625 without double quantization)."""
    blocks = -(-numel // blocksize)
    fixed = (numel + 1) // 2 + 16 * 4
    if not double_quant:
        return fixed + blocks * 4
    return fixed + blocks + -(-blocks // nested_blocksize) * 4 + 256 * 4 + 4


def dequantize_nf4_ref(qw: NF4Weight, dtype: Optional[torch.dtype] = None) -> Tensor:
    """Plain-torch dequantize: ``NF4_CODE[code] * scale`` in fp32, cast to ``dtype`` (default: the weight's).

    Each byte is looked up whole in a 256 x 2 table of its two codes' values (one gather of n / 2 indices), and
    whole blocks are scaled as rows of ``blocksize``."""
    n, bs = qw.numel, qw.blocksize
    code = qw.quant_map.float()
    byte = torch.arange(256, device=code.device)
    pairs = torch.stack([code[byte >> 4], code[byte & 0xF]], dim=1)  # (256, 2): a byte's high then low value
    values = pairs.index_select(0, qw.weight.reshape(-1).to(torch.int32)).view(-1)[:n]
    scales = qw.scales().float()
    full = n - n % bs
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    torch.mul(values[:full].view(-1, bs), scales[:full // bs, None], out=out[:full].view(-1, bs))
    if full < n:
        torch.mul(values[full:], scales[-1], out=out[full:])
    return out.view(qw.shape).to(dtype or qw.dtype)
