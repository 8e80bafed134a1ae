"""Scaled dot-product attention: FlashAttention-2 Triton kernels, their launchers and the public entry point
(the argument checks and the plain-torch path live in :mod:`.attention_torch`).

Layout is (batch, heads, seq, head_dim) throughout: ``q`` is (B, H, Sq, D) and
``k``/``v`` are (B, Hkv, Sk, D); Sq may differ from Sk. Grouped-query attention
(Ainslie et al. 2023, arXiv 2305.13245): H must be a multiple of Hkv, and query
head ``h`` reads K/V head ``h // (H // Hkv)`` (Hkv == H is multi-head, Hkv == 1
multi-query). K/V are never repeated in memory: the kernels index the shared
head, and dK/dV come back (B, Hkv, Sk, D), summed over each group's heads.
``causal`` is aligned to the *end* as in flash-attention: query ``i`` attends
key ``j`` iff ``j <= i + Sk - Sq``. ``key_padding_mask`` is (B, Sk) bool,
True = keep.

Besides the output, the kernels return the log-sum-exp of each query row,
``lse[b, h, i] = log(sum_j exp(scale * q_i . k_j))`` over kept keys (natural
log, fp32), so that partial results over key blocks can be merged exactly (ring
attention does this), and gradients flow through ``lse`` as well as ``out``.
A row with no kept key gives ``out = 0``, ``lse = -inf`` and zero gradients.

Attention sinks (gpt-oss): ``sinks`` (H,) gives each query head one more
logit in every row's denominator that carries no value. The forward kernel
folds it into the row's running max and sum once, after the key loop, so
``out`` and ``lse`` include it; the backward needs nothing new for q, k, v
(P comes from that lse, and the sink's column has dP = 0), and the sink's
gradient is ``-sum_rows exp(sink - lse) * delta`` (delta = rowsum(dO * O) -
dlse), each row's term written by the preprocess kernel and summed by one
torch reduction. Blocks that are merged by lse (ring attention) run without
sinks; the merge adds the sink once (parallel/sequence.py).

``v`` may have a head dim Dv of its own (DeepSeek-V3's latent attention:
q/k 192, v 128): the kernels tile it by ``BLOCK_DV`` beside q/k's
``BLOCK_D``, so v is never padded to q's head dim; out and dV are Dv wide.

Packed rows (several documents one after another in a row, Hugging Face's
``position_ids`` restarting at 0): ``doc_ids`` (B, Sq) and ``doc_ids_k``
(B, Sk) give each token's document, non-decreasing along a row, and a query
sees only keys of its own document. Key and query ids are separate so that
ring attention's chunks carry their own. Because the ids are sorted, the keys
a query sees form one run, found by binary search on the device
(:func:`doc_ranges`, which folds the causal rule in too): the kernels mask by
these per-row ranges, and the forward and dQ kernels loop only over the keys
from a query tile's first row's range to its last row's (the dK/dV kernel over
the mirror range of queries per key tile), so a packed row costs the sum of its
documents' squares, not the row's.

Sliding windows (Mistral, Qwen2, Gemma 3's local layers): ``window`` W drops
the keys more than W - 1 before a query's end-aligned diagonal, a left bound
per query ``j >= i + WIN_LO`` (:func:`~.attention_torch.check_window`;
``window_shift`` moves it for ring attention's chunk pairs). The kernels take
it as a runtime int under the constexpr ``HAS_WINDOW`` (off when the window
drops nothing, so those launches are the plain ones; with document ids the
bound folds into the rows' ranges instead, :func:`doc_ranges`): the forward and dQ
kernels start their key loop at the tile of the first row's bound, the dK/dV
kernel ends its query loop at the last key's, so a causal row costs its
window, not its length (bench/attention_window.py). Inside a packed document
index differences are position differences, so windows and document ids
combine by masking alone.

Kernels follow FlashAttention-2 (Dao 2023, arXiv 2307.08691): the forward
(:mod:`.flash_attention_fwd`) runs an online softmax over key blocks, one
program per (query block, batch*head), never materializing the (Sq x Sk)
matrix; the backward (:mod:`.flash_attention_bwd`) recomputes P from the saved
lse and is split into a dK/dV kernel (parallel over key blocks) and a dQ
kernel (parallel over query blocks), each with its own tile, so it needs no
atomics and is deterministic. Under GQA a dK/dV program owns a key block of
one K/V head and loops over the query heads of its group, summing into the
same fp32 tiles. Tiles are loaded in the input dtype, and every dot product
and softmax statistic is accumulated in fp32. This module holds the tile
tables, the launchers and the public entry points.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import triton
from torch.library import custom_op, register_autograd, register_fake

from ._backend import dot_options, interpreter_active, picked, resolve_backend
from .library import empty_output, or_none
from .attention_torch import (  # noqa: F401 (re-exported)
    attention_ref, check_docs, check_sinks, check_window, doc_ids_from_positions, sdpa_attention, validate)
from .flash_attention_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .flash_attention_fwd import attn_fwd_kernel

_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * LOG2E)
_LN2 = 0.6931471805599453  # ln(2)
_OP = "attention"
Tensor = torch.Tensor


# ----------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------


# GPU tiles, (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages), by element size and padded head dim
# (BLOCK_D <= limit), one table per kernel. Entry 0 of each list is what the launcher uses; the others are the
# row's GPU autotune list (bench/gpu.py --part tune times them all, see AUTOTUNE). Every entry compiles for sm_80
# and sm_90 within shared memory, and in half precision with tensor cores and without register spills, for
# every flag combination the launchers make, at sequence lengths that are and are not multiples of 16
# (tests/kernels/test_compile_gate.py; fp32, whose "ieee" dots run on FMA units, may spill a few bytes).
# The backward's two passes take their own tiles: the dK/dV kernel owns BLOCK_N keys (its fp32 dK and dV
# accumulators, 2 x BLOCK_N x BLOCK_D) and steps over BLOCK_M queries; the dQ kernel owns BLOCK_M queries (one
# accumulator) and steps over BLOCK_N keys. A thin step keeps the (BLOCK_N x BLOCK_M) score tile small beside the
# accumulators, and the dK/dV key tile shrinks as the head dim grows so that the two accumulators stay in
# registers. The entries' timings: bench/RESULTS.md ("GPU kernels").
_GPU_FWD = {
    2: ((64, ((64, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4))),
        (128, ((128, 64, 8, 3), (64, 64, 8, 3), (128, 32, 8, 3))),
        (256, ((64, 32, 8, 2), (64, 32, 8, 1), (32, 64, 4, 2)))),
    4: ((32, ((64, 32, 8, 2),)), (64, ((64, 32, 8, 2),)), (128, ((32, 32, 8, 1),)), (256, ((32, 32, 8, 1),))),
}
_GPU_DKDV = {
    2: ((64, ((32, 128, 8, 2), (16, 128, 8, 2), (32, 64, 8, 2))),
        (128, ((32, 64, 8, 2), (16, 64, 4, 1))),
        (256, ((32, 32, 8, 1),))),
    4: ((32, ((32, 32, 8, 2),)), (64, ((32, 16, 4, 1),)), (128, ((32, 16, 4, 1),)), (256, ((32, 16, 8, 1),))),
}
_GPU_DQ = {
    2: ((64, ((128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2))),
        (128, ((128, 32, 8, 2), (64, 64, 8, 1), (64, 32, 4, 2))),
        (256, ((32, 32, 8, 1),))),
    4: ((32, ((32, 32, 8, 2),)), (64, ((32, 16, 4, 1),)), (128, ((32, 16, 4, 1),)), (256, ((32, 16, 8, 1),))),
}
_TABLES = {"fwd": _GPU_FWD, "dkdv": _GPU_DKDV, "dq": _GPU_DQ}
# With document ids (or a window's bound) the forward keeps each row's key range live as well: in half precision
# at d <= 128 the 128x64 tile spills on sm_80 then, so packed rows and windows take this row's other entries.
_GPU_FWD_DOCS = {(2, 128): ((64, 64, 8, 3), (128, 32, 8, 3))}
# op -> number of autotune entries (cuboid.kernels._backend.autotune_pick("attention", i))
AUTOTUNE = {"attention": max(len(c) for t in _TABLES.values() for rows in t.values() for _, c in rows)}


def _config(head_dim: int, dtype: torch.dtype, kernel: str = "fwd", docs: bool = False,
            head_dim_v: Optional[int] = None) -> dict:
    """Block sizes and launch options of one kernel, ``"fwd"``, ``"dkdv"`` or ``"dq"``: a table, entry
    :func:`~._backend.picked` of the row (``docs``: the forward keeps per-row key bounds, document ids or a
    window's). ``head_dim_v``: v's head dim where it differs (BLOCK_DV; the row is the larger padded dim's);
    the kernels take v's own offsets and bounds only then (``SPLIT_DV``: one more live mask spills registers
    in the d64 half-precision tiles on sm_80).

    The interpreter runs programs one after another in numpy and pays per op,
    so it wants few, mid-sized blocks (BLOCK_M != BLOCK_N there also keeps the
    causal loop bounds honest in the CPU tests). On GPU the tiles come from
    ``_GPU_FWD`` / ``_GPU_DKDV`` / ``_GPU_DQ``: they shrink as the head dim
    and element size grow, to stay within shared memory and registers.
    """
    if kernel not in _TABLES:
        raise ValueError(f"{_OP}: kernel must be one of {sorted(_TABLES)}, got {kernel!r}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = block_d if head_dim_v is None else max(16, triton.next_power_of_2(head_dim_v))
    split = head_dim_v is not None and head_dim_v != head_dim  # SPLIT_DV: v's own offsets and mask
    if interpreter_active():
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_D=block_d, BLOCK_DV=block_dv, SPLIT_DV=split, num_warps=4,
                    num_stages=1)
    size = 4 if dtype == torch.float32 else 2
    limit, candidates = next((limit, c) for limit, c in _TABLES[kernel][size] if max(block_d, block_dv) <= limit)
    if docs and kernel == "fwd":
        candidates = _GPU_FWD_DOCS.get((size, limit), candidates)
    bm, bn, warps, stages = picked(_OP, candidates)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv, SPLIT_DV=split, num_warps=warps,
                num_stages=stages)


def tile_summary(head_dim: int, dtype: torch.dtype) -> str:
    """The tiles the launchers pick for ``head_dim`` and ``dtype`` under the current autotune pick, one line
    (bench/gpu.py's tune table): forward, dK/dV and dQ as BLOCK_M x BLOCK_N, warps, stages."""
    parts = []
    for kernel in ("fwd", "dkdv", "dq"):
        c = _config(head_dim, dtype, kernel)
        parts.append(f"{kernel} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}")
    return ", ".join(parts)


GRID_X_MAX = 2 ** 31 - 1  # CUDA's limit on grid x (y and z stop at 65535)


def _grid(seq: int, block: int, heads: int) -> tuple:
    """The flat grid of :func:`tile_ids`: ``cdiv(seq, block) * heads`` programs on grid x.

    ``heads`` is B * H (or B * Hkv). The count stays far below 2^31 for any
    tensors that fit a GPU (a program covers at least 16 rows of 16 or more
    elements: 141 GB of bf16 make 2.7e8 programs); a larger one is refused
    here rather than failing to launch.
    """
    n = triton.cdiv(seq, block) * heads
    if n > GRID_X_MAX:
        raise ValueError(f"{_OP}: {n} programs (batch*heads={heads}, seq={seq}, block={block}) exceed CUDA's "
                         f"grid limit {GRID_X_MAX}")
    return (n,)


def _mask_args(mask: Optional[torch.Tensor], fallback: torch.Tensor) -> tuple:
    if mask is None:
        return fallback, 0, 0
    return mask, mask.stride(0), mask.stride(1)


def doc_ranges(doc_q: torch.Tensor, doc_k: torch.Tensor, causal: bool, win_lo: Optional[int] = None) -> tuple:
    """Per-token ranges for the kernels: ((key_lo, key_hi) (B, Sq), (query_lo, query_hi) (B, Sk)), int32.

    Query ``i`` sees keys ``[key_lo[i], key_hi[i])`` (the keys of its document,
    end-aligned causal included) and key ``j`` is seen by queries
    ``[query_lo[j], query_hi[j])``; an empty range (lo >= hi) sees nothing.
    ``doc_q`` (B, Sq) and ``doc_k`` (B, Sk) are int32 contiguous ids,
    non-decreasing along each row: one document's keys are then one run,
    found by binary search, and every bound is non-decreasing along the row,
    which lets a tile take its loop from its first and last rows. Torch ops on
    the ids' device, no host sync, so the launch can be traced. A window's
    bound (``win_lo``: query i keeps keys j >= i + win_lo) folds in the same
    way, the bounds staying non-decreasing, so packed rows with a window are
    the documents' kernels with narrower ranges (no HAS_WINDOW variant).
    """
    Sq, Sk = doc_q.shape[1], doc_k.shape[1]
    key_lo = torch.searchsorted(doc_k, doc_q, out_int32=True)
    key_hi = torch.searchsorted(doc_k, doc_q, right=True, out_int32=True)
    query_lo = torch.searchsorted(doc_q, doc_k, out_int32=True)
    query_hi = torch.searchsorted(doc_q, doc_k, right=True, out_int32=True)
    if causal:  # query i sees key j iff j <= i + Sk - Sq
        i = torch.arange(Sq, dtype=torch.int32, device=doc_q.device)
        j = torch.arange(Sk, dtype=torch.int32, device=doc_q.device)
        key_hi = torch.minimum(key_hi, i + (Sk - Sq + 1))
        query_lo = torch.maximum(query_lo, j - (Sk - Sq))
    if win_lo is not None:
        i = torch.arange(Sq, dtype=torch.int32, device=doc_q.device)
        j = torch.arange(Sk, dtype=torch.int32, device=doc_q.device)
        key_lo = torch.maximum(key_lo, i + win_lo)
        query_hi = torch.minimum(query_hi, j - win_lo + 1)
    return (key_lo, key_hi), (query_lo, query_hi)


def _flash_fwd(q, k, v, mask_u8, causal: bool, scale: float, docs: Optional[tuple] = None,
               win_lo: Optional[int] = None, sinks: Optional[torch.Tensor] = None):
    """(out, lse) of q (B, H, Sq, D) over k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv), H % Hkv == 0 (checked by the
    caller); out is (B, H, Sq, Dv).

    ``docs``: None, or (doc_q (B, Sq), doc_k (B, Sk)) int32 contiguous document ids (:func:`kernel_doc_ids`).
    ``win_lo``: None, or the window's bound (:func:`~.attention_torch.check_window`): query i keeps keys
    ``j >= i + win_lo``. ``sinks``: None or (H,) sink logits; the lse then includes them.
    """
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((B, H, Sq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    dv_kw = {} if Dv == D else dict(head_dim_v=Dv)
    cfg = _config(D, q.dtype, "fwd", docs=docs is not None or win_lo is not None, **dv_kw)
    sinks_arg = lse if sinks is None else sinks.to(torch.float32).contiguous()
    m_ptr, smb, smn = _mask_args(mask_u8, q)
    keys = (q, q) if docs is None else doc_ranges(*docs, causal, win_lo)[0]
    win_lo = None if docs is not None else win_lo  # with documents the ranges hold the window
    attn_fwd_kernel[_grid(Sq, cfg["BLOCK_M"], B * H)](
        q, k, v, out, lse, sinks_arg, m_ptr, *keys,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), smb, smn,
        H, H // Hkv, Sq, Sk, D, Dv, scale * _LOG2E, 0 if win_lo is None else win_lo,
        IS_CAUSAL=causal, HAS_MASK=mask_u8 is not None, HAS_DOCS=docs is not None, HAS_WINDOW=win_lo is not None,
        HAS_SINKS=sinks is not None, **dot_options(q.dtype), **cfg,
    )
    return out, lse


def _flash_bwd(do, dlse, q, k, v, out, lse, mask_u8, causal: bool, scale: float, docs: Optional[tuple] = None,
               win_lo: Optional[int] = None, sinks: Optional[torch.Tensor] = None):
    """(dq, dk, dv, dsinks): dq like q, dk like k, dv like v, dk and dv summed over each group; dsinks (H,)
    fp32 summed over batch and rows, or None without sinks.

    ``docs``, ``win_lo`` and ``sinks`` as for :func:`_flash_fwd` (``lse`` is the forward's, sinks included).
    """
    B, H, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    keys, queries = ((q, q), (q, q)) if docs is None else doc_ranges(*docs, causal, win_lo)
    win_lo = None if docs is not None else win_lo  # with documents the ranges hold the window
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    has_dlse = dlse is not None
    dlse_arg = dlse.to(torch.float32).contiguous() if has_dlse else delta
    block_dv = max(16, triton.next_power_of_2(Dv))
    pre_m = 64 if block_dv <= 128 else 32
    dsink_rows = None if sinks is None else torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    sinks_arg = delta if sinks is None else sinks.to(torch.float32).contiguous()
    attn_bwd_preprocess_kernel[_grid(Sq, pre_m, B * H)](
        out, do, dlse_arg, delta, lse, sinks_arg, delta if dsink_rows is None else dsink_rows,
        *out.stride(), *do.stride(), H, Sq, Dv,
        HAS_DLSE=has_dlse, HAS_SINKS=sinks is not None, BLOCK_M=pre_m, BLOCK_D=block_dv, num_warps=4,
    )
    dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Sk, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Sk, Dv), dtype=v.dtype, device=q.device)
    m_ptr, smb, smn = _mask_args(mask_u8, q)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), smb, smn,
              H, H // Hkv, Sq, Sk, D, Dv, scale, scale * _LOG2E, 0 if win_lo is None else win_lo)
    flags = dict(IS_CAUSAL=causal, HAS_MASK=mask_u8 is not None, HAS_DOCS=docs is not None,
                 HAS_WINDOW=win_lo is not None, **dot_options(q.dtype))
    dv_kw = {} if Dv == D else dict(head_dim_v=Dv)
    cfg = _config(D, q.dtype, "dkdv", **dv_kw)
    attn_bwd_dkdv_kernel[_grid(Sk, cfg["BLOCK_N"], B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, m_ptr, *queries, *common, **flags, **cfg)
    cfg = _config(D, q.dtype, "dq", **dv_kw)
    attn_bwd_dq_kernel[_grid(Sq, cfg["BLOCK_M"], B * H)](
        q, k, v, do, lse, delta, dq, m_ptr, *keys, *common, **flags, **cfg)
    dsinks = None if dsink_rows is None else dsink_rows.sum(dim=(0, 2))  # deterministic: no atomics
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------------
# The custom ops cuboid::flash_attention and cuboid::flash_attention_backward (kernels/library.py says how)
# ----------------------------------------------------------------------------


@custom_op("cuboid::flash_attention", mutates_args=())
def _flash(q: Tensor, k: Tensor, v: Tensor, mask_u8: Optional[Tensor], doc_q: Optional[Tensor],
           doc_k: Optional[Tensor], causal: bool, scale: float, win_lo: Optional[int],
           sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out (B, H, Sq, Dv), lse (B, H, Sq) fp32, sinks included) of the Triton forward."""
    docs = None if doc_q is None else (doc_q, doc_k)
    if sinks is None:  # the window's bound stays the last argument: tests/kernels/test_attention_window.py spies it
        return _flash_fwd(q, k, v, mask_u8, causal, scale, docs, win_lo)
    return _flash_fwd(q, k, v, mask_u8, causal, scale, docs, win_lo, sinks)


@register_fake("cuboid::flash_attention")
def _flash_fake(q, k, v, mask_u8, doc_q, doc_k, causal, scale, win_lo, sinks=None):
    B, H, Sq, _ = q.shape
    return q.new_empty((B, H, Sq, v.shape[3])), q.new_empty((B, H, Sq), dtype=torch.float32)


@custom_op("cuboid::flash_attention_backward", mutates_args=())
def _flash_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    mask_u8: Optional[Tensor], doc_q: Optional[Tensor], doc_k: Optional[Tensor], causal: bool,
                    scale: float, win_lo: Optional[int],
                    sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dsinks) of the Triton backward kernels; dk, dv summed over each group of query heads;
    dsinks (H,) in sinks' dtype, or :func:`~.library.empty_output` without sinks."""
    docs = None if doc_q is None else (doc_q, doc_k)
    dq, dk, dv, dsinks = _flash_bwd(dout, dlse, q, k, v, out, lse, mask_u8, causal, scale, docs, win_lo, sinks)
    return dq, dk, dv, empty_output(q, torch.float32) if dsinks is None else dsinks.to(sinks.dtype)


@register_fake("cuboid::flash_attention_backward")
def _flash_backward_fake(dout, dlse, q, k, v, out, lse, mask_u8, doc_q, doc_k, causal, scale, win_lo, sinks=None):
    dsinks = q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks


def _flash_setup(ctx, inputs, output):
    q, k, v, mask_u8, doc_q, doc_k, causal, scale, win_lo, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask_u8, doc_q, doc_k, sinks)
    ctx.causal, ctx.scale, ctx.win_lo = causal, scale, win_lo
    ctx.set_materialize_grads(False)


