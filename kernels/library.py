"""The Triton kernels as torch custom ops (``torch.ops.cuboid.*``), so that ``torch.compile`` sees one op each.

Each op wraps a kernel file's launcher: its real implementation launches the
Triton kernel (compiled on CUDA, the interpreter on CPU under
``TRITON_INTERPRET=1``), its fake implementation gives the output shapes and
dtypes for tracing, and the forward ops have their backward registered, so
Dynamo traces a model through them without a graph break and AOTAutograd
puts the backward op into the backward graph. The public functions
(:func:`cuboid.kernels.layer_norm`, ``rope``, ``swiglu``, ``attention``,
``linear_cross_entropy``) still choose the backend; these ops are their
Triton path. The torch path needs no op: it is plain torch, which inductor
fuses itself. The exception is ``grouped_mm``, whose op carries both paths
(``use_triton``): its CPU torch path calls ``torch._grouped_mm``, whose own
fake kernel takes bf16 only, and reads counts on the host for float64.

Outputs never alias inputs (a custom op's contract): where a launcher has
nothing to return for an optional output (no residual, no bias gradient), the
op returns an empty tensor and the Python wrapper turns it back into None.
The launchers are imported when an op first runs, so importing this module
registers the ops and does nothing else.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.library import custom_op, register_autograd, register_fake

Tensor = torch.Tensor

__all__ = ["norm", "rope", "swiglu", "flash_attention", "flash_attention_backward", "lce_stats", "lce_grad_",
           "grouped_mm"]


def _nothing(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The empty stand-in for an absent output."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def _or_none(t: Tensor) -> Optional[Tensor]:
    return None if t.numel() == 0 and t.dim() == 1 else t


# ---------------------------------------------------------------- layer norm and RMS norm (kernels/norm.py)


@custom_op("cuboid::norm", mutates_args=())
def _norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
          is_rms: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, h or empty, mean or empty, rstd): the fused residual norm's forward."""
    from .norm import _norm_fwd

    y, h, mean, rstd = _norm_fwd(x, weight, bias, residual, eps, is_rms)
    f32 = torch.float32
    return y, (h if h is not None else _nothing(x)), (mean if mean is not None else _nothing(x, f32)), rstd


@register_fake("cuboid::norm")
def _norm_fake(x, weight, bias, residual, eps, is_rms):
    rows = x.numel() // x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else _nothing(x)
    mean = _nothing(x, torch.float32) if is_rms else x.new_empty((rows,), dtype=torch.float32)
    return y, h, mean, x.new_empty((rows,), dtype=torch.float32)


@custom_op("cuboid::norm_backward", mutates_args=())
def _norm_backward(dy: Tensor, dh: Optional[Tensor], xin: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                   rstd: Tensor, is_rms: bool, compute_dw: bool, compute_db: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(d of the norm's input (M, N), dweight or empty, dbias or empty), fp32 parameter gradients."""
    from .norm import _norm_bwd

    dx, dw, db = _norm_bwd(dy, dh, xin, weight, mean, rstd, is_rms, compute_dw, compute_db)
    f32 = torch.float32
    return dx, (dw if dw is not None else _nothing(xin, f32)), (db if db is not None else _nothing(xin, f32))


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
    ctx.has_bias = bias is not None
    ctx.weight_dtype = None if weight is None else weight.dtype
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
    compute_db = ctx.has_bias and need_b
    dx, dw, db = _norm_backward(dy, dh, xin.reshape(-1, n).contiguous(), weight, _or_none(mean), rstd, ctx.is_rms,
                                compute_dw, compute_db)
    dx = dx.view(ctx.shape)
    dw = dw.to(ctx.weight_dtype) if compute_dw else None
    db = db.to(ctx.bias_dtype) if compute_db else None
    return (dx if need_x else None), dw, db, (dx if need_r else None), None, None


register_autograd("cuboid::norm", _norm_grad, setup_context=_norm_setup)


def norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor], eps: float,
         is_rms: bool):
    """The Triton norm through the op: ``y``, or ``(y, h)`` with a residual (kernels/norm.py's contract)."""
    y, h, _, _ = _norm(x, weight, bias, residual, eps, is_rms)
    return (y, h) if residual is not None else y


# ---------------------------------------------------------------- RoPE (kernels/rope.py)


@custom_op("cuboid::rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tuple[Tensor, Tensor]:
    """(q_rot, k_rot) in one launch; ``backward``: the transposed rotation (the gradient's map)."""
    from .rope import _rope_launch

    return _rope_launch(q, k, cos, sin, backward)


@register_fake("cuboid::rope")
def _rope_fake(q, k, cos, sin, backward):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, backward = inputs
    tables = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, q if tables else None, k if tables else None)


