"""Grouped GEMM for mixture-of-experts: one matmul per group of rows, all groups in one launch.

``y[rows of g] = x[rows of g] @ w[g].T`` for rows sorted by group: x (M, K),
w (G, N, K) in ``nn.Linear`` layout (one expert's weight per group), and
counts (G,) the number of rows of each group (zeros allowed: an expert with
no token). Group g's rows are ``x[off[g]:off[g + 1]]`` with ``off`` the
cumulative sum of counts, 0 first; ``sum(counts) == M``.

Gradients: ``dx = grouped(dy, w)`` (the same product with each w[g] not
transposed) and ``dw[g] = dy_g^T x_g`` (a reduction over the group's rows;
zero for an empty group).

**Triton path** (CUDA, or CPU under ``TRITON_INTERPRET=1``). Three launches'
worth of work, two kernels:

- ``_gmm_kernel`` computes ``out[rows of g] = a[rows of g] @ B_g`` where the
  (R, C) operand ``B_g`` of group g is read through strides: ``w[g].T`` for
  the forward, ``w[g]`` for dx. Programs own (BLOCK_M rows of one group) x
  (BLOCK_N columns) tiles. Group g has ``cdiv(count_g, BLOCK_M)`` row tiles;
  their prefix sum (a torch op on the device) gives each program its group
  by a binary search over it, so the launch needs no host sync: the grid is
  the upper bound ``cdiv(M, BLOCK_M) + G`` row tiles (each group wastes at
  most one partial tile), and programs past the last tile return at once.
  This keeps the op traceable by torch.compile (no ``.item()`` on counts).
- ``_gmm_dw_kernel``: one program per (group, BLOCK_N x BLOCK_K tile of dw)
  loops over the group's rows BLOCK_M at a time, ``acc += dy_tile^T x_tile``;
  an empty group's loop runs zero times and stores zeros.

Both accumulate in fp32 with ``tl.dot`` (tensor cores for fp16 / bf16;
fp32 operands use ``input_precision="ieee"``, as torch's fp32 matmul does
without TF32) and store in the inputs' dtype. Reads past ``M`` are masked, so
counts summing past M cannot read out of bounds (the CPU path refuses them;
the GPU path does not check, to stay free of host syncs).

**Torch reference** (the CPU path, :func:`grouped_mm_ref`): no Python loop over
groups. fp32 / fp16 / bf16 on CPU run ``torch._grouped_mm`` (one call each
for forward, dx and dw), which wants 16-byte aligned strides: an operand whose
row stride is not a multiple of 16 bytes is copied once into a buffer with a
padded row (the op only reads the unpadded view). Other dtypes (float64) and
devices scatter the rows into a zero-padded (G, max count, K) batch and run
one ``torch.bmm`` (the padded-batch formulation; it reads ``max(counts)``, a
host sync, acceptable for a reference).

**torch.compile**: both paths run inside the custom ops ``cuboid::grouped_mm``
and ``cuboid::grouped_mm_backward`` (defined below), whose fake
implementations give the output shapes, so a compiled caller traces one graph
(torch._grouped_mm's own fake kernel takes bf16 only, and the padded batch
reads ``max(counts)``); the host check of counts (:func:`_check`) is skipped
while compiling.

Launch configurations (``_MM_CFG``, ``_DW_CFG``): a row per operand kind
(aligned fp16 / bf16, unaligned fp16 / bf16, fp32), each a short list whose
entry 0 the launcher uses; ``AUTOTUNE`` counts the entries that
``bench/gpu.py`` can time and the compile gate compiles (nothing is tuned at
import or launch time).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op, register_autograd, register_fake

from ._backend import check_floating, check_same_dtype, dot_options, on_device, picked, resolve_backend
from .library import empty_output

Tensor = torch.Tensor
_OP = "grouped_mm"
_ALIGN = 16  # bytes: torch._grouped_mm's stride alignment
# Launch configurations (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per row: "half" (fp16 / bf16 with
# every row stride a multiple of 16 elements: vectorized, cp.async-pipelined loads), "half-unaligned" (some row
# stride is not: element-wise loads held in registers, so smaller tiles keep them from spilling), "fp32" (ieee
# dots on FMA units). Entry 0 is the launcher's; entry 1, where present, the GPU autotune alternative. The
# compile gate (tests/kernels/test_grouped_gemm_gate.py) compiles every entry for sm_80 and sm_90.
_MM_CFG = {"half": ((64, 128, 64, 4, 3), (128, 128, 64, 8, 3)),
           "half-unaligned": ((32, 64, 32, 4, 3), (64, 64, 32, 4, 2)),
           "fp32": ((128, 64, 32, 8, 3),)}
_DW_CFG = {"half": ((64, 128, 64, 4, 3), (64, 128, 128, 8, 3)),
           "half-unaligned": ((32, 64, 32, 4, 3), (32, 128, 32, 4, 2)),
           "fp32": ((64, 64, 32, 8, 3), (32, 64, 32, 4, 3))}
# op -> number of GPU autotune entries (cuboid.kernels._backend.autotune_pick("grouped_mm", i))
AUTOTUNE = {_OP: 2}


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _gmm_kernel(
    A,  # (M, R) rows sorted by group, strides (stride_am, stride_ar)
    B,  # group g's (R, C) operand at B + g * stride_bg, strides (stride_br, stride_bc)
    OUT,  # (M, C) output, row stride stride_om, unit column stride
    OFFS,  # (G + 1,) int64 row offsets: group g's rows are [OFFS[g], OFFS[g + 1])
    TILE_OFFS,  # (G + 1,) int64 prefix sums of cdiv(count_g, BLOCK_M): group g's row tiles
    M, R, C, G,
    stride_am, stride_ar, stride_bg, stride_br, stride_bc, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # convert tiles to fp32 before tl.dot (fp32 inputs; bf16 in the interpreter)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" for fp32 operands
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    lo = 0
    hi = G
    while lo < hi:  # binary search for the first group whose row tiles end after t: t's group
        mid = (lo + hi) // 2
        if tl.load(TILE_OFFS + mid + 1) <= t:
            lo = mid + 1
        else:
            hi = mid
    g = lo
    if g < G:  # else t is past the last tile (the grid is an upper bound)
        tile0 = tl.load(TILE_OFFS + g)
        row0 = tl.load(OFFS + g) + (t - tile0) * BLOCK_M  # int64: the tile's first row
        n_rows = tl.minimum(tl.load(OFFS + g + 1), M) - row0  # rows of the group left from row0
        rows = tl.arange(0, BLOCK_M)  # int32 offsets from row0 (the int64 part stays in the scalar base)
        row_ok = rows < n_rows
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        ks0 = tl.arange(0, BLOCK_K)
        a_ptrs = A + row0 * stride_am + rows[:, None] * stride_am + ks0[None, :] * stride_ar
        b_ptrs = B + g.to(tl.int64) * stride_bg + ks0[:, None] * stride_br + cols[None, :] * stride_bc
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, R, BLOCK_K):
            k_ok = k0 + ks0 < R
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ar
            b_ptrs += BLOCK_K * stride_br
        out_ptrs = OUT + row0 * stride_om + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gmm_dw_kernel(
    DY,  # (M, N) output gradient rows, strides (stride_dym, stride_dyn)
    X,  # (M, K) input rows, strides (stride_xm, stride_xk)
    DW,  # (G, N, K) weight gradient, contiguous
    OFFS,  # (G + 1,) int64 row offsets
    M, N, K,
    stride_dym, stride_dyn, stride_xm, stride_xk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    n_k = tl.cdiv(K, BLOCK_K)
    ns = (pid // n_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (pid % n_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K
    start = tl.load(OFFS + g)  # int64
    end = tl.minimum(tl.load(OFFS + g + 1), M)
    rows = tl.arange(0, BLOCK_M)  # int32 offsets from the scalar row r0
    dy_off = rows[:, None] * stride_dym + ns[None, :] * stride_dyn
    x_off = rows[:, None] * stride_xm + ks[None, :] * stride_xk
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):  # zero trips for an empty group: dw[g] = 0
        r_ok = rows < end - r0
        dy = tl.load(DY + r0 * stride_dym + dy_off, mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # (BM, BN)
        x = tl.load(X + r0 * stride_xm + x_off, mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # (BM, BK)
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(tl.trans(dy), x, acc, input_precision=PRECISION)
    dw_ptrs = DW + g.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
    tl.store(dw_ptrs, acc.to(DW.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _cfg(table: dict, dtype: torch.dtype, tensors, *sizes: int) -> Tuple[int, int, int, int, int]:
    """The picked entry of ``table``'s row for ``dtype``, the operands' alignment and the strides and sizes the
    kernel multiplies with (see _MM_CFG): "half" when every pointer is 16-byte aligned and every stride and size
    is 1 or a multiple of 16, Triton's specializations that make loads vectorize."""
    if dtype == torch.float32:
        return picked(_OP, table["fp32"])
    ints = [s for t in tensors for s in t.stride()] + list(sizes)
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors) and all(s == 1 or s % 16 == 0 for s in ints)
    return picked(_OP, table["half" if aligned else "half-unaligned"])


