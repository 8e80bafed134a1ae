"""Fused linear cross-entropy: the LM head's matmul and the cross-entropy, a chunk of rows at a time.

``loss = cross_entropy(x @ W.T + b, labels)`` for x (N, H), W (V, H) and
labels (N,), without ever holding the (N, V) logits: rows are taken ``chunk``
at a time; for each chunk the logits (chunk, V) are made, the loss terms and
at once the gradient of the chunk's logits (``softmax - onehot``, written over
the logits), and from it the chunk's rows of ``dx`` and its share of ``dW``
(and ``db``), accumulated. Backward only scales the saved gradients by the
incoming gradient. So the largest temporary is one chunk's logits (and,
for half-precision weights where torch has no fp32-output ``addmm``, one
half (V, H) product: see Dtypes), and a training step makes the same three
matmuls as the unfused head (forward, ``dx``, ``dW``). This is
Liger-Kernel's design (``fused_linear_cross_entropy``), re-derived here; it
differs in that backward scales out of place (so a second backward through a
retained graph, as torch's zero-bubble pipeline schedule makes, gets the same
gradients), in accumulating ``dW`` in fp32 and in its vocab-parallel form.
``reduction="none"`` (a per-row loss with any upstream gradient per row) and
the rows' entropy form their gradients in backward instead:
:mod:`cuboid.kernels.linear_cross_entropy_rows`.

**Vocab-parallel.** W may be one slice of a vocabulary split over ranks: local
column ``c`` is global class ``vocab_start + c``; global classes at or past
``vocab_size`` are padding (masked to -inf: they never win and get zero
gradient). The softmax normaliser is then reduced over the ranks by the
caller's ``reduce(tensor, op)`` (an in-place all-reduce, ``op`` "max" or
"sum"): per chunk one reduce of the rows' max (chunk,) fp32 and one of the
rows' (sum of exponentials, target logit) (chunk, 2) fp32, the traffic of
the unfused vocab-parallel loss. ``dx`` is then this rank's partial sum over
vocab slices (the caller's collective sums it in backward); ``dW`` and ``db``
are this slice's. This module knows nothing of process groups: ``reduce`` is
any callable, so the same code serves one device and every tensor mode.

**Backends.** CPU tensors run the chunked torch path (``backend="torch"``);
CUDA tensors (and CPU under ``TRITON_INTERPRET=1``) the Triton path, where
the matmuls are torch's (cuBLAS) and two Triton kernels do the per-row work on
each chunk: one pass for the row statistics (online max and sum of
exponentials, target logit), one that writes the logits' gradient in place.
``linear_cross_entropy_ref`` is the unfused reference (``F.linear`` then
``F.cross_entropy``), which holds the whole logits.

Dtypes: x, W (and b) fp32, fp16 or bf16 (the torch path also float64), one
dtype (under autocast they are cast to the autocast dtype first, as
``F.linear`` would). The logits are made in that dtype, as the unfused head
makes them; every softmax statistic, the loss and the accumulation of ``dW``
and ``db`` are fp32 (float64 for float64 inputs); the logits' gradient is
rounded to the input dtype before its matmuls, as the unfused backward does.
For half-precision weights on CUDA each chunk's ``dW`` product is made and
added to the fp32 sum by one cuBLAS call (``torch.addmm(..., out_dtype=
torch.float32)``, where the installed torch has it); elsewhere the chunk's
product is rounded to the half dtype (a (V, H) temporary) and then added in
fp32. Chunks (:func:`default_chunk`) are about 64 MiB of fp32 logits on CPU
and 512 MiB of logits on CUDA, where the matmuls need a wide chunk.
``ignore_index`` rows count for nothing (zero gradient). No label smoothing:
the loss it replaces has none.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op, register_fake

from ._backend import check_floating, check_same_dtype, on_device, resolve_backend
from .linear_cross_entropy_rows import add_chunk_grads, fp32_addmm, grad_buffers, per_row  # noqa: F401

Tensor = torch.Tensor
Reduce = Callable[[Tensor, str], Tensor]
_OP = "linear_cross_entropy"
CHUNK_ELEMS = 1 << 24  # CPU: logits per chunk by default (64 MiB in fp32): rows = CHUNK_ELEMS // local vocab
CUDA_CHUNK_BYTES = 1 << 29  # CUDA: bytes of logits (in their dtype) per chunk by default (default_chunk)
CHUNK_ROW_MULTIPLE = 128  # CUDA: default chunks are a multiple of this many rows (whole matmul tiles)
MAX_BLOCK_V = 4096  # vocab columns per step of a row program


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _lce_stats_kernel(
    Z,  # (C, Vl) logits of the chunk, row stride stride_z, unit column stride, input dtype
    LABELS,  # (C,) int64 global labels
    STATS,  # (C, 3) fp32 out: local max m, sum of exp(z - m), target logit (0 when not on this slice);
            # (C, 4) with ENTROPY: and sum of exp(z - m) * (z - m) (the entropy's numerator)
    n_cols,  # Vl: local columns
    n_valid,  # local columns that are real classes (the rest is padding)
    start,  # global class of local column 0
    ignore_index,
    stride_z,
    stride_s,  # 3, or 4 with ENTROPY
    BLOCK_V: tl.constexpr,
    ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    for off in range(0, n_cols, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        z = tl.load(z_row + cols, mask=cols < n_valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of padding only: nothing to add
        alpha = tl.exp(m - base)
        if ENTROPY:  # u moves to the new max as s does, plus (m - base) s; padding (z = -inf) adds nothing
            d = tl.where(cols < n_valid, z - base, 0.0)
            e = tl.where(cols < n_valid, tl.exp(d), 0.0)
            u = alpha * (u + tl.where(s > 0, m - base, 0.0) * s) + tl.sum(e * d, 0)
        s = s * alpha + tl.sum(tl.exp(z - base), 0)
        m = m_new
    label = tl.load(LABELS + row)
    local = label - start
    here = (label != ignore_index) & (local >= 0) & (local < n_valid)
    target = tl.load(z_row + tl.where(here, local, 0), mask=here, other=0.0).to(tl.float32)
    tl.store(STATS + row * stride_s, m)
    tl.store(STATS + row * stride_s + 1, s)
    tl.store(STATS + row * stride_s + 2, tl.where(here, target, 0.0))
    if ENTROPY:
        tl.store(STATS + row * stride_s + 3, u)


@triton.jit
def _lce_grad_kernel(
    Z,  # (C, Vl) logits of the chunk, overwritten with their gradient (softmax - onehot) * scale (input dtype)
    LABELS,  # (C,) int64 global labels
    LSE,  # (C,) fp32 log-sum-exp of each row over the whole vocabulary
    SCALE,  # (C,) fp32 each row's upstream gradient (read with HAS_SCALE only; else 1)
    n_cols,
    n_valid,
    start,
    ignore_index,
    stride_z,
    BLOCK_V: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    label = tl.load(LABELS + row)
    lse = tl.load(LSE + row)
    valid = label != ignore_index
    local = label - start
    factor = tl.where(valid, 1.0, 0.0)
    if HAS_SCALE:
        factor = factor * tl.load(SCALE + row)
    for off in range(0, n_cols, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        in_row = cols < n_cols
        z = tl.load(z_row + cols, mask=in_row, other=0.0).to(tl.float32)
        p = tl.where(cols < n_valid, tl.exp(z - lse), 0.0)  # padding columns: probability 0
        g = (p - tl.where(cols == local, 1.0, 0.0)) * factor
        tl.store(z_row + cols, g.to(Z.dtype.element_ty), mask=in_row)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _launch_cfg(n_cols: int) -> tuple:
    """(BLOCK_V, num_warps) of the row programs: one heuristic, no autotune."""
    block = min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK_V)
    return block, 8 if block >= 2048 else 4 if block >= 512 else 2


def _stats_triton(z: Tensor, labels: Tensor, n_valid: int, start: int, ignore_index: int,
                  entropy: bool = False) -> Tensor:
    width = 4 if entropy else 3
    stats = torch.empty((z.shape[0], width), dtype=torch.float32, device=z.device)
    if z.shape[0]:
        block, warps = _launch_cfg(z.shape[1])
        with on_device(z):
            _lce_stats_kernel[(z.shape[0],)](z, labels, stats, z.shape[1], n_valid, start, ignore_index, z.stride(0),
                                             width, BLOCK_V=block, ENTROPY=entropy, num_warps=warps)
    return stats


def _grad_triton(z: Tensor, labels: Tensor, lse: Tensor, n_valid: int, start: int, ignore_index: int,
                 scale: Optional[Tensor] = None) -> None:
    if z.shape[0]:
        block, warps = _launch_cfg(z.shape[1])
        with on_device(z):
            _lce_grad_kernel[(z.shape[0],)](z, labels, lse, lse if scale is None else scale, z.shape[1], n_valid,
                                            start, ignore_index, z.stride(0), BLOCK_V=block,
                                            HAS_SCALE=scale is not None, num_warps=warps)


# ----------------------------------------------------------------------------
# The custom ops cuboid::lce_stats and cuboid::lce_grad_ (the Triton path; kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::lce_stats", mutates_args=())
def _lce_stats(z: Tensor, labels: Tensor, n_valid: int, start: int, ignore_index: int,
               entropy: bool = False) -> Tensor:
    """(C, 3) fp32 (row max m, sum of exp(z - m), target logit) of a chunk of logits; with ``entropy``
    (C, 4), and the sum of exp(z - m) * (z - m)."""
    return _stats_triton(z, labels, n_valid, start, ignore_index, entropy)


@register_fake("cuboid::lce_stats")
def _lce_stats_fake(z, labels, n_valid, start, ignore_index, entropy=False):
    return z.new_empty((z.shape[0], 4 if entropy else 3), dtype=torch.float32)


@custom_op("cuboid::lce_grad_", mutates_args=("z",))
def _lce_grad(z: Tensor, labels: Tensor, lse: Tensor, n_valid: int, start: int, ignore_index: int,
              scale: Optional[Tensor] = None) -> None:
    """The chunk's logits ``z`` overwritten by their gradient (softmax minus the one-hot target), each row times
    its ``scale`` (C,) fp32 when given."""
    _grad_triton(z, labels, lse, n_valid, start, ignore_index, scale)


@register_fake("cuboid::lce_grad_")
def _lce_grad_fake(z, labels, lse, n_valid, start, ignore_index, scale=None):
    return None


# ----------------------------------------------------------------------------
# One chunk of rows, either backend
# ----------------------------------------------------------------------------


def _chunk_torch(z: Tensor, y: Tensor, valid: Tensor, n_valid: int, start: int, reduce: Optional[Reduce],
                 acc: torch.dtype, grad: bool):
    """Loss terms (C,) of one chunk of logits ``z`` (C, Vl), and (``grad``) their gradient written over ``z``
    (returned, in z's dtype). Statistics in ``acc``; the max is reduced first, then (sum of exp, target)."""
    x = z if z.dtype == acc else z.to(acc)  # fp32 / fp64 logits are worked on in place
    if n_valid < x.shape[1]:
        x[:, n_valid:] = float("-inf")  # padding never wins
    local = y - start
    here = valid & (local >= 0) & (local < n_valid)
    idx = torch.where(here, local, 0).unsqueeze(-1)
    if reduce is None:
        return _whole_rows_torch(x, z, idx, valid, here, grad)
    m = x.max(-1).values
    reduce(m, "max")
    x.sub_(m.unsqueeze(-1))
    target = torch.where(here, x.gather(-1, idx).squeeze(-1), 0.0)
    x.exp_()
    stats = torch.stack([x.sum(-1), target], -1)  # (C, 2)
    if reduce is not None:
        reduce(stats, "sum")
    rows = torch.where(valid, stats[:, 0].log() - stats[:, 1], 0.0)
    if not grad:
        return rows, None
    x.mul_(torch.where(valid, stats[:, 0].reciprocal(), 0.0).unsqueeze(-1))  # softmax (0 on ignored rows)
    x.scatter_add_(-1, idx, -here.to(acc).unsqueeze(-1))  # minus the one-hot target (here implies valid)
    if x is not z:
        z.copy_(x)  # rounded to the logits' dtype, in their buffer
    return rows, z


def _whole_rows_torch(x: Tensor, z: Tensor, idx: Tensor, valid: Tensor, here: Tensor, grad: bool):
    """:func:`_chunk_torch` where every row's whole vocabulary is here (no reduce): torch's row softmax written
    over the logits, each row read from memory once after the max, where the general path makes four passes
    more (subtract, exp, sum, scale). The log normaliser is ``max - log p[argmax]`` (``p[argmax] = 1 / sum``,
    never underflows)."""
    target = torch.where(here, x.gather(-1, idx).squeeze(-1), 0.0)
    if not grad:
        return torch.where(valid, torch.logsumexp(x, -1) - target, 0.0), None
    m, at = x.max(-1)
    compiling = torch.compiler.is_compiling()
    if compiling:  # traced: out-of-place (inductor fuses it), no host read of ``valid``
        x = torch.softmax(x, -1)
    else:
        torch.ops.aten._softmax.out(x, -1, False, out=x)
    rows = torch.where(valid, m - x.gather(-1, at.unsqueeze(-1)).squeeze(-1).log() - target, 0.0)
    if compiling or valid.is_meta or not bool(valid.all()):
        x.masked_fill_(~valid.unsqueeze(-1), 0.0)  # no gradient from ignored rows
    x.scatter_add_(-1, idx, -here.to(x.dtype).unsqueeze(-1))  # minus the one-hot target (here implies valid)
    if x is not z:
        z.copy_(x)  # rounded to the logits' dtype, in their buffer
    return rows, z


def _chunk_triton(z: Tensor, y: Tensor, valid: Tensor, n_valid: int, start: int, reduce: Optional[Reduce],
                  ignore_index: int, grad: bool):
    """As :func:`_chunk_torch` with the two Triton row kernels (statistics in fp32; the same reduces)."""
    stats = _lce_stats(z, y, n_valid, start, ignore_index)  # no autograd: the fused loss makes its gradients
    m, s, target = stats.unbind(-1)
    if reduce is not None:
        mg = m.clone(memory_format=torch.contiguous_format)
        reduce(mg, "max")
        s = s * torch.exp(m - mg)  # this slice's sum relative to the global max (0 for a slice of padding)
        st = torch.stack([s, target], -1)
        reduce(st, "sum")
        m, s, target = mg, st[:, 0], st[:, 1]
    lse = m + s.log()
    rows = torch.where(valid, lse - target, 0.0)
    if not grad:
        return rows, None
    _lce_grad(z, y, lse.contiguous(), n_valid, start, ignore_index)
    return rows, z


def _fused(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int, vocab_start: int,
           vocab_size: int, reduce: Optional[Reduce], chunk: int, backend: str, need: tuple):
    """(sum of the rows' losses, dx, dW, db) of (N, H) ``x``; the gradients those ``need`` asks for (else None)."""
    N, _ = x.shape
    n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    grad = any(need)
    grads = grad_buffers(x, weight, need, acc)
    total = torch.zeros((), dtype=acc, device=x.device)
    for s in range(0, N, chunk):
        xc, yc = x[s:s + chunk], labels[s:s + chunk]
        z = F.linear(xc, weight, bias)  # (C, Vl) in the input dtype, as the unfused head
        valid = yc != ignore_index
        if backend == "triton":
            rows, g = _chunk_triton(z, yc, valid, n_valid, vocab_start, reduce, ignore_index, grad)
        else:
            rows, g = _chunk_torch(z, yc, valid, n_valid, vocab_start, reduce, acc, grad)
        total += rows.sum()
        if grad:
            add_chunk_grads(g, xc, weight, s, grads)
        del z, g
    return (total, *grads)


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum over rows of cross-entropy of ``x @ W.T + b``; gradients made in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, ignore_index, vocab_start, vocab_size, reduce, chunk, backend, need):
        total, dx, dw, db = _fused(x, weight, bias, labels, ignore_index, vocab_start, vocab_size, reduce, chunk,
                                   backend, need)
        ctx.save_for_backward(dx, dw, db)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        dx, dw, db = ctx.saved_tensors
        tx, tw, tb = ctx.dtypes
        # out of place: a retained graph (torch's ZBV schedule runs this node once for inputs and once for
        # weights) must find the saved gradients as they were
        # and one pass each: scaled in the accumulation dtype and written straight in the parameter's dtype (no
        # fp32 temporary of dW's size beside the saved one)
        dx, dw, db = (None if t is None else torch.mul(t, grad.to(t.dtype), out=torch.empty_like(t, dtype=dtype))
                      for t, dtype in ((dx, tx), (dw, tw), (db, tb)))
        return dx, dw, db, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------
