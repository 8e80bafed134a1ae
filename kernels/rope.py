"""Rotary position embeddings (RoPE) applied to queries and keys, fused in one launch.

RoFormer (Su et al. 2021, arXiv 2104.09864) in the "rotate half" layout of
GPT-NeoX and Hugging Face Llama: with ``x = [x1, x2]`` split at ``D / 2``,

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]

exactly ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k,
cos, sin, unsqueeze_dim=1)``. The backward of a rotation is the rotation by
``-sin``; for general tables (halves of ``cos``/``sin`` not equal) it is the
transpose, ``dx = dy * cos + rotate_half^T(dy * sin)``, which is what the
kernel computes, so it is exact for any table.

Layout: ``q`` (B, H, T, D) and ``k`` (B, Hkv, T, D) (grouped-query heads:
Hkv need not equal H), any strides; ``cos``/``sin`` (T, D), (1, T, D) or
(B, T, D), e.g. from :func:`rope_tables`. Outputs have q's / k's dtype and
memory layout. Arithmetic is fp32; halves exist only at loads and stores.
Gradients reach ``cos``/``sin`` too when they require them (a torch reduction
in backward; the tables of a Llama model are buffers and need none).

Design: the kernel follows Liger-Kernel's ``rope`` (one program per
(batch, token) that rotates all q heads and all k heads of that token, with the
token's cos/sin row loaded once; a flag turns the forward into the backward),
re-derived here. Unlike Liger it reads any strides and writes new tensors
(no transposed copy, no in-place update of the inputs), and loads both halves
of the tables rather than assuming they repeat. Heads are processed in tiles
of ``BLOCK_H`` x ``D / 2`` so any head count fits.

:func:`rope_tables` builds ``(cos, sin)`` from position ids as transformers'
``LlamaRotaryEmbedding`` does, in fp32: inverse frequencies
``theta ** (-2i / D)``, optionally rescaled by Llama 3's ``rope_scaling``
(type ``"llama3"``, the formula of transformers' ``_compute_llama3_parameters``).
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import custom_op, register_autograd, register_fake

from ._backend import check_floating, check_same_dtype, on_device, picked, resolve_backend

Tensor = torch.Tensor
_OP = "rope"
TILE_ELEMS = 4096  # target elements per half-tile (heads x D/2) of one program step
# op -> number of GPU autotune entries: entry 1 doubles the warps (see _rope_launch)
AUTOTUNE = {"rope": 2}


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _rope_heads(
    X,  # (n_heads, D) rows of one token, head stride x_sh, dim stride x_sd
    Y,  # (n_heads, D) output rows of the same token
    x_sh, x_sd, y_sh, y_sd,
    n_heads, HALF,  # heads in X, D / 2
    c1, c2, s1, s2,  # (BLOCK_HALF,) fp32: the two halves of the token's cos and sin
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    for h0 in range(0, n_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < n_heads)[:, None] & d_ok[None, :]
        x_ptr = X + offs_h[:, None] * x_sh + offs_d[None, :] * x_sd
        y_ptr = Y + offs_h[:, None] * y_sh + offs_d[None, :] * y_sd
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_HALF), fp32
        x2 = tl.load(x_ptr + HALF * x_sd, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:  # transpose of the forward map: rotation by -sin when the halves repeat
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
        tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y_ptr + HALF * y_sd, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q,  # (B, H, T, D) queries (or their output gradient in backward), any strides
    K,  # (B, Hkv, T, D) keys (or their output gradient), any strides
    QO,  # (B, H, T, D) output, q's dtype
    KO,  # (B, Hkv, T, D) output, k's dtype
    COS,  # (B or 1, T, D) table, any float dtype; batch stride 0 when shared
    SIN,  # (B or 1, T, D) table, like COS
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qob, stride_qoh, stride_qot, stride_qod,
    stride_kob, stride_koh, stride_kot, stride_kod,
    stride_cb, stride_ct, stride_cd,
    stride_sb, stride_st, stride_sd,
    T, H, HKV, HALF,
    BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per (batch, token): its cos/sin row is loaded once for all q and k heads.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    c_ptr = COS + b * stride_cb + t * stride_ct + offs_d * stride_cd
    s_ptr = SIN + b * stride_sb + t * stride_st + offs_d * stride_sd
    c1 = tl.load(c_ptr, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(c_ptr + HALF * stride_cd, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(s_ptr, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(s_ptr + HALF * stride_sd, mask=d_ok, other=0.0).to(tl.float32)
    _rope_heads(Q + b * stride_qb + t * stride_qt, QO + b * stride_qob + t * stride_qot,
                stride_qh, stride_qd, stride_qoh, stride_qod, H, HALF, c1, c2, s1, s2,
                BACKWARD, BLOCK_HQ, BLOCK_HALF)
    _rope_heads(K + b * stride_kb + t * stride_kt, KO + b * stride_kob + t * stride_kot,
                stride_kh, stride_kd, stride_koh, stride_kod, HKV, HALF, c1, c2, s1, s2,
                BACKWARD, BLOCK_HKV, BLOCK_HALF)


# ----------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------


def _table3(t: Tensor, B: int) -> Tuple[Tensor, Tuple[int, int, int]]:
    """A (T, D) / (1, T, D) / (B, T, D) table and its (batch, token, dim) strides (batch 0 when shared)."""
    if t.dim() == 2:
        return t, (0, t.stride(0), t.stride(1))
    return t, ((0 if t.shape[0] == 1 and B != 1 else t.stride(0)), t.stride(1), t.stride(2))


def _rope_launch(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tuple[Tensor, Tensor]:
    """Rotate q (B, H, T, D) and k (B, Hkv, T, D) in one launch; outputs keep the inputs' layouts."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qo = torch.empty_like(q)  # same memory layout as q when q is dense
    ko = torch.empty_like(k)
    if B * T == 0:
        return qo, ko
    half = D // 2
    block_half = triton.next_power_of_2(half)
    per_tile = max(1, TILE_ELEMS // block_half)
    block_hq = min(triton.next_power_of_2(H), per_tile) if H else 1
    block_hkv = min(triton.next_power_of_2(Hkv), per_tile) if Hkv else 1
    tile = max(block_hq, block_hkv) * block_half
    num_warps = 8 if tile >= 2048 else 4 if tile >= 256 else 2  # one heuristic; entry 1 is for GPU autotuning
    num_warps = picked(_OP, (num_warps, 2 * num_warps))
    cos, cs = _table3(cos, B)
    sin, ss = _table3(sin, B)
    with on_device(q):
        _rope_kernel[(B * T,)](
            q, k, qo, ko, cos, sin,
            *q.stride(), *k.stride(), *qo.stride(), *ko.stride(), *cs, *ss,
            T, H, Hkv, half,
            BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
            num_warps=num_warps,
        )
    return qo, ko


# ----------------------------------------------------------------------------
# Tables: inverse frequencies and (cos, sin) from positions
# ----------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Mapping] = None, device=None) -> Tensor:
    """(head_dim / 2,) fp32 inverse frequencies, as transformers computes them for Llama.

    ``scaling`` is a Hugging Face ``rope_scaling`` dict: None or type
    ``"default"`` gives ``1 / theta ** (2i / head_dim)``; type ``"llama3"``
    (keys ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``) divides low frequencies by ``factor``
    and interpolates the band between (Llama 3.1's context extension).
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_tables: head_dim must be an even int >= 2, got {head_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"rope_tables: theta must be a positive number, got {theta!r}")
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"rope_tables: rope scaling type {kind!r} is not supported (only 'default' and 'llama3').")
    # same ops, same order as transformers, so the tables are bit-identical
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if kind == "default":
        return inv_freq
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if key not in scaling]
    if missing:
        raise ValueError(f"rope_tables: llama3 rope scaling needs {', '.join(missing)}.")
    factor = scaling["factor"]
    low_freq_factor, high_freq_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    if not high_freq_factor > low_freq_factor:
        raise ValueError(f"rope_tables: llama3 rope scaling needs high_freq_factor > low_freq_factor, got "
                         f"{high_freq_factor} and {low_freq_factor}.")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are divided by factor, short ones kept
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in between: interpolate smoothly
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rope_tables(positions: Tensor, head_dim: int, theta: float, scaling: Optional[Mapping] = None,
                dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """``(cos, sin)``, each (T, head_dim) or (B, T, head_dim), for integer ``positions`` (T,) or (B, T).

    Computed in fp32 on positions' device (``freqs = pos * inv_freq``, both
    halves equal, as transformers' ``LlamaRotaryEmbedding``), then cast to
    ``dtype``. ``scaling``: see :func:`rope_inv_freq`.
    """
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.is_complex() \
            or positions.dtype == torch.bool:
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
        raise TypeError(f"rope_tables: positions must be an integer tensor (position ids), got {got}")
    if positions.dim() not in (1, 2):
        raise ValueError(f"rope_tables: positions must be (T,) or (B, T), got shape {tuple(positions.shape)}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=positions.device)
    freqs = positions[..., None].float() * inv_freq  # (..., T, D/2) fp32
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# ----------------------------------------------------------------------------
# Torch reference (also the CPU path)
# ----------------------------------------------------------------------------


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_torch(q, k, cos, sin) -> Tuple[Tensor, Tensor]:
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    c, s = cos.to(cdt), sin.to(cdt)
    c, s = (c[None, None], s[None, None]) if c.dim() == 2 else (c[:, None], s[:, None])  # (B or 1, 1, T, D)
    qf, kf = q.to(cdt), k.to(cdt)
    q_rot = qf * c + _rotate_half(qf) * s
    k_rot = kf * c + _rotate_half(kf) * s
    return q_rot.to(q.dtype), k_rot.to(k.dtype)


def _rotate(x: Tensor, c: Tensor, s: Tensor, transpose: bool) -> Tensor:
    """``x * c + rotate_half(x) * s`` (or its transpose, the backward's map) half by half, without the
    ``cat`` of :func:`_rotate_half`; c, s broadcast to x and in x's compute dtype."""
    h = x.shape[-1] // 2
    x1, x2, c1, c2, s1, s2 = x[..., :h], x[..., h:], c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if torch.compiler.is_compiling():  # traced: out-of-place halves (no out= into strided views), fused by inductor
        if transpose:
            return torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), -1)
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1)
    out = torch.empty(torch.broadcast_shapes(x.shape, c.shape), dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :h], out[..., h:]
    if transpose:  # dx1 = c1 dy1 + s2 dy2, dx2 = c2 dy2 - s1 dy1
        torch.mul(x1, c1, out=o1).addcmul_(x2, s2)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s1, value=-1.0)
    else:  # y1 = c1 x1 - s1 x2, y2 = c2 x2 + s2 x1
        torch.mul(x1, c1, out=o1).addcmul_(x2, s1, value=-1.0)
        torch.mul(x2, c2, out=o2).addcmul_(x1, s2)
    return out


