"""Layer norm and RMS norm over the last dimension, with the residual add fused.

- LayerNorm (Ba, Kiros & Hinton 2016, arXiv 1607.06450):
  ``y = (h - mean(h)) / sqrt(var(h) + eps) * weight + bias``
- RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467):
  ``y = h / sqrt(mean(h^2) + eps) * weight``

where ``h = x + residual`` when a residual is given (pre-norm transformer
blocks: the call returns ``(norm(h), h)`` so the caller keeps ``h`` as the new
residual stream) and ``h = x`` otherwise.

Layout: ``x`` is ``(..., N)``, flattened to ``M`` rows of hidden size ``N``
(1 <= N <= 65536 on the Triton path; the row must fit one block). ``weight`` and
``bias`` are ``(N,)`` or ``None`` (no scale / no shift).

Dtypes: ``x`` (and ``residual``, which must match it) is fp32, fp16 or bf16 and
the outputs have ``x``'s dtype. ``weight`` and ``bias`` each have either ``x``'s
dtype or fp32 (fp32 norm parameters beside bf16/fp16 activations is the usual
mixed-precision setup); their gradients come back in their own dtype. All
arithmetic (statistics, normalisation, affine, gradients) is fp32; half
precision exists only at loads and stores. ``h`` is rounded to ``x``'s dtype
before it is normalised, so ``norm(h)`` is exactly the norm of the returned
``h``.

Design: the forward and backward follow the structure of the Triton layer-norm
tutorial and of Liger-Kernel, re-derived here. The forward gives each program a
``(BLOCK_M, BLOCK_N)`` tile: ``BLOCK_N`` covers a whole row (next power of two
of ``N``, masked tail) and ``BLOCK_M`` packs several rows when ``N`` is small.
It stores the fp32 ``mean`` (layer norm only) and ``rstd`` per row. The backward
recomputes ``xhat`` from the saved input (``h`` or ``x``) and the statistics,
writes ``dx`` per row, and reduces ``dweight`` / ``dbias`` without atomics: a
fixed number of programs each own a contiguous group of rows, accumulate fp32
column sums over it, and write one row of a ``(num_programs, N)`` fp32 buffer,
which torch then sums. The result is deterministic run to run.

Rows wider than ``MAX_ONE_PASS`` (8192) columns take a chunked path instead:
held whole in registers, such a row spills on sm_80 / sm_90 (the compile gate,
tests/kernels/compile_gate.py, measures it). There one program owns a row and
loops over ``WIDE_BLOCK_N`` columns at a time, once per statistic (``h`` is
recomputed from ``x`` and the residual in each pass), and a separate
column-parallel kernel sums ``dweight`` / ``dbias`` over row groups into the
same ``(groups, N)`` partial buffers. Those three kernels live in
kernels/norm_wide.py; their launchers are here.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op, register_autograd, register_fake

from ._backend import check_floating, on_device, picked, resolve_backend
from .library import empty_output, or_none
from .norm_wide import norm_bwd_dwdb_kernel, norm_bwd_wide_kernel, norm_fwd_wide_kernel

MAX_BLOCK_N = 65536  # widest row the Triton path normalises
MAX_ONE_PASS = 8192  # widest row held in registers whole; wider rows loop over chunks (no spills)
TILE_ELEMS = 4096  # target elements per program tile (rows packed when N is small)
WIDE_BLOCK_N, WIDE_WARPS = 4096, 8  # chunk and warps of the wide-row kernels
DWDB_BLOCK_M, DWDB_BLOCK_N, DWDB_WARPS = 8, 512, 8  # tile of the wide path's dweight / dbias kernel
# op -> number of GPU autotune entries: entry 1 doubles the one-pass kernels' warps (see _block_sizes)
AUTOTUNE = {"norm": 2}

Tensor = torch.Tensor
NormOut = Union[Tensor, Tuple[Tensor, Tensor]]


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _norm_fwd_kernel(
    X,  # (M, N) input rows, row stride stride_x, x dtype
    R,  # (M, N) residual rows, row stride stride_r (when HAS_RES)
    W,  # (N,) weight, x dtype or fp32 (when HAS_W)
    B,  # (N,) bias, x dtype or fp32 (when HAS_B)
    Y,  # (M, N) output, contiguous, x dtype
    H,  # (M, N) output h = x + residual, contiguous, x dtype (when HAS_RES)
    MEAN,  # (M,) fp32 row means (when not IS_RMS)
    RSTD,  # (M,) fp32 row 1/sqrt(var + eps) or 1/sqrt(mean(h^2) + eps)
    M,  # number of rows
    N,  # hidden size
    stride_x,
    stride_r,
    eps,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    # fp32 accumulation throughout; half precision only at load/store.
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out_offs = rows64[:, None] * N + cols[None, :]
    if HAS_RES:
        r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + out_offs, h, mask=mask)
        x = h.to(tl.float32)  # normalise the rounded h that the caller receives

    if IS_RMS:
        ms = tl.sum(x * x, axis=1) / N
        rstd = 1.0 / tl.sqrt(ms + eps)
        xhat = x * rstd[:, None]
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        xhat = xc * rstd[:, None]
        tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = xhat
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + out_offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    DY,  # (M, N) grad of the normalised output, row stride stride_dy
    DH,  # (M, N) grad of the returned h, row stride stride_dh (when HAS_DH)
    X,  # (M, N) saved input of the norm (h, or x without residual), contiguous
    W,  # (N,) weight, x dtype or fp32 (when HAS_W)
    MEAN,  # (M,) fp32 (when not IS_RMS)
    RSTD,  # (M,) fp32
    DX,  # (M, N) grad of h (= dx = dresidual), contiguous, x dtype
    DW_PART,  # (num_programs, N) fp32 partial dweight sums (when COMPUTE_DW)
    DB_PART,  # (num_programs, N) fp32 partial dbias sums (when COMPUTE_DB)
    M,
    N,
    rows_per_prog,  # rows owned by each program, a multiple of BLOCK_M
    stride_dy,
    stride_dh,
    IS_RMS: tl.constexpr,
    HAS_DH: tl.constexpr,
    HAS_W: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # fp32 column sums over this program's rows
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)

    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    for off in range(row_start, row_end, BLOCK_M):
        rows = off + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        offs = rows64[:, None] * N + cols[None, :]

        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy

        # dx = rstd * (wdy - xhat * mean(xhat * wdy) [- mean(wdy) for layer norm])
        c1 = tl.sum(xhat * wdy, axis=1) / N
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(wdy, axis=1) / N
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DH:
            dx += tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)

        if COMPUTE_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DB:
            db_acc += tl.sum(dy, axis=0)

    if COMPUTE_DW:
        tl.store(DW_PART + pid * N + cols, dw_acc, mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PART + pid * N + cols, db_acc, mask=col_mask)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _check_hidden(op: str, N: int) -> None:
    if N > MAX_BLOCK_N:
        raise ValueError(f"{op}: hidden size {N} exceeds the Triton limit {MAX_BLOCK_N}; use backend='torch'")


def _block_sizes(M: int, N: int) -> Tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a whole row per block, rows packed up to TILE_ELEMS."""
    block_n = triton.next_power_of_2(N)
    block_m = max(1, min(TILE_ELEMS // block_n, triton.next_power_of_2(max(M, 1))))
    tile = block_m * block_n
    # one heuristic, no autotune (the interpreter cannot run multi-config autotune)
    num_warps = 16 if tile >= 8192 else 8 if tile >= 2048 else 4
    return block_m, block_n, picked("norm", (num_warps, 2 * num_warps))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_bwd_programs(device: torch.device, M: int, block_m: int) -> int:
    """Programs for the backward: ~2 per SM on a GPU, a few in the (sequential) interpreter."""
    if device.type == "cuda":
        target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4
    return max(1, min(target, triton.cdiv(M, block_m)))


def _rows(t: Tensor, N: int) -> Tensor:
    """View ``t`` as (M, N) rows with unit column stride (copying only if needed)."""
    t2 = t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 or N == 1 else t2.contiguous()


def _norm_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
              eps: float, is_rms: bool):
    """Launch the forward. Returns (y, h or None, mean or None, rstd); y, h contiguous like x."""
    N = x.shape[-1]
    x2 = _rows(x, N)
    M = x2.shape[0]
    block_m, block_n, num_warps = _block_sizes(M, N)
    r2 = _rows(residual, N) if residual is not None else None
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: row stride N
    h = torch.empty_like(y) if residual is not None else None
    mean = None if is_rms else torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if M > 0 and block_n > MAX_ONE_PASS:
        with on_device(x):
            norm_fwd_wide_kernel[(M,)](
                x2, r2, weight, bias, y, h, mean, rstd, M, N,
                x2.stride(0), r2.stride(0) if r2 is not None else 0, float(eps),
                IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None,
                HAS_B=bias is not None, BLOCK_N=WIDE_BLOCK_N, num_warps=WIDE_WARPS,
            )
    elif M > 0:
        with on_device(x):
            _norm_fwd_kernel[(triton.cdiv(M, block_m),)](
                x2, r2, weight, bias, y, h, mean, rstd, M, N,
                x2.stride(0), r2.stride(0) if r2 is not None else 0, float(eps),
                IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None,
                HAS_B=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
            )
    return y, h, mean, rstd


def _norm_bwd(dy: Optional[Tensor], dh: Optional[Tensor], xin: Tensor, weight: Optional[Tensor],
              mean: Optional[Tensor], rstd: Tensor, is_rms: bool, compute_dw: bool, compute_db: bool):
    """Launch the backward. ``xin`` is the saved (M, N) norm input. Returns (dh_total, dw32, db32)."""
    M, N = xin.shape
    if dy is None:  # only the returned h was used downstream: no weight/bias grads (like autograd)
        return dh.reshape(M, N).to(xin.dtype, copy=True), None, None
    if M == 0:
        z = torch.zeros(N, dtype=torch.float32, device=xin.device)
        return torch.zeros_like(xin), (z if compute_dw else None), (z.clone() if compute_db else None)
    block_m, block_n, num_warps = _block_sizes(M, N)
    dy2 = _rows(dy, N)
    dh2 = _rows(dh, N) if dh is not None else None
    dx = torch.empty((M, N), dtype=xin.dtype, device=xin.device)
    if block_n > MAX_ONE_PASS:
        return _norm_bwd_wide(dy2, dh2, xin, weight, mean, rstd, dx, is_rms, compute_dw, compute_db)
    grid = _num_bwd_programs(xin.device, M, block_m)
    rows_per_prog = triton.cdiv(triton.cdiv(M, grid), block_m) * block_m
    grid = max(1, triton.cdiv(M, rows_per_prog))
    dw_part = torch.empty((grid, N), dtype=torch.float32, device=xin.device) if compute_dw else None
    db_part = torch.empty((grid, N), dtype=torch.float32, device=xin.device) if compute_db else None
    with on_device(xin):
        _norm_bwd_kernel[(grid,)](
            dy2, dh2, xin, weight, mean, rstd, dx, dw_part, db_part, M, N, rows_per_prog,
            dy2.stride(0), dh2.stride(0) if dh2 is not None else 0,
            IS_RMS=is_rms, HAS_DH=dh is not None, HAS_W=weight is not None,
            COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    dw = dw_part.sum(0) if compute_dw else None  # deterministic reduction of the partials
    db = db_part.sum(0) if compute_db else None
    return dx, dw, db


def _norm_bwd_wide(dy2, dh2, xin, weight, mean, rstd, dx, is_rms: bool, compute_dw: bool, compute_db: bool):
    """The backward for rows wider than MAX_ONE_PASS: dx row by row, dweight / dbias column-parallel."""
    M, N = xin.shape
    with on_device(xin):
        norm_bwd_wide_kernel[(M,)](
            dy2, dh2, xin, weight, mean, rstd, dx, M, N,
            dy2.stride(0), dh2.stride(0) if dh2 is not None else 0,
            IS_RMS=is_rms, HAS_DH=dh2 is not None, HAS_W=weight is not None,
            BLOCK_N=WIDE_BLOCK_N, num_warps=WIDE_WARPS,
        )
    if not (compute_dw or compute_db):
        return dx, None, None
    col_blocks = triton.cdiv(N, DWDB_BLOCK_N)
    groups = max(1, triton.cdiv(_num_bwd_programs(xin.device, M, DWDB_BLOCK_M), col_blocks))
    rows_per_prog = triton.cdiv(triton.cdiv(M, groups), DWDB_BLOCK_M) * DWDB_BLOCK_M
    groups = max(1, triton.cdiv(M, rows_per_prog))
    dw_part = torch.empty((groups, N), dtype=torch.float32, device=xin.device) if compute_dw else None
    db_part = torch.empty((groups, N), dtype=torch.float32, device=xin.device) if compute_db else None
    with on_device(xin):
        norm_bwd_dwdb_kernel[(col_blocks, groups)](
            dy2, xin, mean, rstd, dw_part, db_part, M, N, rows_per_prog, dy2.stride(0),
            IS_RMS=is_rms, COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db,
            BLOCK_M=DWDB_BLOCK_M, BLOCK_N=DWDB_BLOCK_N, num_warps=DWDB_WARPS,
        )
    return dx, (dw_part.sum(0) if compute_dw else None), (db_part.sum(0) if compute_db else None)


# ----------------------------------------------------------------------------
# The custom ops cuboid::norm and cuboid::norm_backward (the Triton path; kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::norm", mutates_args=())
def _norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
          is_rms: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, h or empty, mean or empty, rstd): the fused residual norm's forward."""
    y, h, mean, rstd = _norm_fwd(x, weight, bias, residual, eps, is_rms)
    f32 = torch.float32
    h = h if h is not None else empty_output(x)
    return y, h, (mean if mean is not None else empty_output(x, f32)), rstd


@register_fake("cuboid::norm")
def _norm_fake(x, weight, bias, residual, eps, is_rms):
    rows = x.numel() // x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else empty_output(x)
    mean = empty_output(x, torch.float32) if is_rms else x.new_empty((rows,), dtype=torch.float32)
    return y, h, mean, x.new_empty((rows,), dtype=torch.float32)


@custom_op("cuboid::norm_backward", mutates_args=())
def _norm_backward(dy: Tensor, dh: Optional[Tensor], xin: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                   rstd: Tensor, is_rms: bool, compute_dw: bool, compute_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(d of the norm's input (M, N), dweight or empty, dbias or empty), fp32 parameter gradients."""
    dx, dw, db = _norm_bwd(dy, dh, xin, weight, mean, rstd, is_rms, compute_dw, compute_db)
    f32 = torch.float32
    dw = dw if dw is not None else empty_output(xin, f32)
    return dx, dw, (db if db is not None else empty_output(xin, f32))


@register_fake("cuboid::norm_backward")
def _norm_backward_fake(dy, dh, xin, weight, mean, rstd, is_rms, compute_dw, compute_db):
    n = xin.shape[-1]
    part = (lambda on: xin.new_empty((n,) if on else (0,), dtype=torch.float32))
    return torch.empty_like(xin, memory_format=torch.contiguous_format), part(compute_dw), part(compute_db)


def _norm_setup(ctx, inputs, output):
    x, weight, bias, residual, eps, is_rms = inputs
    y, h, mean, rstd = output
    xin = h if residual is not None else x
    ctx.save_for_backward(xin, weight, mean, rstd)
    ctx.is_rms, ctx.shape, ctx.has_residual = is_rms, x.shape, residual is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.mark_non_differentiable(mean, rstd)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no weight gradient from h alone


def _norm_grad(ctx, dy, dh, dmean, drstd):
    xin, weight, mean, rstd = ctx.saved_tensors
    n = ctx.shape[-1]
    need_x, need_w, need_b, need_r = ctx.needs_input_grad[:4]
    if not ctx.has_residual:
        dh = None
    if dy is None:  # only the returned h was used downstream: no weight/bias grads (like autograd)
        dx = dh.reshape(ctx.shape).to(xin.dtype) if dh is not None else torch.zeros(ctx.shape, dtype=xin.dtype,
                                                                                   device=xin.device)
        return (dx if need_x else None), None, None, (dx if need_r else None), None, None
    compute_dw = weight is not None and need_w
    compute_db = ctx.bias_dtype is not None and need_b
    dx, dw, db = _norm_backward(dy, dh, xin.reshape(-1, n).contiguous(), weight, or_none(mean), rstd, ctx.is_rms,
                                compute_dw, compute_db)
    dx = dx.view(ctx.shape)
    dw = dw.to(weight.dtype) if compute_dw else None
    db = db.to(ctx.bias_dtype) if compute_db else None
    return (dx if need_x else None), dw, db, (dx if need_r else None), None, None


register_autograd("cuboid::norm", _norm_grad, setup_context=_norm_setup)


# ----------------------------------------------------------------------------
# Torch references (also the CPU path)
# ----------------------------------------------------------------------------


def _f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.float()


def _layer_norm_torch(x, weight, bias, eps, residual) -> NormOut:
    h = x if residual is None else x + residual
    y = F.layer_norm(h.float(), (h.shape[-1],), _f32(weight), _f32(bias), eps).to(x.dtype)
    return y if residual is None else (y, h)


def _rms_norm_torch(x, weight, eps, residual) -> NormOut:
    h = x if residual is None else x + residual
    h32 = h.float()
    y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def _check(op: str, x, weight, bias, eps, residual) -> None:
    """Validate arguments; one-line errors that name the argument."""
    check_floating(op, "x", x)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must have a last (hidden) dimension of size >= 1, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_floating(op, name, p)
        if tuple(p.shape) != (N,):
            raise ValueError(f"{op}: {name} has shape {tuple(p.shape)}, expected ({N},) for x of shape {tuple(x.shape)}")
        if p.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{op}: {name} has dtype {str(p.dtype)[6:]}, expected x's dtype "
                            f"{str(x.dtype)[6:]} or float32")
    if residual is not None:
        check_floating(op, "residual", residual)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual has shape {tuple(residual.shape)}, expected x's shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual has dtype {str(residual.dtype)[6:]}, expected x's dtype {str(x.dtype)[6:]}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{op}: eps must be a number > 0, got {eps!r}")


def layer_norm_ref(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5,
                   residual: Optional[Tensor] = None) -> NormOut:
    """Plain-torch layer norm (fp32 compute, result in x's dtype); see :func:`layer_norm`."""
    _check("layer_norm", x, weight, bias, eps, residual)
    return _layer_norm_torch(x, weight, bias, eps, residual)


def rms_norm_ref(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6,
                 residual: Optional[Tensor] = None) -> NormOut:
    """Plain-torch RMS norm (fp32 compute, result in x's dtype); see :func:`rms_norm`."""
    _check("rms_norm", x, weight, None, eps, residual)
    return _rms_norm_torch(x, weight, eps, residual)


# ----------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------


def _dense(p: Optional[Tensor]) -> Optional[Tensor]:
    """A weight or bias as the kernels index it: (N,) with stride 1."""
    return None if p is None else p.contiguous()


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5,
               residual: Optional[Tensor] = None, *, backend: Optional[str] = None) -> NormOut:
    """Layer norm over the last dim of ``x`` (..., N), optionally fused with a residual add.

    ``weight`` / ``bias``: (N,) in x's dtype or fp32, or None. Without ``residual``
    returns ``y``; with it (same shape and dtype as x) returns ``(y, h)`` where
    ``h = x + residual`` and ``y = layer_norm(h)``. Output dtype is x's dtype;
    mean and rstd are fp32. ``backend``: "triton", "torch" or None (automatic).
    """
    _check("layer_norm", x, weight, bias, eps, residual)
    if resolve_backend("layer_norm", [x, weight, bias, residual], backend) == "torch":
        return _layer_norm_torch(x, weight, bias, eps, residual)
    _check_hidden("layer_norm", x.shape[-1])
    y, h, _, _ = _norm(x, _dense(weight), _dense(bias), residual, float(eps), False)
    return (y, h) if residual is not None else y


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float = 1e-6,
             residual: Optional[Tensor] = None, *, backend: Optional[str] = None) -> NormOut:
    """RMS norm over the last dim of ``x`` (..., N), optionally fused with a residual add.

    ``weight``: (N,) in x's dtype or fp32, or None. Returns ``y``, or ``(y, h)``
    with ``h = x + residual`` when a residual is given; see :func:`layer_norm`.
    """
    _check("rms_norm", x, weight, None, eps, residual)
    if resolve_backend("rms_norm", [x, weight, residual], backend) == "torch":
        return _rms_norm_torch(x, weight, eps, residual)
    _check_hidden("rms_norm", x.shape[-1])
    y, h, _, _ = _norm(x, _dense(weight), None, residual, float(eps), True)
    return (y, h) if residual is not None else y
