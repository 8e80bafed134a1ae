"""The fused linear cross-entropy per row: ``reduction="none"`` (each row's ``-log p(label)``) and its entropy.

:func:`cuboid.kernels.linear_cross_entropy` with ``reduction="none"`` comes
here. The summed loss forms its gradients in forward and scales them in
backward, which holds for one scalar upstream gradient only; a per-row loss
(log-probabilities for DPO, GRPO's ratios) gets a different gradient per row,
and the weight's gradient mixes rows, so it must be formed in backward. So
forward keeps, per row, only the log-sum-exp of its logits (N,) fp32 beside
the inputs it already has (x, W, b, labels); backward makes each chunk's
logits again (one more (C, H) x (H, Vl) matmul per chunk than the summed
loss) and writes ``(softmax - onehot) * grad_row`` over them (the Triton path:
``cuboid::lce_grad_`` with its per-row ``scale``), then the chunk's dx rows
and its share of dW and db, as the summed loss does in its forward. This is
how Liger-Kernel treats a non-scalar upstream gradient, re-derived here.

**Entropy** (``return_entropy=True``, no gradient): each row's
``H = lse - sum(softmax * z) = log s - sum(exp(z - m) (z - m)) / s`` with m
the row's max and s its sum of exponentials relative to m, from the same
pass over the logits as the loss (the Triton statistics kernel's ``ENTROPY``
form; the torch path one (C, Vl) temporary more per chunk). It does not
depend on the label: ignored rows get theirs too.

**Vocab-parallel** as the summed loss (``vocab_start``, ``vocab_size``,
``reduce``): per chunk one "max" reduce of (C,) and one "sum" reduce of
(C, 2) (sum of exponentials relative to the global max, target logit), (C, 3)
with the entropy's sum. Backward reuses the saved global log-sum-exp: no
collective (dx is this slice's partial sum, which the caller's collective sums
as it does for the summed loss).

Returns fp32 rows (float64 for float64 inputs), 0 on ``ignore_index`` rows.

Also here, shared with the summed loss: the accumulation of a chunk's dx
rows, dW and db (:func:`grad_buffers`, :func:`add_chunk_grads`). This module
imports nothing of :mod:`~cuboid.kernels.linear_cross_entropy` (which imports
it): the Triton path calls the ops that module registers,
``torch.ops.cuboid.lce_stats`` and ``lce_grad_``, and is reached only
through it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


Tensor = torch.Tensor


_FP32_ADDMM: dict = {}  # (device, dtype) -> whether torch.addmm(..., out_dtype=float32) accumulates into fp32


def fp32_addmm(g: Tensor) -> bool:
    """Whether ``torch.addmm(dw, g.t(), xc, out_dtype=torch.float32, out=dw)`` works here: half-precision
    CUDA inputs, an fp32 ``dw`` added to in place, the product made and summed in fp32 by cuBLAS without a
    half-precision (V, H) temporary. ``out_dtype`` for mm/addmm is CUDA-only and recent (the
    ``aten::addmm.dtype_out`` overload, pytorch PR 150812: not in torch 2.4-2.7, where the keyword is a
    TypeError; some versions ask ``self`` to be in the input dtype, others allow it in ``out_dtype``), so
    rather than a version test it is tried once per device and dtype on 1x1 tensors and the answer kept (the
    refusals are host-side checks, before any GPU work); where it fails the caller adds a half product per
    chunk."""
    if g.device.type != "cuda" or g.dtype not in (torch.float16, torch.bfloat16):
        return False
    key = (g.device, g.dtype)
    if key not in _FP32_ADDMM:
        try:
            a = torch.ones((1, 1), dtype=g.dtype, device=g.device)
            acc = torch.full((1, 1), 0.5, dtype=torch.float32, device=g.device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _FP32_ADDMM[key] = float(acc[0, 0]) == 1.5
        except torch.cuda.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError, NotImplementedError):  # no out_dtype keyword / no kernel / refused
            _FP32_ADDMM[key] = False
    return _FP32_ADDMM[key]


def grad_buffers(x: Tensor, weight: Tensor, need: tuple, acc: torch.dtype) -> tuple:
    """(dx, dW, db) buffers for :func:`add_chunk_grads` (None where ``need`` does not ask): dx like x, dW in
    weight's dtype promoted to ``acc`` (fp32 for half weights, accumulated into; written by the first chunk's
    product when that is weight's own dtype), db in ``acc`` zeros."""
    need_x, need_w, need_b = need
    dx = torch.empty_like(x) if need_x else None
    dw = None
    dw_dtype = torch.promote_types(weight.dtype, acc)
    if need_w:
        first_writes = dw_dtype == weight.dtype and x.shape[0] > 0
        dw = (torch.empty if first_writes else torch.zeros)(weight.shape, dtype=dw_dtype, device=weight.device)
    db = torch.zeros(weight.shape[0], dtype=acc, device=x.device) if need_b else None
    return dx, dw, db