class _RopeTorchFunction(torch.autograd.Function):
    """The torch path of RoPE on (q, k) with tables that need no gradient: forward and backward (the
    transposed rotation) half by half in fp32 (fp64 for fp64), saving only the tables."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        c, s = cos.to(cdt), sin.to(cdt)
        c, s = (c[None, None], s[None, None]) if c.dim() == 2 else (c[:, None], s[:, None])  # (B or 1, 1, T, D)
        ctx.save_for_backward(c, s)
        return _rotate(q.to(cdt), c, s, False).to(q.dtype), _rotate(k.to(cdt), c, s, False).to(k.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq, dk):
        c, s = ctx.saved_tensors
        return (_rotate(dq.to(c.dtype), c, s, True).to(dq.dtype), _rotate(dk.to(c.dtype), c, s, True).to(dk.dtype),
                None, None)


def _check(q, k, cos, sin, *, triton_path: bool) -> None:
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if not triton_path:
        dtypes = dtypes + (torch.float64,)
    for name, t in (("q", q), ("k", k)):
        check_floating(_OP, name, t, dtypes)
    for name, t in (("cos", cos), ("sin", sin)):
        check_floating(_OP, name, t, (torch.float32, torch.float16, torch.bfloat16, torch.float64))
    check_same_dtype(_OP, q=q, k=k)
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    B, _, T, D = q.shape
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != D:
        raise ValueError(f"{_OP}: k must share batch, seq and head_dim with q, got {tuple(k.shape)} "
                         f"and {tuple(q.shape)}")
    if D % 2:
        raise ValueError(f"{_OP}: head_dim must be even, got {D}")
    if cos.shape != sin.shape:
        raise ValueError(f"{_OP}: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    ok = tuple(cos.shape) == (T, D) or (cos.dim() == 3 and cos.shape[0] in (1, B) and tuple(cos.shape[1:]) == (T, D))
    if not ok:
        raise ValueError(f"{_OP}: cos and sin must be (T, D) = {(T, D)}, (1, T, D) or (B, T, D) = {(B, T, D)}, "
                         f"got {tuple(cos.shape)}")


def rope_ref(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """Plain-torch RoPE (fp32 compute, fp64 for fp64 inputs; outputs in q's / k's dtype); see :func:`rope`."""
    _check(q, k, cos, sin, triton_path=False)
    return _rope_torch(q, k, cos, sin)


# ----------------------------------------------------------------------------
# Backward pieces
# ----------------------------------------------------------------------------


def _table_grad(dq, dk, q, k, rot: bool, like: Tensor) -> Tensor:
    """d(cos) (rot=False) or d(sin) (rot=True): sum over heads of dy * x (or dy * rotate_half(x)), fp32."""
    g = torch.zeros((), dtype=torch.float32, device=q.device)
    for dy, x in ((dq, q), (dk, k)):
        x = x.float()
        g = g + (dy.float() * (_rotate_half(x) if rot else x)).sum(1)  # (B, T, D)
    if like.dim() == 2:
        g = g.sum(0)
    elif like.shape[0] == 1:
        g = g.sum(0, keepdim=True)
    return g.to(like.dtype)


# ----------------------------------------------------------------------------
# The custom op cuboid::rope (the Triton path; kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> Tuple[Tensor, Tensor]:
    """(q_rot, k_rot) in one launch; ``backward``: the transposed rotation (the gradient's map)."""
    return _rope_launch(q, k, cos, sin, backward)


@register_fake("cuboid::rope")
def _rope_fake(q, k, cos, sin, backward):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup(ctx, inputs, output):
    q, k, cos, sin, backward = inputs
    tables = cos.requires_grad or sin.requires_grad
    ctx.save_for_backward(cos, sin, q if tables else None, k if tables else None)


def _rope_grad(ctx, dq_rot, dk_rot):
    cos, sin, q, k = ctx.saved_tensors
    dq_rot = dq_rot if dq_rot is not None else torch.zeros_like(q)
    dk_rot = dk_rot if dk_rot is not None else torch.zeros_like(k)
    dq, dk = _rope(dq_rot, dk_rot, cos, sin, True)
    dcos = _table_grad(dq_rot, dk_rot, q, k, False, cos) if ctx.needs_input_grad[2] else None
    dsin = _table_grad(dq_rot, dk_rot, q, k, True, sin) if ctx.needs_input_grad[3] else None
    return dq, dk, dcos, dsin, None


register_autograd("cuboid::rope", _rope_grad, setup_context=_rope_setup)


# ----------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Rotary embeddings of queries and keys: ``(q * cos + rotate_half(q) * sin, same for k)``.

    Args:
        q: (B, H, T, D); k: (B, Hkv, T, D); one dtype (fp32/fp16/bf16), D even,
            any strides.
        cos, sin: (T, D), (1, T, D) or (B, T, D), any float dtype (fp32 from
            :func:`rope_tables` is usual), Hugging Face Llama's layout.
        backend: ``"triton"``, ``"torch"`` or None (automatic, see
            :func:`cuboid.kernels.resolve_backend`).

    Returns ``(q_rot, k_rot)`` with q's and k's shapes and dtype, differentiable
    w.r.t. q, k (and cos, sin).
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    chosen = resolve_backend(_OP, [q, k, cos, sin], backend)
    _check(q, k, cos, sin, triton_path=chosen == "triton")
    if chosen == "torch":
        # gradients of the tables, or no gradient at all (a decoding step: at a few rows the formula's five ops
        # take less time on CPU than the Function's half-by-half rotation): plain autograd
        wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
        if cos.requires_grad or sin.requires_grad or not wants_grad:
            return _rope_torch(q, k, cos, sin)
        return _RopeTorchFunction.apply(q, k, cos, sin)
    return _rope(q, k, cos, sin, False)