# Reference and public functions
# ----------------------------------------------------------------------------


def _autocast(*tensors: Optional[Tensor]) -> list:
    """The tensors in the autocast dtype of their device when autocast is on there (``F.linear``'s rule)."""
    dev = next(t for t in tensors if t is not None).device.type
    try:
        on = torch.is_autocast_enabled(dev)
        dtype = torch.get_autocast_dtype(dev) if on else None
    except (RuntimeError, ValueError, TypeError):  # a device autocast does not know (meta)
        on, dtype = False, None
    if not on:
        return list(tensors)
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t for t in tensors]


def _check(x, weight, bias, labels, *, triton_path: bool) -> None:
    dtypes = (torch.float32, torch.float16, torch.bfloat16) + (() if triton_path else (torch.float64,))
    check_floating(_OP, "x", x, dtypes)
    check_floating(_OP, "weight", weight, dtypes)
    if bias is not None:
        check_floating(_OP, "bias", bias, dtypes)
    check_same_dtype(_OP, x=x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{_OP}: weight must be (V, {x.shape[-1]}) for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_OP}: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{_OP}: labels must be an integer tensor")
    if labels.numel() != x.numel() // max(x.shape[-1], 1) or tuple(labels.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{_OP}: labels of shape {tuple(labels.shape)} for x of shape {tuple(x.shape)}: "
                         f"one label per row expected")


