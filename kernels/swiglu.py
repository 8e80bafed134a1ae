"""SwiGLU activation: ``silu(gate) * up``, forward and backward fused.

The gated linear unit with a Swish gate (Shazeer 2020, "GLU Variants Improve
Transformer", arXiv 2002.05202), as in Llama's MLP:
``down(silu(gate_proj(x)) * up_proj(x))``, with ``silu(a) = a * sigmoid(a)``.
This op is the elementwise middle: one read of ``gate`` and ``up``, one write,
instead of torch's separate silu and multiply (and their saved temporaries).

Gradients, with ``s = sigmoid(a)``:

    d gate = dy * up * s * (1 + a * (1 - s)),   d up = dy * a * s

Layout: ``gate`` and ``up`` share one shape (..., N) and dtype (fp32, fp16,
bf16), viewed as M rows of N; rows may have any stride (``gate, up =
proj(x).chunk(2, -1)`` is read without a copy), the last dim must be unit
stride or is copied. Outputs are contiguous, in the inputs' dtype. All
arithmetic is fp32; half precision exists only at loads and stores.

Design: Liger-Kernel's ``swiglu`` (one program per row block; the backward
recomputes ``silu`` from the saved inputs rather than saving it), re-derived
here; it writes new gradient tensors instead of overwriting the inputs, and
tiles the columns so any N fits.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import custom_op, register_autograd, register_fake

from ._backend import check_floating, check_same_dtype, on_device, picked, resolve_backend

Tensor = torch.Tensor
_OP = "swiglu"
MAX_BLOCK_N = 4096  # columns per program; wider rows take several programs
# op -> number of GPU autotune entries: entry 1 doubles the warps (see _launch_cfg)
AUTOTUNE = {"swiglu": 2}


# ----------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------


@triton.jit
def _swiglu_fwd_kernel(
    G,  # (M, N) gate rows, row stride stride_g, unit column stride
    U,  # (M, N) up rows, row stride stride_u
    Y,  # (M, N) output silu(gate) * up, contiguous, input dtype
    N,
    stride_g, stride_u,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    a = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)  # fp32 arithmetic
    b = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY,  # (M, N) gradient of the output, row stride stride_dy
    G,  # (M, N) saved gate rows, row stride stride_g
    U,  # (M, N) saved up rows, row stride stride_u
    DG,  # (M, N) output gradient of gate, contiguous, input dtype
    DU,  # (M, N) output gradient of up, contiguous, input dtype
    N,
    stride_dy, stride_g, stride_u,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)  # recomputed, not saved
    silu = a * s
    dg = dy * b * s * (1.0 + a * (1.0 - s))
    du = dy * silu
    tl.store(DG + row * N + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * N + cols, du.to(DU.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


def _rows(t: Tensor, N: int) -> Tensor:
    """View ``t`` as (M, N) rows with unit column stride (copying only if needed)."""
    t2 = t.reshape(-1, N)
    return t2 if t2.stride(-1) == 1 or N == 1 else t2.contiguous()


def _launch_cfg(N: int) -> Tuple[int, int, int]:
    """(BLOCK_N, column programs, num_warps): one heuristic; entry 1 of the autotune list doubles the warps."""
    block_n = min(triton.next_power_of_2(N), MAX_BLOCK_N)
    num_warps = 8 if block_n >= 2048 else 4 if block_n >= 512 else 2
    return block_n, triton.cdiv(N, block_n), picked(_OP, (num_warps, 2 * num_warps))


def _swiglu_fwd(g2: Tensor, u2: Tensor) -> Tensor:
    M, N = g2.shape
    y = torch.empty((M, N), dtype=g2.dtype, device=g2.device)
    if M * N:
        block_n, col_progs, num_warps = _launch_cfg(N)
        with on_device(g2):
            _swiglu_fwd_kernel[(M, col_progs)](g2, u2, y, N, g2.stride(0), u2.stride(0),
                                               BLOCK_N=block_n, num_warps=num_warps)
    return y


def _swiglu_bwd(dy2: Tensor, g2: Tensor, u2: Tensor) -> Tuple[Tensor, Tensor]:
    M, N = g2.shape
    dg = torch.empty((M, N), dtype=g2.dtype, device=g2.device)
    du = torch.empty((M, N), dtype=u2.dtype, device=u2.device)
    if M * N:
        block_n, col_progs, num_warps = _launch_cfg(N)
        with on_device(g2):
            _swiglu_bwd_kernel[(M, col_progs)](dy2, g2, u2, dg, du, N, dy2.stride(0), g2.stride(0), u2.stride(0),
                                               BLOCK_N=block_n, num_warps=num_warps)
    return dg, du


# ----------------------------------------------------------------------------
# Torch reference (also the CPU path)
# ----------------------------------------------------------------------------


def _swiglu_torch(gate: Tensor, up: Tensor) -> Tensor:
    cdt = torch.float64 if gate.dtype == torch.float64 else torch.float32
    return (F.silu(gate.to(cdt)) * up.to(cdt)).to(gate.dtype)


def _check(gate, up, *, triton_path: bool) -> None:
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if not triton_path:
        dtypes = dtypes + (torch.float64,)
    check_floating(_OP, "gate", gate, dtypes)
    check_floating(_OP, "up", up, dtypes)
    check_same_dtype(_OP, gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"{_OP}: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dim() < 1:
        raise ValueError(f"{_OP}: gate and up need a last (hidden) dimension, got a 0-D tensor")


def swiglu_ref(gate: Tensor, up: Tensor) -> Tensor:
    """Plain-torch ``silu(gate) * up`` (fp32 compute, fp64 for fp64 inputs; result in gate's dtype)."""
    _check(gate, up, triton_path=False)
    return _swiglu_torch(gate, up)


# ----------------------------------------------------------------------------
# Autograd Function
# ----------------------------------------------------------------------------


class _SwiGLUTorchFunction(torch.autograd.Function):
    """The torch path in fp32 / fp64 when a gradient is wanted: autograd's ops for ``silu(gate) * up``, so the
    same values bit for bit, written in place into fresh tensors: one of the output's size in forward and two
    in backward, where autograd's graph makes five and saves ``silu(gate)`` beside the inputs."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg = torch.mul(dy, up)
        torch.ops.aten.silu_backward.grad_input(dg, gate, grad_input=dg)  # dy * up * s * (1 + a * (1 - s))
        return dg, F.silu(gate).mul_(dy)  # dy * a * s


# ----------------------------------------------------------------------------
# The custom ops cuboid::swiglu and cuboid::swiglu_backward (the Triton path; kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::swiglu", mutates_args=())
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of (M, N) rows (unit column stride), contiguous."""
    return _swiglu_fwd(gate, up)


@register_fake("cuboid::swiglu")
def _swiglu_fake(gate, up):
    return gate.new_empty(gate.shape)


@custom_op("cuboid::swiglu_backward", mutates_args=())
def _swiglu_backward(dy: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    """(dgate, dup) of (M, N) rows, the gate recomputed."""
    return _swiglu_bwd(dy, gate, up)


@register_fake("cuboid::swiglu_backward")
def _swiglu_backward_fake(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, dy):
    gate, up = ctx.saved_tensors
    return _swiglu_backward(_rows(dy.to(gate.dtype), gate.shape[1]), gate, up)


register_autograd("cuboid::swiglu", _swiglu_grad, setup_context=_swiglu_setup)


# ----------------------------------------------------------------------------
# Public function
# ----------------------------------------------------------------------------


def swiglu(gate: Tensor, up: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """``silu(gate) * up`` elementwise, for Llama-style MLPs.

    Args:
        gate, up: one shape (..., N) and dtype (fp32/fp16/bf16), one device;
            rows may be strided views (e.g. the two halves of a fused projection).
        backend: ``"triton"``, ``"torch"`` or None (automatic, see
            :func:`cuboid.kernels.resolve_backend`).

    Returns a contiguous tensor of gate's shape and dtype, differentiable w.r.t.
    both inputs.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    chosen = resolve_backend(_OP, [gate, up], backend)
    _check(gate, up, triton_path=chosen == "triton")
    if chosen == "torch":
        if gate.dtype in (torch.float32, torch.float64) and torch.is_grad_enabled() and (
                gate.requires_grad or up.requires_grad):
            return _SwiGLUTorchFunction.apply(gate, up)
        return _swiglu_torch(gate, up)
    n = gate.shape[-1]
    return _swiglu(_rows(gate, n), _rows(up, n)).view(gate.shape)
