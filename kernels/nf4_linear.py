"""NF4 dequantize and the fused NF4 linear (``x @ dequantize(W).T``), Triton with torch references.

The weight format is kernels/nf4.py's (bitsandbytes' layout): a flat
row-major weight of N x K values cut into blocks of ``blocksize`` (64), two
4-bit codes a byte (high nibble first), one scale per block, stored either in
fp32 or double quantized (a uint8 index into the 256-entry dynamic map times
the fp32 absmax of its group of 256 scales, plus an fp32 offset).

- ``dequantize_nf4(qw, dtype)``: one program per ``BLOCK`` values; each value
  is ``NF4[code] * scale`` in fp32, cast to ``dtype`` (scales rebuilt in fp32,
  multiply then add, with floating-point contraction off so the result is
  bit-equal to the reference).
- ``nf4_linear(x, qw, bias)``: the forward ``y = x @ W.T`` tiles (M, N) and
  dequantizes each (BLOCK_N, BLOCK_K) tile of W in registers right before its
  ``tl.dot`` (fp32 accumulation), so W never exists in 16 bits in memory.
  The weight is frozen (QLoRA): backward gives only ``dx = dy @ W``, through
  the dequantized weight (one dequantize, one matmul); no weight gradient.

Both are torch custom ops (``cuboid::nf4_dequantize``, ``cuboid::nf4_linear``
with its autograd; kernels/library.py says why); the public functions choose
the backend by the rule of kernels/_backend.py.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op, register_autograd, register_fake

from ._backend import check_floating, dot_options, on_device, resolve_backend
from .nf4 import NF4Weight, dequantize_nf4_ref

Tensor = torch.Tensor
BLOCK = 1024  # values per program of the dequantize kernel
# fused linear: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages; fp32 tiles are smaller (no tensor cores, and a
# 64-wide fp32 tile spills on sm_80/sm_90: the compile gate measures it)
_TILE = {torch.float16: (64, 64, 64, 4, 3), torch.bfloat16: (64, 64, 64, 4, 3), torch.float32: (32, 32, 32, 4, 2)}


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _scale_of(blk, mask, QA, NA, NMAP, OFF, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr):
    """fp32 scale of block index ``blk`` (any shape): the stored fp32 value, or NMAP[QA] * NA + OFF."""
    if NESTED:
        q = tl.load(QA + blk, mask=mask, other=0).to(tl.int32)
        second = tl.load(NA + blk // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        s = tl.load(NMAP + q, mask=mask, other=0.0) * second + tl.load(OFF)
    else:
        s = tl.load(QA + blk, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def _nf4_values(e, mask, P, CODE):
    """fp32 NF4 table values of flat element indices ``e``: byte e // 2, high nibble for even e."""
    byte = tl.load(P + e // 2, mask=mask, other=0).to(tl.int32)
    nib = tl.where(e % 2 == 0, byte >> 4, byte & 15)
    return tl.load(CODE + nib, mask=mask, other=0.0)


@triton.jit
def _nf4_dequant_kernel(
    P,  # ((n + 1) // 2,) uint8 packed codes
    QA,  # (blocks,) uint8 scale indices (NESTED) or fp32 scales
    NA,  # (ceil(blocks / 256),) fp32 second-level absmax (NESTED)
    NMAP,  # (256,) fp32 dynamic map (NESTED)
    OFF,  # (1,) fp32 offset (NESTED)
    CODE,  # (16,) fp32 NF4 table
    OUT,  # (n,) output, its dtype
    n,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < n
    v = _nf4_values(e, mask, P, CODE)
    s = _scale_of(e // BLOCKSIZE, mask, QA, NA, NMAP, OFF, NESTED, NESTED_BLOCKSIZE)
    tl.store(OUT + e, (v * s).to(OUT.dtype.element_ty), mask=mask)  # fp32 product, one rounding to the dtype


@triton.jit
def _nf4_linear_kernel(
    X,  # (M, K) activations, row stride stride_xm, unit column stride
    P, QA, NA, NMAP, OFF, CODE,  # the (N, K) NF4 weight, as in _nf4_dequant_kernel
    Y,  # (M, N) output, contiguous, X's dtype
    M, N, K, stride_xm,
    BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, NESTED_BLOCKSIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 tiles before tl.dot (fp32 inputs; bf16 in the interpreter)
    PRECISION: tl.constexpr,  # tl.dot input_precision
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row0 = rn.to(tl.int64) * K  # (BLOCK_N,) flat index of each weight row's first value
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xm = (rm[:, None] < M) & (kk[None, :] < K)
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + kk[None, :], mask=xm, other=0.0)
        wm = (rn[:, None] < N) & (kk[None, :] < K)
        e = row0[:, None] + kk[None, :]  # (BLOCK_N, BLOCK_K) flat weight indices
        v = _nf4_values(e, wm, P, CODE)
        s = _scale_of(e // BLOCKSIZE, wm, QA, NA, NMAP, OFF, NESTED, NESTED_BLOCKSIZE)
        w = (v * s).to(X.dtype.element_ty)  # the dequantized tile, rounded as dequantize_nf4 rounds it
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    ym = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(Y + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(Y.dtype.element_ty), mask=ym)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _state(qw: NF4Weight) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(absmax, nested_absmax, nested_map, offset (1,), code) as the kernels take them; absent ones empty."""
    if qw.double_quant:
        return qw.absmax, qw.nested_absmax, qw.nested_quant_map, qw.offset.reshape(1).float(), qw.quant_map
    empty = qw.absmax.new_empty((0,), dtype=torch.float32)
    return qw.absmax.float(), empty, empty, empty, qw.quant_map


def _dequant_launch(packed, absmax, nested_absmax, nested_map, offset, code, n, blocksize, dtype) -> Tensor:
    out = torch.empty(n, dtype=dtype, device=packed.device)
    if n:
        nested = nested_absmax.numel() > 0
        with on_device(packed):
            _nf4_dequant_kernel[(triton.cdiv(n, BLOCK),)](
                packed, absmax, nested_absmax if nested else absmax, nested_map if nested else code,
                offset if nested else absmax, code, out, n, BLOCKSIZE=blocksize, NESTED=nested,
                NESTED_BLOCKSIZE=256, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def _linear_launch(x2, packed, absmax, nested_absmax, nested_map, offset, code, n_out, blocksize) -> Tensor:
    M, K = x2.shape
    y = torch.empty((M, n_out), dtype=x2.dtype, device=x2.device)
    if M and n_out:
        bm, bn, bk, warps, stages = _TILE[x2.dtype]
        nested = nested_absmax.numel() > 0
        with on_device(x2):
            _nf4_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(n_out, bn))](
                x2, packed, absmax, nested_absmax if nested else absmax, nested_map if nested else code,
                offset if nested else absmax, code, y, M, n_out, K, x2.stride(0), BLOCKSIZE=blocksize,
                NESTED=nested, NESTED_BLOCKSIZE=256, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **dot_options(x2.dtype),
                num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return y


# ----------------------------------------------------------------------------
# The custom ops cuboid::nf4_dequantize and cuboid::nf4_linear (the Triton path)
# ----------------------------------------------------------------------------


@custom_op("cuboid::nf4_dequantize", mutates_args=())
def _nf4_dequantize(packed: Tensor, absmax: Tensor, nested_absmax: Tensor, nested_map: Tensor, offset: Tensor,
                    code: Tensor, n: int, blocksize: int, dtype: torch.dtype) -> Tensor:
    """The first ``n`` values of an NF4 weight, flat, in ``dtype``."""
    return _dequant_launch(packed, absmax, nested_absmax, nested_map, offset, code, n, blocksize, dtype)


@register_fake("cuboid::nf4_dequantize")
def _nf4_dequantize_fake(packed, absmax, nested_absmax, nested_map, offset, code, n, blocksize, dtype):
    return packed.new_empty((n,), dtype=dtype)


@custom_op("cuboid::nf4_linear", mutates_args=())
def _nf4_linear(x: Tensor, packed: Tensor, absmax: Tensor, nested_absmax: Tensor, nested_map: Tensor,
                offset: Tensor, code: Tensor, n_out: int, blocksize: int) -> Tensor:
    """``x @ W.T`` of (M, K) rows and an (n_out, K) NF4 weight, W dequantized tile by tile."""
    return _linear_launch(x, packed, absmax, nested_absmax, nested_map, offset, code, n_out, blocksize)


@register_fake("cuboid::nf4_linear")
def _nf4_linear_fake(x, packed, absmax, nested_absmax, nested_map, offset, code, n_out, blocksize):
    return x.new_empty((x.shape[0], n_out))


def _nf4_linear_setup(ctx, inputs, output):
    x, packed, absmax, nested_absmax, nested_map, offset, code, n_out, blocksize = inputs
    ctx.save_for_backward(packed, absmax, nested_absmax, nested_map, offset, code)
    ctx.shape, ctx.blocksize, ctx.dtype = (n_out, x.shape[1]), blocksize, x.dtype


def _nf4_linear_grad(ctx, dy):
    packed, absmax, nested_absmax, nested_map, offset, code = ctx.saved_tensors
    n_out, k = ctx.shape
    w = _nf4_dequantize(packed, absmax, nested_absmax, nested_map, offset, code, n_out * k, ctx.blocksize,
                        ctx.dtype).view(n_out, k)
    return (dy.to(ctx.dtype) @ w,) + (None,) * 8  # the frozen weight and its state take no gradient


register_autograd("cuboid::nf4_linear", _nf4_linear_grad, setup_context=_nf4_linear_setup)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def dequantize_nf4(qw: NF4Weight, dtype: Optional[torch.dtype] = None, *, backend: Optional[str] = None) -> Tensor:
    """The weight ``qw`` in ``dtype`` (default: the dtype it was quantized from), shape ``qw.shape``."""
    dtype = dtype or qw.dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dequantize_nf4: dtype must be float32, float16 or bfloat16, got {dtype}")
    if resolve_backend("nf4_dequantize", [qw.weight], backend) == "torch":
        return dequantize_nf4_ref(qw, dtype)
    flat = _nf4_dequantize(qw.weight.reshape(-1), *_state(qw), qw.numel, qw.blocksize, dtype)
    return flat.view(qw.shape)


def nf4_linear_ref(x: Tensor, qw: NF4Weight, bias: Optional[Tensor] = None) -> Tensor:
    """Plain torch: ``F.linear(x, dequantize(W) in x's dtype, bias)``; the gradient reaches x and bias only."""
    return F.linear(x, dequantize_nf4_ref(qw, x.dtype), bias)


class _NF4LinearTorch(torch.autograd.Function):
    """The torch path when a gradient is wanted: ``F.linear`` of the dequantized weight, which backward
    dequantizes again for ``dx`` rather than keeping a 16-bit copy of the weight from forward."""

    @staticmethod
    def forward(ctx, x, bias, qw):
        ctx.qw, ctx.has_bias = qw, bias is not None
        ctx.save_for_backward(x)
        return F.linear(x, dequantize_nf4_ref(qw, x.dtype), bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = dy.matmul(dequantize_nf4_ref(ctx.qw, x.dtype)) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return dx, db, None


def nf4_linear(x: Tensor, qw: NF4Weight, bias: Optional[Tensor] = None, *, backend: Optional[str] = None) -> Tensor:
    """``x @ W.T (+ bias)`` for an (N, K) NF4 weight ``qw`` and x of shape (..., K) (fp32/fp16/bf16).

    The weight is frozen: the result is differentiable in x (through the
    dequantized weight) and in bias, never in W.
    """
    op = "nf4_linear"
    check_floating(op, "x", x)
    if len(qw.shape) != 2 or x.shape[-1] != qw.shape[1]:
        raise ValueError(f"{op}: x's last dimension {x.shape[-1]} does not match the weight {tuple(qw.shape)}")
    if resolve_backend(op, [x, qw.weight], backend) == "torch":
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
            return _NF4LinearTorch.apply(x, bias, qw)
        return nf4_linear_ref(x, qw, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _nf4_linear(x2, qw.weight.reshape(-1), *_state(qw), qw.shape[0], qw.blocksize)
    y = y.view(*x.shape[:-1], qw.shape[0])
    return y if bias is None else y + bias.to(y.dtype)