def _offsets(counts: Tensor, block_m: int = 1) -> Tensor:
    """(G + 1,) int64: 0, then the prefix sums of ``cdiv(counts, block_m)`` (row offsets for block_m = 1)."""
    c = counts.to(torch.int64)
    if block_m > 1:
        c = (c + (block_m - 1)) // block_m
    return F.pad(torch.cumsum(c, 0), (1, 0))


def _mm_triton(a: Tensor, b: Tensor, counts: Tensor, transpose_b: bool) -> Tensor:
    """``out[rows of g] = a[rows of g] @ (b[g].T if transpose_b else b[g])`` for b (G, P, Q)."""
    M, R = a.shape
    G = b.shape[0]
    C = b.shape[1] if transpose_b else b.shape[2]
    out = torch.empty((M, C), dtype=a.dtype, device=a.device)
    if M == 0 or C == 0:
        return out
    if R == 0:
        return out.zero_()
    stride_br, stride_bc = (b.stride(2), b.stride(1)) if transpose_b else (b.stride(1), b.stride(2))
    block_m, block_n, block_k, warps, stages = _cfg(_MM_CFG, a.dtype, (a, b), C)
    grid = (triton.cdiv(M, block_m) + G, triton.cdiv(C, block_n))
    with on_device(a):
        _gmm_kernel[grid](a, b, out, _offsets(counts), _offsets(counts, block_m), M, R, C, G,
                          a.stride(0), a.stride(1), b.stride(0), stride_br, stride_bc, out.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot_options(a.dtype),
                          num_warps=warps, num_stages=stages)
    return out