def add_chunk_grads(g: Tensor, xc: Tensor, weight: Tensor, s: int, grads: tuple) -> None:
    """Add one chunk's share to ``grads`` (:func:`grad_buffers`) from ``g`` (C, Vl), the gradient of the chunk's
    logits (rows ``s`` .. ``s + C`` of x, ``xc`` (C, H)): its rows of dx, and its products into dW and db."""
    dx, dw, db = grads
    if dx is not None:
        torch.mm(g, weight, out=dx[s:s + g.shape[0]])
    if dw is not None:
        if dw.dtype == weight.dtype and s == 0:
            torch.mm(g.t(), xc, out=dw)
        elif dw.dtype == weight.dtype:
            dw.addmm_(g.t(), xc)
        elif fp32_addmm(g):
            torch.addmm(dw, g.t(), xc, out_dtype=dw.dtype, out=dw)  # half inputs, fp32 product and sum
        else:
            dw += g.t() @ xc  # the chunk's product rounded to the half dtype, then added in fp32
    if db is not None:
        db += g.sum(0, dtype=db.dtype)


def _targets(y: Tensor, valid: Tensor, n_valid: int, start: int) -> tuple:
    """(here, idx): which rows' targets lie on this slice, and their local columns (C, 1) (0 where not)."""
    local = y - start
    here = valid & (local >= 0) & (local < n_valid)
    return here, torch.where(here, local, 0).unsqueeze(-1)


def _stats_torch(z: Tensor, y: Tensor, valid: Tensor, n_valid: int, start: int, reduce, acc: torch.dtype,
                 entropy: bool) -> tuple:
    """One chunk's (lse, lse - target logit, entropy or None), each (C,) in ``acc``, from its logits ``z`` (C, Vl)
    (overwritten where they are ``acc`` already), reduced over the slices by ``reduce`` when given."""
    x = z if z.dtype == acc else z.to(acc)
    if n_valid < x.shape[1]:
        x[:, n_valid:] = float("-inf")  # padding never wins and adds nothing
    here, idx = _targets(y, valid, n_valid, start)
    m = x.max(-1).values
    if reduce is not None:
        reduce(m, "max")
    m = torch.where(torch.isinf(m), 0.0, m)  # a row of padding only (an empty slice without reduce)
    x.sub_(m.unsqueeze(-1))
    target = torch.where(here, x.gather(-1, idx).squeeze(-1), 0.0)  # relative to m
    x.exp_()
    parts = [x.sum(-1), target]
    if entropy:
        parts.append(-torch.special.entr(x).sum(-1))  # sum of exp(z - m) (z - m): entr(0) = 0 at the padding
    stats = torch.stack(parts, -1)  # (C, 2 or 3)
    if reduce is not None:
        reduce(stats, "sum")
    log_s = stats[:, 0].log()
    ent = log_s - stats[:, 2] / stats[:, 0] if entropy else None
    return m + log_s, log_s - stats[:, 1], ent


def _stats_triton(z: Tensor, y: Tensor, n_valid: int, start: int, reduce, ignore_index: int,
                  entropy: bool) -> tuple:
    """As :func:`_stats_torch` with the Triton statistics kernel (``cuboid::lce_stats``), fp32."""
    stats = torch.ops.cuboid.lce_stats(z, y, n_valid, start, ignore_index, entropy)
    m, s, target = stats[:, 0], stats[:, 1], stats[:, 2]
    u = stats[:, 3] if entropy else None
    if reduce is not None:
        mg = m.clone(memory_format=torch.contiguous_format)
        reduce(mg, "max")
        alpha = torch.exp(m - mg)  # 0 for a slice of padding (m = -inf)
        parts = [s * alpha, target]
        if entropy:  # move u to the global max: exp(m - M) (u + (m - M) s), 0 for a slice of padding
            parts.append(torch.where(s > 0, alpha * (u + (m - mg) * s), 0.0))
        st = torch.stack(parts, -1)
        reduce(st, "sum")
        m, s, target = mg, st[:, 0], st[:, 1]
        u = st[:, 2] if entropy else None
    log_s = s.log()
    lse = m + log_s
    return lse, lse - target, (log_s - u / s if entropy else None)


