"""Fused multi-tensor optimizer steps: AdamW, LAMB, LARS (and a sum-of-squares helper).

One Triton launch updates a whole *list* of tensors, not one tensor: the
launcher writes int64 tables of ``data_ptr()`` addresses (one row per tensor
list: params, grads, states, masters), a table of numels and a per-program map
``(tensor index, first element, partial-sum slot)``. Each program reads its
tensor's address from the table and casts it to a typed pointer
(``tl.load(TABLE + t).to(tl.pointer_type(DTYPE))``), so every tensor with the
same dtype combination (param dtype, grad dtype, has-master) goes into one
launch. The tables live on the tensors' device and are cached, keyed on the
addresses, numels and per-tensor hyperparameters, so a training loop with an
unchanged parameter list builds them once.

LAMB and LARS need per-tensor norms. Phase 1 writes one partial sum of squares
per program block; a segment-sum kernel (deterministic, one program per tensor
in a fixed order) gives the ``(2, n_tensors)`` fp32 squared norms; an optional
``norm_reducer`` callable then sees them (parallel/ all-reduces them across
shards there) and phase 2 applies the update. The returned ``(2, n)`` tensor
holds the (reduced) norms, not squared.

Math is fp32 throughout (half params and grads are upcast at load, cast back
at store); optimizer states and master weights are fp32. With
``master_params`` the fp32 master is updated and the model param receives
``master.to(param.dtype)``. Papers: AdamW (Loshchilov & Hutter, 1711.05101),
LAMB (You et al., 1904.00962, with Adam bias correction as apex FusedLAMB),
LARS (You et al., 1708.03888).

Backends follow :mod:`cuboid.kernels._backend`; the torch path (``*_ref``)
uses ``torch._foreach_*`` ops and is the CPU default.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from types import SimpleNamespace
from typing import Callable, Optional, Sequence, Union

import torch
import triton
import triton.language as tl

from ._backend import check_floating, picked, resolve_backend

BLOCK = 1024  # elements per program (fixed: autotune does not run in the interpreter)
# op -> number of GPU autotune entries, (BLOCK, num_warps); entry 0 is the launchers' choice (see _tile)
AUTOTUNE = {"optim": 3}
_SEGMENT_BLOCK = 256  # partial sums read per segment-sum iteration
_PLAN_CACHE_SIZE = 16

Floats = Union[float, Sequence[float]]
Bools = Union[bool, Sequence[bool]]
NormReducer = Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]]


# --------------------------------------------------------------------------- kernels
# Every *_PTRS argument is an (n_tensors,) int64 table of addresses; PROG_T
# (programs,) int32 gives each program its tensor, PROG_START (programs,) int64
# its first element, PROG_SLOT (programs,) int64 its partial-sum slot.

@triton.jit
def _block(NUMELS, PROG_T, PROG_START, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(PROG_T + pid)
    offs = tl.load(PROG_START + pid) + tl.arange(0, BLOCK)  # int64 offsets
    mask = offs < tl.load(NUMELS + t)
    return pid, t, offs, mask


@triton.jit
def _ptr(TABLE, t, DTYPE: tl.constexpr):
    """Entry ``t`` of an address table, as a pointer to DTYPE."""
    return tl.load(TABLE + t).to(tl.pointer_type(DTYPE))


@triton.jit
def _ld(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _weight_ptrs(P_PTRS, W_PTRS, t, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    """(param pointer, fp32 weight pointer): the master if there is one, else the param."""
    p_ptr = _ptr(P_PTRS, t, P_DTYPE)
    if HAS_MASTER:
        w_ptr = _ptr(W_PTRS, t, tl.float32)
    else:
        w_ptr = p_ptr
    return p_ptr, w_ptr


@triton.jit
def _store_weight(p_ptr, w_ptr, offs, mask, w, P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr):
    if HAS_MASTER:
        tl.store(w_ptr + offs, w, mask=mask)
    tl.store(p_ptr + offs, w.to(P_DTYPE), mask=mask)  # round to nearest even


@triton.jit
def _ld_grad(G_PTRS, t, offs, mask, G_DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr):
    g = _ld(_ptr(G_PTRS, t, G_DTYPE), offs, mask)
    if MAXIMIZE:
        g = -g
    return g


@triton.jit
def _adamw_kernel(
    P_PTRS,  # params, P_DTYPE
    G_PTRS,  # grads, G_DTYPE
    M_PTRS,  # exp_avg, fp32
    V_PTRS,  # exp_avg_sq, fp32
    W_PTRS,  # fp32 masters (used only when HAS_MASTER)
    NUMELS, PROG_T, PROG_START,
    one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, bc2_sqrt,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
    MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    _, t, offs, mask = _block(NUMELS, PROG_T, PROG_START, BLOCK)
    p_ptr, w_ptr = _weight_ptrs(P_PTRS, W_PTRS, t, P_DTYPE, HAS_MASTER)
    m_ptr, v_ptr = _ptr(M_PTRS, t, tl.float32), _ptr(V_PTRS, t, tl.float32)
    w, m, v = _ld(w_ptr, offs, mask), _ld(m_ptr, offs, mask), _ld(v_ptr, offs, mask)
    g = _ld_grad(G_PTRS, t, offs, mask, G_DTYPE, MAXIMIZE)
    # same operation order as torch.optim.AdamW (single-tensor path)
    w = w * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    w = w - step_size * (m / (tl.sqrt_rn(v) / bc2_sqrt + eps))
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    _store_weight(p_ptr, w_ptr, offs, mask, w, P_DTYPE, HAS_MASTER)


@triton.jit
def _lamb_direction(m, v, w, wd, eps, bc1, bc2):
    """u = m_hat / (sqrt(v_hat) + eps) + wd * w, all fp32."""
    return (m / bc1) / (tl.sqrt_rn(v / bc2) + eps) + wd * w


@triton.jit
def _lamb_phase1_kernel(
    P_PTRS, G_PTRS, M_PTRS, V_PTRS, W_PTRS,  # as in _adamw_kernel
    NUMELS, WDS,  # (n,) fp32 per-tensor weight decay
    PROG_T, PROG_START, PROG_SLOT,
    PARTIAL,  # (2, n_slots) fp32: per-block sums of w^2 (row 0) and u^2 (row 1)
    n_slots, one_minus_beta1, beta2, one_minus_beta2, eps, bc1, bc2,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
    MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    pid, t, offs, mask = _block(NUMELS, PROG_T, PROG_START, BLOCK)
    _, w_ptr = _weight_ptrs(P_PTRS, W_PTRS, t, P_DTYPE, HAS_MASTER)
    m_ptr, v_ptr = _ptr(M_PTRS, t, tl.float32), _ptr(V_PTRS, t, tl.float32)
    w, m, v = _ld(w_ptr, offs, mask), _ld(m_ptr, offs, mask), _ld(v_ptr, offs, mask)
    g = _ld_grad(G_PTRS, t, offs, mask, G_DTYPE, MAXIMIZE)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = tl.where(mask, _lamb_direction(m, v, w, tl.load(WDS + t), eps, bc1, bc2), 0.0)
    slot = tl.load(PROG_SLOT + pid)
    tl.store(PARTIAL + slot, tl.sum(w * w, axis=0))  # fp32 accumulation
    tl.store(PARTIAL + n_slots + slot, tl.sum(u * u, axis=0))


@triton.jit
def _lamb_phase2_kernel(
    P_PTRS, M_PTRS, V_PTRS, W_PTRS, NUMELS, WDS,
    SCALE,  # (n,) fp32: lr * trust ratio per tensor
    PROG_T, PROG_START, eps, bc1, bc2,
    P_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, BLOCK: tl.constexpr,
):
    _, t, offs, mask = _block(NUMELS, PROG_T, PROG_START, BLOCK)
    p_ptr, w_ptr = _weight_ptrs(P_PTRS, W_PTRS, t, P_DTYPE, HAS_MASTER)
    w = _ld(w_ptr, offs, mask)
    m, v = _ld(_ptr(M_PTRS, t, tl.float32), offs, mask), _ld(_ptr(V_PTRS, t, tl.float32), offs, mask)
    u = _lamb_direction(m, v, w, tl.load(WDS + t), eps, bc1, bc2)  # recomputed: no u buffer
    _store_weight(p_ptr, w_ptr, offs, mask, w - tl.load(SCALE + t) * u, P_DTYPE, HAS_MASTER)


@triton.jit
def _sumsq_kernel(
    A_PTRS,  # A_DTYPE: row 0 of PARTIAL
    B_PTRS,  # B_DTYPE: row 1 of PARTIAL (only when HAS_B)
    NUMELS, PROG_T, PROG_START, PROG_SLOT,
    PARTIAL,  # (1 or 2, n_slots) fp32 per-block sums of squares
    n_slots,
    A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr,
):
    pid, t, offs, mask = _block(NUMELS, PROG_T, PROG_START, BLOCK)
    slot = tl.load(PROG_SLOT + pid)
    a = _ld(_ptr(A_PTRS, t, A_DTYPE), offs, mask)
    tl.store(PARTIAL + slot, tl.sum(a * a, axis=0))
    if HAS_B:
        b = _ld(_ptr(B_PTRS, t, B_DTYPE), offs, mask)
        tl.store(PARTIAL + n_slots + slot, tl.sum(b * b, axis=0))


@triton.jit
def _segment_sum_kernel(
    PARTIAL,  # (ROWS, n_slots) fp32
    SLOT_OFFSETS,  # (n + 1,) int64: tensor t owns slots [off[t], off[t+1])
    OUT,  # (ROWS, n) fp32
    n_slots, n_tensors, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # one program per tensor, slots summed in a fixed order: deterministic (no atomics)
    t = tl.program_id(0)
    lo = tl.load(SLOT_OFFSETS + t)
    hi = tl.load(SLOT_OFFSETS + t + 1)
    for r in tl.static_range(ROWS):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(lo, hi, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            acc += tl.load(PARTIAL + r * n_slots + offs, mask=offs < hi, other=0.0)
        tl.store(OUT + r * n_tensors + t, tl.sum(acc, axis=0))


@triton.jit
def _lars_phase2_kernel(
    P_PTRS, G_PTRS,
    B_PTRS,  # momentum buffers, fp32
    W_PTRS, NUMELS, WDS,
    SCALE,  # (n,) fp32: lr * trust ratio per tensor
    PROG_T, PROG_START, momentum,
    P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
    MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    _, t, offs, mask = _block(NUMELS, PROG_T, PROG_START, BLOCK)
    p_ptr, w_ptr = _weight_ptrs(P_PTRS, W_PTRS, t, P_DTYPE, HAS_MASTER)
    b_ptr = _ptr(B_PTRS, t, tl.float32)
    w, buf = _ld(w_ptr, offs, mask), _ld(b_ptr, offs, mask)
    g = _ld_grad(G_PTRS, t, offs, mask, G_DTYPE, MAXIMIZE)
    buf = buf * momentum + tl.load(SCALE + t) * (g + tl.load(WDS + t) * w)
    tl.store(b_ptr + offs, buf, mask=mask)
    _store_weight(p_ptr, w_ptr, offs, mask, w - buf, P_DTYPE, HAS_MASTER)


# --------------------------------------------------------------------------- launchers

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _launch(kernel, n_programs: int, *args, **meta) -> None:
    """Every launch in this module goes through here (tests count calls)."""
    if n_programs > 0:
        kernel[(n_programs,)](*args, **meta)


_PLANS: "OrderedDict[tuple, SimpleNamespace]" = OrderedDict()  # launch tables, LRU


def _tile() -> tuple:
    """(BLOCK, num_warps) of the elementwise kernels: 8 elements per thread; the others are autotune entries."""
    return picked("optim", ((BLOCK, 4), (2048, 8), (4096, 16)))


def _plan(lists, keys, tables: dict) -> SimpleNamespace:
    """Device-resident launch tables for ``lists`` (None entries allowed), grouped by ``keys``.

    ``ptrs`` (n_lists, n) int64 addresses, ``numels`` (n,), ``groups`` [(key, programs, prog_t,
    prog_start, prog_slot)], ``slot_offsets`` (n + 1,), ``tables`` name -> (n,) fp32.
    """
    ref = lists[0]
    device = ref[0].device
    block, warps = _tile()
    numels = tuple(t.numel() for t in ref)
    addr = tuple(tuple(0 if t is None else t.data_ptr() for t in lst) for lst in lists)
    cache_key = (str(device), block, warps, numels, addr, tuple(keys),
                 tuple(sorted((k, tuple(v)) for k, v in tables.items())))
    plan = _PLANS.get(cache_key)
    if plan is not None:
        _PLANS.move_to_end(cache_key)
        return plan
    n = len(ref)
    numel_t = torch.tensor(numels, dtype=torch.int64)
    nblocks = (numel_t + block - 1) // block
    slot_offsets = torch.zeros(n + 1, dtype=torch.int64)
    slot_offsets[1:] = torch.cumsum(nblocks, 0)
    members: dict = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    groups = []
    for k, idx in members.items():
        idx_t = torch.tensor(idx, dtype=torch.int64)
        cnt = nblocks[idx_t]
        total = int(cnt.sum())
        if total == 0:
            continue
        first = torch.cumsum(cnt, 0) - cnt
        bidx = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(first, cnt)
        prog_t = torch.repeat_interleave(idx_t, cnt).to(torch.int32)
        prog_slot = torch.repeat_interleave(slot_offsets[idx_t], cnt) + bidx
        groups.append((k, total, prog_t.to(device), (bidx * block).to(device), prog_slot.to(device)))
    plan = SimpleNamespace(
        ptrs=torch.tensor(addr, dtype=torch.int64).to(device), numels=numel_t.to(device), groups=groups,
        slot_offsets=slot_offsets.to(device), n_slots=int(slot_offsets[-1]), tile=dict(BLOCK=block, num_warps=warps),
        tables={k: torch.tensor(list(v), dtype=torch.float32).to(device) for k, v in tables.items()})
    _PLANS[cache_key] = plan
    if len(_PLANS) > _PLAN_CACHE_SIZE:
        _PLANS.popitem(last=False)
    return plan


def _segment_sums(plan, partial: torch.Tensor) -> torch.Tensor:
    rows, n = partial.shape[0], plan.numels.numel()
    out = torch.zeros(rows, n, dtype=torch.float32, device=partial.device)
    _launch(_segment_sum_kernel, n, partial, plan.slot_offsets, out, plan.n_slots, n,
            ROWS=rows, BLOCK=_SEGMENT_BLOCK)
    return out


def _meta(key):
    p_dtype, g_dtype, has_master = key
    return dict(P_DTYPE=_TL[p_dtype], G_DTYPE=_TL[g_dtype], HAS_MASTER=has_master)


# --------------------------------------------------------------------------- checks

class _Call:
    """A validated call: masters as a list (None entries), per-tensor wd / trust lists."""

    def __init__(self, op, params, grads, states: dict, master_params, *, step=None, betas=None,
                 weight_decay=None, trust_ratio=None):
        n = len(params)
        named = [("grads", grads), *states.items()]
        if master_params is not None:
            named.append(("master_params", master_params))
        for name, lst in named:
            if len(lst) != n:
                raise ValueError(f"{op}: got {n} params but {len(lst)} {name}")
        self.wds = _per_tensor(op, "weight_decay", 0.0 if weight_decay is None else weight_decay, n, float)
        self.trust = _per_tensor(op, "trust_ratio", True if trust_ratio is None else trust_ratio, n, bool)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
            raise ValueError(f"{op}: step must be an int >= 1 (the new step count), got {step!r}")
        if betas is not None and not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{op}: betas must be in [0, 1), got {tuple(betas)}")
        for i, p in enumerate(params):
            check_floating(op, f"params[{i}]", p)
            for name, lst in named:
                t = lst[i]
                if t is None and name == "master_params":
                    continue
                check_floating(op, f"{name}[{i}]", t)
                if t.shape != p.shape:
                    raise ValueError(f"{op}: {name}[{i}] has shape {tuple(t.shape)} "
                                     f"but params[{i}] has shape {tuple(p.shape)}")
                if t.device != p.device:
                    raise ValueError(f"{op}: {name}[{i}] is on {t.device} but params[{i}] is on {p.device}")
                if name != "grads" and t.dtype != torch.float32:
                    raise TypeError(f"{op}: {name}[{i}] has dtype {str(t.dtype).replace('torch.', '')}, "
                                    "expected float32 (optimizer state and master weights are fp32)")
        self.op, self.n = op, n
        self.masters = list(master_params) if master_params is not None else [None] * n
        self.backend = None
        self.bc = (1.0 - betas[0] ** step, 1.0 - betas[1] ** step) if betas is not None else None

    def resolve(self, params, grads, backend):
        if self.n:
            self.backend = resolve_backend(self.op, [*params, *grads], backend)
        return self.backend

    def plan(self, params, grads, states: dict, tables: dict):
        """Launch tables for the Triton path; in-place tensors must be contiguous (raw addresses)."""
        lists = [params, grads, *states.values(), self.masters]
        names = ["params", "grads", *states, "master_params"]
        for name, lst in zip(names, lists):
            for i, t in enumerate(lst):
                if t is not None and not t.is_contiguous() and name != "grads":
                    raise ValueError(f"{self.op}: {name}[{i}] is not contiguous; the Triton path updates "
                                     "it in place and needs contiguous tensors")
        lists[1] = self.grads = [g.contiguous() for g in grads]  # copies stay alive until the launches end
        keys = [(p.dtype, g.dtype, w is not None) for p, g, w in zip(params, grads, self.masters)]
        return _plan(lists, keys, tables)


def _per_tensor(op, name, value, n, kind) -> list:
    if isinstance(value, (bool, int, float)):
        return [kind(value)] * n
    value = [kind(v) for v in value]
    if len(value) != n:
        raise ValueError(f"{op}: got {n} params but {len(value)} {name} values")
    return value


def _reduce(norm_reducer: NormReducer, sq: torch.Tensor) -> torch.Tensor:
    if norm_reducer is None:
        return sq
    out = norm_reducer(sq)
    out = sq if out is None else out  # an in-place reducer (all_reduce) may return None
    if tuple(out.shape) != tuple(sq.shape):
        raise ValueError(f"norm_reducer returned shape {tuple(out.shape)}, expected {tuple(sq.shape)}")
    return out.to(torch.float32)


def _lamb_scale(norms, trust, lr):
    """lr * ||w|| / ||u|| per tensor; lr where either norm is 0 or trust is off."""
    wn, un = norms[0], norms[1]
    ok = trust & (wn > 0) & (un > 0)
    return (lr * torch.where(ok, wn / torch.where(ok, un, torch.ones_like(un)), torch.ones_like(wn))).float()


def _lars_scale(norms, trust, wds, eta, lr):
    """lr * eta * ||w|| / (||g|| + wd ||w||) per tensor; lr where either norm is 0 or trust is off."""
    wn, gn = norms[0], norms[1]
    ok = trust & (wn > 0) & (gn > 0)
    denom = torch.where(ok, gn + wds * wn, torch.ones_like(gn))
    return (lr * torch.where(ok, eta * wn / denom, torch.ones_like(wn))).float()


# --------------------------------------------------------------------------- torch path

def _work(params, masters):
    """fp32 tensors the update is applied to, and the (param, fp32 copy) pairs to write back."""
    work, back = [], []
    for p, w in zip(params, masters):
        if w is None and p.dtype != torch.float32:
            w = p.float()
        work.append(p if w is None else w)
        if w is not None:
            back.append((p, w))
    return work, back


def _copy_back(back):
    if back:
        torch._foreach_copy_([p for p, _ in back], [w for _, w in back])


def _fp32(grads, maximize):
    g = [x if x.dtype == torch.float32 else x.float() for x in grads]
    return torch._foreach_neg(g) if maximize else g


def _sq_norms(*lists) -> torch.Tensor:
    return torch.stack([torch.stack(torch._foreach_norm(lst, 2, dtype=torch.float32)) for lst in lists]) ** 2


def _adam_moments(exp_avgs, exp_avg_sqs, g, beta1, beta2):
    torch._foreach_lerp_(exp_avgs, g, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, g, g, value=1.0 - beta2)


def _adamw_torch(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, maximize):
    (bc1, bc2), (work, back) = c.bc, _work(params, c.masters)
    g = _fp32(grads, maximize)
    if weight_decay != 0:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    _adam_moments(exp_avgs, exp_avg_sqs, g, beta1, beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(bc2))
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, value=-lr / bc1)
    _copy_back(back)


def _lamb_torch(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, norm_reducer, maximize):
    (bc1, bc2), (work, back) = c.bc, _work(params, c.masters)
    g = _fp32(grads, maximize)
    _adam_moments(exp_avgs, exp_avg_sqs, g, beta1, beta2)
    u = torch._foreach_div(exp_avgs, bc1)
    denom = torch._foreach_div(exp_avg_sqs, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(u, denom)
    if any(c.wds):
        torch._foreach_add_(u, torch._foreach_mul(work, c.wds))
    norms = _reduce(norm_reducer, _sq_norms(work, u)).sqrt()
    scale = _lamb_scale(norms, torch.tensor(c.trust, device=norms.device), lr)
    torch._foreach_mul_(u, list(scale.unbind()))
    torch._foreach_sub_(work, u)
    _copy_back(back)
    return norms


def _lars_torch(c, params, grads, bufs, lr, momentum, eta, norm_reducer, maximize):
    work, back = _work(params, c.masters)
    g = _fp32(grads, maximize)
    norms = _reduce(norm_reducer, _sq_norms(work, g)).sqrt()
    dev = norms.device
    scale = _lars_scale(norms, torch.tensor(c.trust, device=dev), torch.tensor(c.wds, device=dev), eta, lr)
    d = torch._foreach_mul(work, c.wds)
    torch._foreach_add_(d, g)
    torch._foreach_mul_(d, list(scale.unbind()))
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, d)
    torch._foreach_sub_(work, bufs)
    _copy_back(back)
    return norms


# --------------------------------------------------------------------------- Triton path

def _adamw_triton(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, maximize):
    plan = c.plan(params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, {})
    P, G, M, V, W = plan.ptrs.unbind(0)
    bc1, bc2 = c.bc
    for key, n_prog, prog_t, prog_start, _ in plan.groups:
        _launch(_adamw_kernel, n_prog, P, G, M, V, W, plan.numels, prog_t, prog_start,
                1.0 - beta1, beta2, 1.0 - beta2, eps, 1.0 - lr * weight_decay, lr / bc1, math.sqrt(bc2),
                MAXIMIZE=bool(maximize), **plan.tile, **_meta(key))


def _lamb_triton(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, norm_reducer, maximize):
    plan = c.plan(params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs},
                  {"wd": c.wds, "trust": c.trust})
    P, G, M, V, W = plan.ptrs.unbind(0)
    wd_t, (bc1, bc2) = plan.tables["wd"], c.bc
    partial = torch.empty(2, plan.n_slots, dtype=torch.float32, device=params[0].device)
    for key, n_prog, prog_t, prog_start, prog_slot in plan.groups:
        _launch(_lamb_phase1_kernel, n_prog, P, G, M, V, W, plan.numels, wd_t, prog_t, prog_start, prog_slot,
                partial, plan.n_slots, 1.0 - beta1, beta2, 1.0 - beta2, eps, bc1, bc2,
                MAXIMIZE=bool(maximize), **plan.tile, **_meta(key))
    norms = _reduce(norm_reducer, _segment_sums(plan, partial)).sqrt()
    scale = _lamb_scale(norms, plan.tables["trust"] > 0, lr).contiguous()
    for key, n_prog, prog_t, prog_start, _ in plan.groups:
        meta = _meta(key)
        del meta["G_DTYPE"]
        _launch(_lamb_phase2_kernel, n_prog, P, M, V, W, plan.numels, wd_t, scale, prog_t, prog_start,
                eps, bc1, bc2, **plan.tile, **meta)
    return norms


def _lars_triton(c, params, grads, bufs, lr, momentum, eta, norm_reducer, maximize):
    plan = c.plan(params, grads, {"momentum_buffers": bufs}, {"wd": c.wds, "trust": c.trust})
    P, G, B, W = plan.ptrs.unbind(0)
    wd_t = plan.tables["wd"]
    partial = torch.empty(2, plan.n_slots, dtype=torch.float32, device=params[0].device)
    for (p_dtype, g_dtype, has_master), n_prog, prog_t, prog_start, prog_slot in plan.groups:
        _launch(_sumsq_kernel, n_prog, W if has_master else P, G, plan.numels, prog_t, prog_start, prog_slot,
                partial, plan.n_slots, A_DTYPE=tl.float32 if has_master else _TL[p_dtype],
                B_DTYPE=_TL[g_dtype], HAS_B=True, **plan.tile)
    norms = _reduce(norm_reducer, _segment_sums(plan, partial)).sqrt()
    scale = _lars_scale(norms, plan.tables["trust"] > 0, wd_t, eta, lr).contiguous()
    for key, n_prog, prog_t, prog_start, _ in plan.groups:
        _launch(_lars_phase2_kernel, n_prog, P, G, B, W, plan.numels, wd_t, scale, prog_t, prog_start,
                momentum, MAXIMIZE=bool(maximize), **plan.tile, **_meta(key))
    return norms


# --------------------------------------------------------------------------- public functions

@torch.no_grad()
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int, master_params=None, maximize: bool = False,
               backend: Optional[str] = None) -> None:
    """One AdamW step over lists of tensors, in place, exactly as ``torch.optim.AdamW``.

    ``p *= 1 - lr*wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with ``bc_i = 1 - b_i**step``;
    ``step`` is the new step count (>= 1). ``exp_avgs``/``exp_avg_sqs`` are fp32.
    ``master_params`` (fp32, entries may be None) receive the update and the
    model param gets ``master.to(param.dtype)``; grads may be fp16/bf16.
    """
    c = _Call("adamw_step", params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, master_params,
              step=step, betas=(beta1, beta2))
    impl = {None: None, "torch": _adamw_torch, "triton": _adamw_triton}[c.resolve(params, grads, backend)]
    if impl is not None:
        impl(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, maximize)


@torch.no_grad()
def lamb_step(params, grads, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
              eps: float = 1e-6, weight_decay: Floats = 0.01, step: int, trust_ratio: Bools = True,
              master_params=None, norm_reducer: NormReducer = None, maximize: bool = False,
              backend: Optional[str] = None) -> torch.Tensor:
    """One LAMB step over lists of tensors, in place; returns the ``(2, n)`` fp32 norms.

    Adam moments with bias correction, ``u = m_hat / (sqrt(v_hat) + eps) + wd*w``,
    ``r = ||w|| / ||u||`` (1 where either norm is 0 or ``trust_ratio`` is off for
    the tensor), ``w -= lr * r * u``. ``weight_decay`` and ``trust_ratio`` are one
    value or one per tensor (biases and norms usually take 0 / False).
    ``norm_reducer`` receives the ``(2, n)`` fp32 *squared* norms (row 0 ``w``,
    row 1 ``u``) and returns the reduced tensor (or None after reducing in
    place). The result holds the reduced norms ``||w||, ||u||``.
    """
    c = _Call("lamb_step", params, grads, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, master_params,
              step=step, betas=(beta1, beta2), weight_decay=weight_decay, trust_ratio=trust_ratio)
    impl = {None: None, "torch": _lamb_torch, "triton": _lamb_triton}[c.resolve(params, grads, backend)]
    if impl is None:
        return torch.zeros(2, 0)
    return impl(c, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, norm_reducer, maximize)


@torch.no_grad()
def lars_step(params, grads, momentum_buffers, *, lr: float, momentum: float = 0.9, eta: float = 1e-3,
              weight_decay: Floats = 0.0, trust_ratio: Bools = True, master_params=None,
              norm_reducer: NormReducer = None, maximize: bool = False,
              backend: Optional[str] = None) -> torch.Tensor:
    """One LARS step (momentum SGD with a layer-wise trust ratio), in place; returns ``(2, n)`` norms.

    ``r = eta * ||w|| / (||g|| + wd * ||w||)`` (1 where either norm is 0 or
    ``trust_ratio`` is off for the tensor), ``buf = momentum * buf + lr * r *
    (g + wd * w)``, ``w -= buf``. A tensor opted out (``trust_ratio`` False and
    ``weight_decay`` 0) takes a plain momentum-SGD step. ``norm_reducer`` sees
    the ``(2, n)`` fp32 squared norms (row 0 ``w``, row 1 ``g``); the result
    holds the reduced norms ``||w||, ||g||``. Momentum buffers are fp32.
    """
    c = _Call("lars_step", params, grads, {"momentum_buffers": momentum_buffers}, master_params,
              weight_decay=weight_decay, trust_ratio=trust_ratio)
    impl = {None: None, "torch": _lars_torch, "triton": _lars_triton}[c.resolve(params, grads, backend)]
    if impl is None:
        return torch.zeros(2, 0)
    return impl(c, params, grads, momentum_buffers, lr, momentum, eta, norm_reducer, maximize)


def adamw_step_ref(*args, **kwargs) -> None:
    """The plain-torch (``torch._foreach_*``) path: :func:`adamw_step` with ``backend="torch"``."""
    return adamw_step(*args, **kwargs, backend="torch")


def lamb_step_ref(*args, **kwargs) -> torch.Tensor:
    """:func:`lamb_step` with ``backend="torch"``."""
    return lamb_step(*args, **kwargs, backend="torch")


def lars_step_ref(*args, **kwargs) -> torch.Tensor:
    """:func:`lars_step` with ``backend="torch"``."""
    return lars_step(*args, **kwargs, backend="torch")


@torch.no_grad()
def grad_norm_sq(tensors, *, per_tensor: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """Sum of squares (fp32) over a list of tensors: a scalar, or ``(n,)`` with ``per_tensor``.

    The multi-tensor building block for gradient clipping (``None`` entries are skipped).
    """
    tensors = [t for t in tensors if t is not None]
    for i, t in enumerate(tensors):
        check_floating("grad_norm_sq", f"tensors[{i}]", t)
    if not tensors:
        out = torch.zeros(0)
    elif resolve_backend("grad_norm_sq", tensors, backend) == "torch":
        out = _sq_norms(tensors)[0]
    else:
        tensors = [t.contiguous() for t in tensors]
        plan = _plan([tensors], [t.dtype for t in tensors], {})
        partial = torch.empty(1, plan.n_slots, dtype=torch.float32, device=tensors[0].device)
        (A,) = plan.ptrs.unbind(0)
        for dtype, n_prog, prog_t, prog_start, prog_slot in plan.groups:
            _launch(_sumsq_kernel, n_prog, A, A, plan.numels, prog_t, prog_start, prog_slot, partial,
                    plan.n_slots, A_DTYPE=_TL[dtype], B_DTYPE=_TL[dtype], HAS_B=False, **plan.tile)
        out = _segment_sums(plan, partial)[0]
    return out if per_tensor else out.sum()