def _check_labels(labels: Tensor, vocab_size: int, ignore_index: int) -> None:
    """An ``IndexError`` for a label outside [0, vocab_size); a host read, so a compiled graph skips it (the
    gather of the target then fails on CPU, asserts on CUDA)."""
    if labels.is_meta or not labels.numel() or torch.compiler.is_compiling():
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise IndexError(f"{_OP}: label {int(labels[bad][0])} outside [0, {vocab_size})")


def _mean(total: Tensor, count: Tensor) -> Tensor:
    """``total / count``; NaN when count is 0 (as ``F.cross_entropy``), with a zero gradient then."""
    count = count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def linear_cross_entropy_ref(x: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                             ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """The unfused head: ``F.cross_entropy(F.linear(x, weight, bias), labels)`` with the whole (N, V) logits
    (computed in fp32 for half-precision inputs). ``reduction``: "mean" (NaN when every label is ignored) or
    "sum"."""
    _check(x, weight, bias, labels, triton_path=False)
    logits = F.linear(x, weight, bias).reshape(-1, weight.shape[0])
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(acc), labels.reshape(-1).long(), ignore_index=ignore_index, reduction=reduction)


def default_chunk(n_rows: int, n_local: int, device_type: str = "cpu", dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk, at least 1, at most ``n_rows``.

    CPU (and the interpreter on CPU): about CHUNK_ELEMS logits (64 MiB in fp32). CUDA: about CUDA_CHUNK_BYTES
    of logits in their dtype (512 MiB: 2048 rows of a 128256-column bf16 slice), rounded down to a multiple of
    CHUNK_ROW_MULTIPLE rows when there are that many, so that the three matmuls of a chunk are wide (the dW
    product's inner dimension is the chunk's rows; the CPU rule's 130-row chunks at vocabulary 128256 make
    the bf16 step 3.7x slower than the unfused head on an H200: bench/RESULTS.md). It depends on the shapes, the device
    type and the dtype alone (never on free memory or the GPU model), so every rank of a vocab-parallel group
    (same rows, same slice width, same device type and dtype) makes the same number of reduces."""
    if device_type == "cuda":
        rows = CUDA_CHUNK_BYTES // max(n_local * dtype.itemsize, 1)
        if rows >= CHUNK_ROW_MULTIPLE:
            rows -= rows % CHUNK_ROW_MULTIPLE
    else:
        rows = CHUNK_ELEMS // max(n_local, 1)
    return max(1, min(max(n_rows, 1), rows))


def linear_cross_entropy(x: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None, *,
                         ignore_index: int = -100, reduction: str = "mean", chunk: Optional[int] = None,
                         vocab_start: int = 0, vocab_size: Optional[int] = None, reduce: Optional[Reduce] = None,
                         backend: Optional[str] = None, return_entropy: bool = False):
    """Cross-entropy of ``x @ weight.T + bias`` against ``labels`` without holding the whole logits.

    Args:
        x: (..., H) hidden states; weight: (Vl, H); bias: (Vl,) or None; labels: (...) integer classes,
            ``ignore_index`` rows counting for nothing.
        reduction: "mean" over the counted rows (NaN with zero gradients when there are none, as
            ``F.cross_entropy``), "sum", or "none": each row's ``-log p(label)``, shaped like ``labels`` (0 on
            ``ignore_index`` rows), differentiable with any upstream gradient per row
            (:mod:`cuboid.kernels.linear_cross_entropy_rows`).
        return_entropy: with "none" only: also each row's entropy of the softmax (shaped like ``labels``, every
            row, no gradient), from the same pass.
        chunk: rows per chunk (default :func:`default_chunk`: about 64 MiB of fp32 logits on CPU, 512 MiB of
            logits in their dtype on CUDA).
        vocab_start, vocab_size, reduce: the vocab-parallel form (module docstring): weight holds global
            classes [vocab_start, vocab_start + Vl), those at or past ``vocab_size`` (default: vocab_start + Vl)
            padding; ``reduce(t, op)`` all-reduces ``t`` in place over the ranks holding the other slices
            ("max" or "sum"). Every rank then returns the same loss; gradients are this slice's (x's: a partial
            sum over slices). Labels are global classes in [0, vocab_size).
        backend: "triton", "torch" or None (automatic, see :func:`cuboid.kernels.resolve_backend`).

    Returns a 0-d tensor ("mean", "sum") or the rows ("none"; with ``return_entropy`` the pair (rows,
    entropy)), fp32 (float64 for float64 inputs), differentiable w.r.t. x, weight and bias.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{_OP}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if return_entropy and reduction != "none":
        raise ValueError(f"{_OP}: return_entropy needs reduction='none' (the entropy is per row)")
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    chosen = resolve_backend(_OP, [x, weight, bias, labels], backend)
    x, weight, bias = _autocast(x, weight, bias)
    _check(x, weight, bias, labels, triton_path=chosen == "triton")
    n_local = weight.shape[0]
    vocab_size = vocab_start + n_local if vocab_size is None else vocab_size
    if chunk is not None and chunk < 1:
        raise ValueError(f"{_OP}: chunk must be a positive number of rows, got {chunk}")
    x2 = x.reshape(-1, x.shape[-1])
    y = labels.reshape(-1).long()
    _check_labels(y, vocab_size, ignore_index)
    chunk = chunk or default_chunk(x2.shape[0], n_local, x2.device.type, x2.dtype)
    grad = torch.is_grad_enabled()
    need = (grad and x.requires_grad, grad and weight.requires_grad, grad and bias is not None and bias.requires_grad)
    args = (ignore_index, vocab_start, vocab_size, reduce, chunk, chosen, need)
    with torch.autocast(x.device.type, enabled=False) if x.device.type in ("cpu", "cuda") else contextlib.nullcontext():
        if reduction == "none":
            rows, ent = per_row(x2, weight, bias, y, *args, return_entropy)
            rows = rows.view(labels.shape)
            return (rows, ent.view(labels.shape)) if return_entropy else rows
        if any(need):
            total = _LinearCrossEntropy.apply(x2, weight, bias, y, *args)
        else:
            with torch.no_grad():
                total = _fused(x2, weight, bias, y, *args)[0]
    if reduction == "sum":
        return total
    return _mean(total, (y != ignore_index).sum())