def rows_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
                 vocab_start: int, vocab_size: int, reduce, chunk: int, backend: str, entropy: bool) -> tuple:
    """(rows (N,), lse (N,), entropy (N,) or None) of (N, H) ``x``: rows the per-row loss (0 where ignored)."""
    N = x.shape[0]
    n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = torch.empty(N, dtype=acc, device=x.device)
    lse = torch.empty(N, dtype=acc, device=x.device)
    ent = torch.empty(N, dtype=acc, device=x.device) if entropy else None
    for s in range(0, N, chunk):
        xc, yc = x[s:s + chunk], labels[s:s + chunk]
        z = F.linear(xc, weight, bias)  # (C, Vl) in the input dtype, as the unfused head
        valid = yc != ignore_index
        if backend == "triton":
            l, r, e = _stats_triton(z, yc, n_valid, vocab_start, reduce, ignore_index, entropy)
        else:
            l, r, e = _stats_torch(z, yc, valid, n_valid, vocab_start, reduce, acc, entropy)
        rows[s:s + chunk] = torch.where(valid, r, 0.0)
        lse[s:s + chunk] = l
        if entropy:
            ent[s:s + chunk] = e
        del z
    return rows, lse, ent


def _grad_torch(z: Tensor, y: Tensor, valid: Tensor, lse: Tensor, scale: Tensor, n_valid: int, start: int,
                acc: torch.dtype) -> Tensor:
    """``(softmax - onehot) * scale`` of one chunk's logits ``z`` (C, Vl), written over them (returned); ``lse``
    and ``scale`` (C,) in ``acc``, ignored rows 0."""
    x = z if z.dtype == acc else z.to(acc)
    x.sub_(lse.unsqueeze(-1)).exp_()
    if n_valid < x.shape[1]:
        x[:, n_valid:] = 0.0  # padding columns: probability 0
    here, idx = _targets(y, valid, n_valid, start)
    x.scatter_add_(-1, idx, -here.to(acc).unsqueeze(-1))
    x.mul_(torch.where(valid, scale, 0.0).unsqueeze(-1))
    if x is not z:
        z.copy_(x)  # rounded to the logits' dtype, in their buffer
    return z


def rows_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, lse: Tensor, grad: Tensor,
                  ignore_index: int, vocab_start: int, vocab_size: int, chunk: int, backend: str,
                  need: tuple) -> tuple:
    """(dx, dW, db) of ``sum(rows * grad)`` (None where ``need`` does not ask): each chunk's logits made again
    and their gradient formed from the saved ``lse`` and the upstream ``grad`` (N,)."""
    n_valid = max(0, min(weight.shape[0], vocab_size - vocab_start))
    acc = lse.dtype
    grads = grad_buffers(x, weight, need, acc)
    grad = grad.to(acc).contiguous()
    for s in range(0, x.shape[0], chunk):
        xc, yc = x[s:s + chunk], labels[s:s + chunk]
        z = F.linear(xc, weight, bias)
        if backend == "triton":
            torch.ops.cuboid.lce_grad_(z, yc, lse[s:s + chunk], n_valid, vocab_start, ignore_index,
                                       grad[s:s + chunk])
            g = z
        else:
            g = _grad_torch(z, yc, yc != ignore_index, lse[s:s + chunk], grad[s:s + chunk], n_valid, vocab_start,
                            acc)
        add_chunk_grads(g, xc, weight, s, grads)
        del z, g
    return grads


class LinearCrossEntropyRows(torch.autograd.Function):
    """Per-row cross-entropy of ``x @ W.T + b`` (and, not differentiable, its entropy): forward keeps the rows'
    log-sum-exp, backward forms the gradients from recomputed chunks and the per-row upstream gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, ignore_index, vocab_start, vocab_size, reduce, chunk, backend, need,
                entropy):
        rows, lse, ent = rows_forward(x, weight, bias, labels, ignore_index, vocab_start, vocab_size, reduce, chunk,
                                      backend, entropy)
        ctx.save_for_backward(x, weight, bias, labels, lse)
        ctx.args = (ignore_index, vocab_start, vocab_size, chunk, backend, need)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        if ent is None:
            return rows
        ctx.mark_non_differentiable(ent)
        return rows, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_):
        x, weight, bias, labels, lse = ctx.saved_tensors
        grads = rows_backward(x, weight, bias, labels, lse, grad, *ctx.args)
        dx, dw, db = (None if t is None else t.to(dtype) for t, dtype in zip(grads, ctx.dtypes))
        return dx, dw, db, None, None, None, None, None, None, None, None, None


def per_row(x2: Tensor, weight: Tensor, bias: Optional[Tensor], y: Tensor, ignore_index: int, vocab_start: int,
            vocab_size: int, reduce, chunk: int, backend: str, need: tuple, entropy: bool):
    """The per-row loss (N,) of checked (N, H) ``x2`` and (N,) int64 ``y`` (and its entropy (N,) with
    ``entropy``): through :class:`LinearCrossEntropyRows` when a gradient is asked for, else directly."""
    if any(need):
        out = LinearCrossEntropyRows.apply(x2, weight, bias, y, ignore_index, vocab_start, vocab_size, reduce, chunk,
                                           backend, need, entropy)
        return out if entropy else (out, None)
    with torch.no_grad():
        rows, _, ent = rows_forward(x2, weight, bias, y, ignore_index, vocab_start, vocab_size, reduce, chunk,
                                    backend, entropy)
    return rows, ent