def _flash_grad(ctx, dout, dlse):
    q, k, v, out, lse, mask_u8, doc_q, doc_k, sinks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
    dq, dk, dv, dsinks = _flash_backward(dout, dlse, q, k, v, out, lse, mask_u8, doc_q, doc_k, ctx.causal,
                                         ctx.scale, ctx.win_lo, sinks)
    return dq, dk, dv, None, None, None, None, None, None, or_none(dsinks)


register_autograd("cuboid::flash_attention", _flash_grad, setup_context=_flash_setup)


# ----------------------------------------------------------------------------
# The public entry points (autograd through the custom ops above)
# ----------------------------------------------------------------------------


def kernel_doc_ids(doc_ids: torch.Tensor, doc_ids_k: Optional[torch.Tensor] = None) -> tuple:
    """(doc_q, doc_k) as the Triton launchers take them: int32, contiguous; doc_k defaults to doc_q."""
    doc_q = doc_ids.to(torch.int32).contiguous()
    doc_k = doc_q if doc_ids_k is None else doc_ids_k.to(torch.int32).contiguous()
    return doc_q, doc_k


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, causal: bool, scale: float,
                       key_padding_mask: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
                       doc_ids_k: Optional[torch.Tensor] = None, window: Optional[int] = None,
                       window_shift: int = 0) -> tuple:
    """(dq, dk, dv) of one block of attention by the Triton backward kernels, from an ``out`` and ``lse``.

    For ring attention, which merges blocks by lse: with the *merged* out and
    lse of the query rows, each key block's call gives that block's share of
    the gradients (dk, dv (B, Hkv, Sk, D) summed over each group). Arguments
    as in :func:`attention`; ``scale`` is the one the forward used.
    """
    mask_u8 = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
    docs = None
    if check_docs(q, k, doc_ids, doc_ids_k) is not None:
        docs = kernel_doc_ids(doc_ids, doc_ids_k)
    win_lo = check_window(window, window_shift, q, k)
    return _flash_backward(dout.contiguous(), None, q, k, v, out, lse.contiguous(), mask_u8, *(docs or (None, None)),
                           causal, float(scale), win_lo)[:3]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              key_padding_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
              return_lse: bool = False, doc_ids: Optional[torch.Tensor] = None,
              doc_ids_k: Optional[torch.Tensor] = None, window: Optional[int] = None, window_shift: int = 0,
              sinks: Optional[torch.Tensor] = None, backend: Optional[str] = None):
    """Softmax attention ``softmax(scale * q @ k^T) @ v`` over (B, H, S, D) tensors.

    Args:
        q: (B, H, Sq, D); k, v: (B, Hkv, Sk, D) with H a multiple of Hkv
            (grouped-query; Hkv == 1 is multi-query); one float dtype
            (fp32/fp16/bf16), one device, any strides.
        causal: query ``i`` sees keys ``j <= i + Sk - Sq`` (end-aligned).
        key_padding_mask: (B, Sk) bool, True = keep that key.
        scale: softmax scale, default ``1 / sqrt(D)``.
        return_lse: also return the (B, H, Sq) fp32 natural-log log-sum-exp.
        doc_ids: (B, Sq) integer document id of each query token, non-decreasing
            along each row (packed rows: :func:`doc_ids_from_positions`). A
            query sees only keys of its own document (and, with ``causal``,
            only those the causal rule allows); the Triton kernels skip the
            tiles no document spans, so a row costs the sum of its documents'
            squares. Without ``doc_ids_k`` the keys carry the same ids (Sq == Sk).
        doc_ids_k: (B, Sk) the keys' document ids where they are another
            slice of the sequence than the queries (ring attention's K/V
            chunks); same numbering, non-decreasing.
        window: sliding-window attention (Mistral, Qwen2, Gemma 3): query
            ``i`` sees only keys ``j > i + Sk - Sq - window`` (with ``causal``,
            the ``window`` keys ending at its own), transformers' rule. Index
            differences inside one packed document are its position
            differences, so packed rows need nothing more. The Triton kernels
            skip the tiles wholly left of the band: a row costs its window.
        window_shift: the queries sit this many positions further right of
            the keys than end alignment says (ring attention's chunk pairs);
            0 otherwise.
        sinks: None or (H,) float, gpt-oss's attention sinks: one learned
            logit per query head that joins every row's softmax denominator
            and adds no value, ``out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij}
            + e^{sinks[h]})`` over the kept keys (window, mask and documents
            do not touch it; a row with no kept key gives 0). Computed in
            fp32; its gradient (H,) is summed over batch and rows. With
            ``return_lse`` the lse includes the sink (``logaddexp(lse over
            the keys, sink)``); to merge blocks by lse, as ring attention
            does, compute the blocks without sinks and add the sink once
            to the merged lse.
        backend: ``"triton"``, ``"torch"`` or None for the automatic rule
            (:func:`cuboid.kernels.resolve_backend`).

    ``v`` may have its own head dim Dv (DeepSeek-V3's latent attention: 192
    for q/k, 128 for v); ``out`` is then (B, H, Sq, Dv).

    Returns ``out`` (B, H, Sq, Dv) in q's dtype, or ``(out, lse)``. Rows with no
    kept key (padding, no key of their document) give ``out = 0`` and
    ``lse = -inf``, with zero gradients, so blocks merge exactly by lse. The
    gradients of k and v are (B, Hkv, Sk, D), summed over each group's heads.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    tensors: Sequence[torch.Tensor] = [q, k, v] + [t for t in (key_padding_mask, doc_ids, doc_ids_k, sinks)
                                                   if isinstance(t, torch.Tensor)]
    chosen = resolve_backend(_OP, tensors, backend)
    win_lo = check_window(window, window_shift, q, k)
    sinks = check_sinks(sinks, q)
    if chosen == "torch":
        if not return_lse and sinks is None:  # SDPA has no sink: those go to the reference
            checked = validate(q, k, v, causal, key_padding_mask, scale, triton_path=False)
            fast = sdpa_attention(q, k, v, causal, key_padding_mask, checked, check_docs(q, k, doc_ids, doc_ids_k),
                                  win_lo)
            if fast is not None:
                return fast
        return attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                             return_lse=return_lse, doc_ids=doc_ids, doc_ids_k=doc_ids_k,
                             window=None if win_lo is None else window, window_shift=window_shift, sinks=sinks)
    scale = validate(q, k, v, causal, key_padding_mask, scale, triton_path=True)
    mask_u8 = None if key_padding_mask is None else key_padding_mask.view(torch.uint8)
    doc_q = doc_k = None
    if check_docs(q, k, doc_ids, doc_ids_k) is not None:
        doc_q, doc_k = kernel_doc_ids(doc_ids, doc_ids_k)
    out, lse = _flash(q, k, v, mask_u8, doc_q, doc_k, causal, float(scale), win_lo, sinks)
    return (out, lse) if return_lse else out