def _dw_triton(dy: Tensor, x: Tensor, counts: Tensor) -> Tensor:
    """``dw[g] = dy_g^T x_g`` as (G, N, K) in x's dtype; zeros for empty groups."""
    M, N = dy.shape
    K = x.shape[1]
    G = counts.shape[0]
    if M == 0 or N * K == 0:
        return torch.zeros((G, N, K), dtype=x.dtype, device=x.device)
    dw = torch.empty((G, N, K), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = _cfg(_DW_CFG, x.dtype, (dy, x), K)
    grid = (triton.cdiv(N, block_n) * triton.cdiv(K, block_k), G)
    with on_device(x):
        _gmm_dw_kernel[grid](dy, x, dw, _offsets(counts), M, N, K, dy.stride(0), dy.stride(1), x.stride(0),
                             x.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             **dot_options(x.dtype), num_warps=warps, num_stages=stages)
    return dw


# ----------------------------------------------------------------------------
# Torch reference (also the CPU path)
# ----------------------------------------------------------------------------


def _aligned(t: Tensor) -> Tensor:
    """``t`` itself when CPU torch._grouped_mm takes its strides (unit last stride, the others multiples of 16
    bytes, no stride 0; it does not ask for an aligned start), else a copy into a buffer whose rows are padded
    to 16 bytes, viewed back at t's shape."""
    size = t.element_size()
    if t.stride(-1) == 1 and all(s * size % _ALIGN == 0 and s > 0 for s in t.stride()[:-1]):
        return t
    width = t.shape[-1]
    padded = -(-max(width, 1) * size // _ALIGN) * _ALIGN // size
    buf = t.new_empty((*t.shape[:-1], padded))
    buf[..., :width] = t
    return buf[..., :width]


def _use_grouped_mm(t: Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and hasattr(torch, "_grouped_mm"))


def _gmm(a: Tensor, b: Tensor, offs32: Tensor) -> Tensor:
    """torch._grouped_mm on aligned operands, returned contiguous."""
    return torch._grouped_mm(a, b, offs=offs32).contiguous()


def _ref_values(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """The torch path's forward (the real implementation of the op cuboid::grouped_mm without Triton)."""
    if _use_grouped_mm(x):
        offs32 = torch.cumsum(counts, 0).to(torch.int32)
        return _gmm(_aligned(x), _aligned(w).transpose(1, 2), offs32)
    return _padded_batch(x, w, counts)


def _ref_grads(dy: Tensor, x: Tensor, w: Tensor, counts: Tensor, need_dx: bool,
               need_dw: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The torch path's (dx, dw), None where not needed: torch._grouped_mm for dx and dw on CPU (its own
    backward refuses expanded (stride-0) gradients and unaligned widths), padded batches otherwise."""
    if _use_grouped_mm(x):
        offs32 = torch.cumsum(counts, 0).to(torch.int32)
        dya, xa, wa = _aligned(dy), _aligned(x), _aligned(w)
        return (_gmm(dya, wa, offs32) if need_dx else None), (_gmm(dya.t(), xa, offs32) if need_dw else None)
    dx = _padded_batch(dy, w.transpose(1, 2), counts) if need_dx else None
    dw = None
    if need_dw:
        group, pos, width = _slots(counts, x.shape[0])
        dyb = dy.new_zeros((w.shape[0], width, dy.shape[1])).index_put((group, pos), dy)
        xb = x.new_zeros((w.shape[0], width, x.shape[1])).index_put((group, pos), x)
        dw = torch.bmm(dyb.transpose(1, 2), xb)
    return dx, dw


def _slots(counts: Tensor, M: int) -> Tuple[Tensor, Tensor, int]:
    """Each row's (group, position within the group) and the largest count (a host read)."""
    c = counts.to(torch.int64)
    group = torch.repeat_interleave(torch.arange(c.shape[0], device=c.device), c, output_size=M)
    pos = torch.arange(M, device=c.device) - (torch.cumsum(c, 0) - c)[group]
    return group, pos, int(c.max())


def _padded_batch(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """Any dtype or device: rows scattered into a zero-padded (G, max count, K) batch, one bmm, rows gathered
    back (w is (G, N, K) or a transposed view of one)."""
    group, pos, width = _slots(counts, x.shape[0])
    batch = x.new_zeros((w.shape[0], width, x.shape[1])).index_put((group, pos), x)
    return torch.bmm(batch, w.transpose(1, 2))[group, pos]


# ----------------------------------------------------------------------------
# The custom ops cuboid::grouped_mm and cuboid::grouped_mm_backward (both paths; kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::grouped_mm", mutates_args=())
def _grouped_mm(x: Tensor, w: Tensor, counts: Tensor, use_triton: bool) -> Tensor:
    """(M, N): ``x[rows of g] @ w[g].T``, the Triton kernel or the torch path (torch._grouped_mm / padded bmm)."""
    return _mm_triton(x, w, counts, transpose_b=True) if use_triton else _ref_values(x, w, counts)


@register_fake("cuboid::grouped_mm")
def _grouped_mm_fake(x, w, counts, use_triton):
    return x.new_empty((x.shape[0], w.shape[1]))


@custom_op("cuboid::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(dy: Tensor, x: Tensor, w: Tensor, counts: Tensor, use_triton: bool, need_dx: bool,
                         need_dw: bool) -> Tuple[Tensor, Tensor]:
    """(dx (M, K) or empty, dw (G, N, K) or empty) for dy (M, N) in x's dtype."""
    if use_triton:
        dx = _mm_triton(dy, w, counts, transpose_b=False) if need_dx else None
        dw = _dw_triton(dy, x, counts) if need_dw else None
    else:
        dx, dw = _ref_grads(dy, x, w, counts, need_dx, need_dw)
    return (dx if dx is not None else empty_output(x)), (dw if dw is not None else empty_output(w))


@register_fake("cuboid::grouped_mm_backward")
def _grouped_mm_backward_fake(dy, x, w, counts, use_triton, need_dx, need_dw):
    dx = x.new_empty(x.shape) if need_dx else empty_output(x)
    return dx, (w.new_empty(w.shape) if need_dw else empty_output(w))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts, use_triton = inputs
    ctx.save_for_backward(x, w, counts)
    ctx.use_triton = use_triton


def _grouped_mm_grad(ctx, dy):
    x, w, counts = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    dx, dw = _grouped_mm_backward(dy.to(x.dtype), x, w, counts, ctx.use_triton, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


register_autograd("cuboid::grouped_mm", _grouped_mm_grad, setup_context=_grouped_mm_setup)


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------


def _check(x, w, counts, *, triton_path: bool) -> None:
    for name, t in (("x", x), ("w", w), ("counts", counts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = (torch.float32, torch.float16, torch.bfloat16) + (() if triton_path else (torch.float64,))
    check_floating(_OP, "x", x, dtypes)
    check_floating(_OP, "w", w, dtypes)
    check_same_dtype(_OP, x=x, w=w)
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{_OP}: x must be (M, K) and w (G, N, K), got x {tuple(x.shape)} and w {tuple(w.shape)}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"{_OP}: x has {x.shape[1]} columns but w's groups take K={w.shape[2]} (w is (G, N, K), "
                         f"the nn.Linear layout)")
    if counts.dim() != 1 or counts.shape[0] != w.shape[0] or counts.dtype.is_floating_point or counts.is_complex():
        raise ValueError(f"{_OP}: counts must be a 1-D integer tensor of one count per group (G={w.shape[0]}), got "
                         f"{str(counts.dtype).replace('torch.', '')} {tuple(counts.shape)}")
    if counts.device != x.device:
        raise ValueError(f"{_OP}: counts must be on x's device ({x.device}), got {counts.device}")
    if w.shape[0] == 0:
        raise ValueError(f"{_OP}: w has no groups (G=0); give at least one group")
    if x.device.type == "cpu" and not torch.compiler.is_compiling():  # a host read: free on CPU, not on a GPU
        total = int(counts.sum())
        if total != x.shape[0] or bool((counts < 0).any()):
            raise ValueError(f"{_OP}: counts must be >= 0 and sum to x's {x.shape[0]} rows, got sum {total} "
                             f"(min {int(counts.min())})")


# ----------------------------------------------------------------------------
# Public functions (through the op cuboid::grouped_mm)
# ----------------------------------------------------------------------------


def grouped_mm_ref(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
    """Plain-torch grouped matmul ``y[rows of g] = x[rows of g] @ w[g].T`` (no loop over groups; see the module
    docstring). fp32 / fp16 / bf16 / float64; differentiable w.r.t. x and w."""
    _check(x, w, counts, triton_path=False)
    return _grouped_mm(x, w, counts, False)


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """The experts' matmul: ``y[rows of g] = x[rows of g] @ w[g].T`` for rows sorted by group.

    Args:
        x: (M, K) rows sorted by group; group g's rows are ``x[off[g]:off[g + 1]]``, ``off`` the cumulative sum
            of ``counts`` with 0 first.
        w: (G, N, K), one ``nn.Linear`` weight per group, x's dtype (fp32 / fp16 / bf16).
        counts: (G,) integer tensor on x's device, >= 0, summing to M (zeros: empty groups). The Triton path
            reads it on the device only (no host sync), so the call traces under torch.compile.
        backend: ``"triton"``, ``"torch"`` or None (automatic, see :func:`cuboid.kernels.resolve_backend`).

    Under autocast (``--dtype bf16``) x and w are cast to its dtype first, as ``F.linear`` is.

    Returns (M, N) in x's dtype (fp32 accumulation), differentiable w.r.t. x and w: ``dx = dy_g @ w[g]``,
    ``dw[g] = dy_g^T x_g`` (zero for an empty group).
    """
    for name, t in (("x", x), ("w", w), ("counts", counts)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    chosen = resolve_backend(_OP, [x, w, counts], backend)
    x, w = _autocast(x, w)
    _check(x, w, counts, triton_path=chosen == "triton")
    return _grouped_mm(x, w, counts, chosen == "triton")


def _autocast(x: Tensor, w: Tensor) -> tuple:
    """``x`` and ``w`` in the autocast dtype of their device when autocast is on there (``F.linear``'s rule: a
    custom op is not cast by autocast itself, so under ``--dtype bf16`` the experts ran on fp32 operands)."""
    dev = x.device.type
    try:
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    except (RuntimeError, ValueError, TypeError):  # a device autocast does not know (meta)
        dtype = None
    if dtype is None:
        return x, w
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in (x, w))