def _rope_grad(ctx, dq_rot, dk_rot):
    from .rope import _table_grad

    cos, sin, q, k = ctx.saved_tensors
    dq_rot = dq_rot if dq_rot is not None else torch.zeros_like(q)
    dk_rot = dk_rot if dk_rot is not None else torch.zeros_like(k)
    dq, dk = _rope(dq_rot, dk_rot, cos, sin, True)
    dcos = _table_grad(dq_rot, dk_rot, q, k, False, cos) if ctx.needs_input_grad[2] else None
    dsin = _table_grad(dq_rot, dk_rot, q, k, True, sin) if ctx.needs_input_grad[3] else None
    return dq, dk, dcos, dsin, None


register_autograd("cuboid::rope", _rope_grad, setup_context=_rope_setup)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """The Triton RoPE of (q, k) through the op."""
    return _rope(q, k, cos, sin, False)


# ---------------------------------------------------------------- SwiGLU (kernels/swiglu.py)


@custom_op("cuboid::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of (M, N) rows (unit column stride), contiguous."""
    from .swiglu import _swiglu_fwd

    return _swiglu_fwd(gate, up)


@register_fake("cuboid::swiglu")
def _swiglu_fake(gate, up):
    return gate.new_empty(gate.shape)


@custom_op("cuboid::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """(dgate, dup) of (M, N) rows, the gate recomputed."""
    from .swiglu import _swiglu_bwd

    return _swiglu_bwd(dy, gate, up)


@register_fake("cuboid::swiglu_backward")
def _swiglu_backward_fake(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    from .swiglu import _rows

    gate, up = ctx.saved_tensors
    return _swiglu_backward(_rows(dy.to(gate.dtype), gate.shape[1]), gate, up)


register_autograd("cuboid::swiglu", _swiglu_grad, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """The Triton SwiGLU of (..., N) gate and up through the op, gate's shape."""
    from .swiglu import _rows

    n = gate.shape[-1]
    return _swiglu(_rows(gate, n), _rows(up, n)).view(gate.shape)


# ---------------------------------------------------------------- flash attention (kernels/flash_attention.py)


@custom_op("cuboid::flash_attention", mutates_args=())
def _flash(q: Tensor, k: Tensor, v: Tensor, mask_u8: Optional[Tensor], doc_q: Optional[Tensor],
           doc_k: Optional[Tensor], causal: bool, scale: float, win_lo: Optional[int]) -> Tuple[Tensor, Tensor]:
    """(out (B, H, Sq, D), lse (B, H, Sq) fp32) of the Triton forward."""
    from .flash_attention import _flash_fwd

    return _flash_fwd(q, k, v, mask_u8, causal, scale, None if doc_q is None else (doc_q, doc_k), win_lo)


@register_fake("cuboid::flash_attention")
def _flash_fake(q, k, v, mask_u8, doc_q, doc_k, causal, scale, win_lo):
    B, H, Sq, D = q.shape
    return q.new_empty((B, H, Sq, D)), q.new_empty((B, H, Sq), dtype=torch.float32)


@custom_op("cuboid::flash_attention_backward", mutates_args=())
def _flash_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask_u8: Optional[Tensor], doc_q: Optional[Tensor], doc_k: Optional[Tensor], causal: bool,
                    scale: float, win_lo: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the Triton backward kernels; dk, dv summed over each group of query heads."""
    from .flash_attention import _flash_bwd

    docs = None if doc_q is None else (doc_q, doc_k)
    return _flash_bwd(dout, dlse, q, k, v, out, lse, mask_u8, causal, scale, docs, win_lo)


@register_fake("cuboid::flash_attention_backward")
def _flash_backward_fake(dout, dlse, q, k, v, out, lse, mask_u8, doc_q, doc_k, causal, scale, win_lo):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _flash_setup(ctx, inputs, output):
    q, k, v, mask_u8, doc_q, doc_k, causal, scale, win_lo = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask_u8, doc_q, doc_k)
    ctx.causal, ctx.scale, ctx.win_lo = causal, scale, win_lo
    ctx.set_materialize_grads(False)


def _flash_grad(ctx, dout, dlse):
    q, k, v, out, lse, mask_u8, doc_q, doc_k = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
    dq, dk, dv = _flash_backward(dout, dlse, q, k, v, out, lse, mask_u8, doc_q, doc_k, ctx.causal, ctx.scale,
                                 ctx.win_lo)
    return dq, dk, dv, None, None, None, None, None, None


register_autograd("cuboid::flash_attention", _flash_grad, setup_context=_flash_setup)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, mask_u8: Optional[Tensor], doc_q: Optional[Tensor],
                    doc_k: Optional[Tensor], causal: bool, scale: float, win_lo: Optional[int]) -> Tuple[Tensor, Tensor]:
    """(out, lse), both differentiable: the Triton attention through the op (arguments of ``_flash_fwd``)."""
    return _flash(q, k, v, mask_u8, doc_q, doc_k, causal, float(scale), win_lo)


def flash_attention_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                             lse: Tensor, mask_u8: Optional[Tensor], doc_q: Optional[Tensor], doc_k: Optional[Tensor],
                             causal: bool, scale: float, win_lo: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) through the backward op (ring attention's per-block backward)."""
    return _flash_backward(dout, dlse, q, k, v, out, lse, mask_u8, doc_q, doc_k, causal, float(scale), win_lo)


# ---------------------------------------------------------------- fused linear cross-entropy's row kernels


@custom_op("cuboid::lce_stats", mutates_args=())
def _lce_stats(z: Tensor, labels: Tensor, n_valid: int, start: int, ignore_index: int) -> Tensor:
    """(C, 3) fp32 (row max, sum of exp relative to it, target logit) of a chunk of logits."""
    from .linear_cross_entropy import _stats_triton

    return _stats_triton(z, labels, n_valid, start, ignore_index)


@register_fake("cuboid::lce_stats")
def _lce_stats_fake(z, labels, n_valid, start, ignore_index):
    return z.new_empty((z.shape[0], 3), dtype=torch.float32)


@custom_op("cuboid::lce_grad_", mutates_args=("z",))
def _lce_grad(z: Tensor, labels: Tensor, lse: Tensor, n_valid: int, start: int, ignore_index: int) -> None:
    """The chunk's logits ``z`` overwritten by their gradient (softmax minus the one-hot target)."""
    from .linear_cross_entropy import _grad_triton

    _grad_triton(z, labels, lse, n_valid, start, ignore_index)


@register_fake("cuboid::lce_grad_")
def _lce_grad_fake(z, labels, lse, n_valid, start, ignore_index):
    return None


def lce_stats(z: Tensor, labels: Tensor, n_valid: int, start: int, ignore_index: int) -> Tensor:
    """The statistics kernel of kernels/linear_cross_entropy.py through the op (no autograd: the fused loss
    makes its gradients in forward)."""
    return _lce_stats(z, labels, n_valid, start, ignore_index)


def lce_grad_(z: Tensor, labels: Tensor, lse: Tensor, n_valid: int, start: int, ignore_index: int) -> None:
    """The gradient kernel through the op, in place over ``z``."""
    _lce_grad(z, labels, lse, n_valid, start, ignore_index)


# ---------------------------------------------------------------- grouped GEMM (kernels/grouped_gemm.py)


@custom_op("cuboid::grouped_mm", mutates_args=())
def _grouped_mm(x: Tensor, w: Tensor, counts: Tensor, use_triton: bool) -> Tensor:
    """(M, N): ``x[rows of g] @ w[g].T``, the Triton kernel or the torch path (torch._grouped_mm / padded bmm)."""
    from .grouped_gemm import _mm_triton, _ref_values

    return _mm_triton(x, w, counts, transpose_b=True) if use_triton else _ref_values(x, w, counts)


@register_fake("cuboid::grouped_mm")
def _grouped_mm_fake(x, w, counts, use_triton):
    return x.new_empty((x.shape[0], w.shape[1]))


@custom_op("cuboid::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(dy: Tensor, x: Tensor, w: Tensor, counts: Tensor, use_triton: bool, need_dx: bool,
                         need_dw: bool) -> Tuple[Tensor, Tensor]:
    """(dx (M, K) or empty, dw (G, N, K) or empty) for dy (M, N) in x's dtype."""
    from .grouped_gemm import _dw_triton, _mm_triton, _ref_grads

    if use_triton:
        dx = _mm_triton(dy, w, counts, transpose_b=False) if need_dx else None
        dw = _dw_triton(dy, x, counts) if need_dw else None
    else:
        dx, dw = _ref_grads(dy, x, w, counts, need_dx, need_dw)
    return (dx if dx is not None else _nothing(x)), (dw if dw is not None else _nothing(w))


@register_fake("cuboid::grouped_mm_backward")
def _grouped_mm_backward_fake(dy, x, w, counts, use_triton, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else _nothing(x)), (w.new_empty(w.shape) if need_dw else _nothing(w))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, counts, use_triton = inputs
    ctx.save_for_backward(x, w, counts)
    ctx.use_triton = use_triton


def _grouped_mm_grad(ctx, dy):
    x, w, counts = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[:2]
    if not (need_dx or need_dw):
        return None, None, None, None
    dx, dw = _grouped_mm_backward(dy.to(x.dtype), x, w, counts, ctx.use_triton, need_dx, need_dw)
    return (dx if need_dx else None), (dw if need_dw else None), None, None


register_autograd("cuboid::grouped_mm", _grouped_mm_grad, setup_context=_grouped_mm_setup)


def grouped_mm(x: Tensor, w: Tensor, counts: Tensor, use_triton: bool) -> Tensor:
    """The grouped matmul through the op (kernels/grouped_gemm.py's contract; checks are the caller's)."""
    return _grouped_mm(x, w, counts, use_triton)
