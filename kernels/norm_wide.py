"""The wide-row kernels of layer norm and RMS norm (rows over ``MAX_ONE_PASS`` columns), launched by kernels/norm.py.

Held whole in registers, a row wider than ``MAX_ONE_PASS`` (8192) columns
spills on sm_80 / sm_90, so these kernels loop over ``BLOCK_N`` columns at a
time: the forward (one program a row, one pass per statistic, ``h`` recomputed
from ``x`` and the residual in each pass), the backward's ``dx`` (one program a
row), and a column-parallel kernel that sums ``dweight`` / ``dbias`` over row
groups into ``(groups, N)`` fp32 partial buffers, which torch then sums. The
launchers, the torch reference and the custom ops are in kernels/norm.py.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_h(X, R, H, row, cols, mask, stride_x, stride_r, HAS_RES: tl.constexpr):
    """fp32 ``h`` for columns ``cols`` of ``row``: x, or x + residual rounded to h's dtype (what the caller gets)."""
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h = (h + r).to(H.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def norm_fwd_wide_kernel(
    X, R, W, B, Y, H, MEAN, RSTD,  # as in kernels/norm.py's _norm_fwd_kernel
    M, N, stride_x, stride_r, eps,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per chunk; a row is N > BLOCK_N columns
):
    # One program per row. Pass 1 writes h and sums h (RMS: h^2); layer norm sums squared deviations from the
    # mean in pass 2 (two passes: no E[h^2] - E[h]^2 cancellation); the last pass normalises. fp32 throughout.
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for off in range(0, N, BLOCK_N):
        cols = off + cols0
        mask = cols < N
        h = _load_h(X, R, H, row, cols, mask, stride_x, stride_r, HAS_RES)
        if HAS_RES:
            tl.store(H + row * N + cols, h.to(H.dtype.element_ty), mask=mask)
        if IS_RMS:
            acc += h * h
        else:
            acc += h
    mean = 0.0
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    else:
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for off in range(0, N, BLOCK_N):
            cols = off + cols0
            mask = cols < N
            hc = tl.where(mask, _load_h(X, R, H, row, cols, mask, stride_x, stride_r, HAS_RES) - mean, 0.0)
            acc += hc * hc
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    for off in range(0, N, BLOCK_N):
        cols = off + cols0
        mask = cols < N
        y = (_load_h(X, R, H, row, cols, mask, stride_x, stride_r, HAS_RES) - mean) * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _xhat_wdy(X, DY, W, row, cols, mask, N, stride_dy, mean, rstd, HAS_W: tl.constexpr):
    """One chunk of a wide row: the normalised input and w * dy (dy alone without w), fp32, zero off the row."""
    xhat = tl.where(mask, (tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd, 0.0)
    wdy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        wdy = wdy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return xhat, wdy


@triton.jit
def norm_bwd_wide_kernel(
    DY, DH, X, W, MEAN, RSTD, DX,  # as in kernels/norm.py's _norm_bwd_kernel
    M, N, stride_dy, stride_dh,
    IS_RMS: tl.constexpr, HAS_DH: tl.constexpr, HAS_W: tl.constexpr,
    BLOCK_N: tl.constexpr,  # columns per chunk; a row is N > BLOCK_N columns
):
    # dx only (dweight / dbias: norm_bwd_dwdb_kernel). One program per row: pass 1 sums the row's two
    # reductions over chunks, pass 2 recomputes xhat and writes dx.
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N)
    rstd = tl.load(RSTD + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + row)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)  # xhat * w * dy
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)  # w * dy
    for off in range(0, N, BLOCK_N):
        cols = off + cols0
        mask = cols < N
        xhat, wdy = _xhat_wdy(X, DY, W, row, cols, mask, N, stride_dy, mean, rstd, HAS_W)
        acc1 += xhat * wdy
        acc2 += wdy
    c1 = tl.sum(acc1, axis=0) / N
    c2 = tl.sum(acc2, axis=0) / N
    for off in range(0, N, BLOCK_N):
        cols = off + cols0
        mask = cols < N
        xhat, wdy = _xhat_wdy(X, DY, W, row, cols, mask, N, stride_dy, mean, rstd, HAS_W)
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DH:
            dx += tl.load(DH + row * stride_dh + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def norm_bwd_dwdb_kernel(
    DY,  # (M, N) grad of the normalised output, row stride stride_dy
    X,  # (M, N) saved norm input, contiguous
    MEAN, RSTD,  # (M,) fp32 statistics (MEAN unused for RMS)
    DW_PART, DB_PART,  # (groups, N) fp32 partial column sums (when COMPUTE_DW / COMPUTE_DB)
    M, N, rows_per_prog, stride_dy,
    IS_RMS: tl.constexpr, COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Column-parallel: program (column block, row group) sums dy * xhat and dy over the group's rows in fp32.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = group * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    for off in range(row_start, row_end, BLOCK_M):
        rows = off + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if COMPUTE_DW:
            x = tl.load(X + rows64[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            dw += tl.sum(dy * xhat, axis=0)
        if COMPUTE_DB:
            db += tl.sum(dy, axis=0)
    if COMPUTE_DW:
        tl.store(DW_PART + group * N + cols, dw, mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB_PART + group * N + cols, db, mask=col_mask)
