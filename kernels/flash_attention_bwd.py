"""The backward Triton kernels of :mod:`.flash_attention` (FlashAttention-2's split, Dao 2023, arXiv 2307.08691).

Three launches, no atomics, deterministic:

- ``attn_bwd_preprocess_kernel``: ``delta = rowsum(dO * O) - dlse`` per query row, and with sinks each row's
  share of the sink's gradient, ``-exp(sink - lse) * delta`` (the lse includes the sink, so P of the keys and
  of the sink come from it; the sink carries no value, so dP of its column is 0 and dS_sink = -P_sink delta).
- ``attn_bwd_dkdv_kernel``: one program per block of BLOCK_N keys of one K/V head; it keeps K, V and the fp32
  dK, dV tiles on chip and walks the query blocks (BLOCK_M rows each) that see its keys, over every query head of
  its group (grouped-query heads sum into the same tiles).
- ``attn_bwd_dq_kernel``: one program per block of BLOCK_M queries; it keeps Q, dO and the fp32 dQ tile and walks
  the key blocks (BLOCK_N each) its rows see.

The two passes take their own tiles (the launcher's ``_config(..., "dkdv")`` and ``"dq"``): each owns a tall
block (many keys, resp. queries, whose accumulators stay in registers) and steps over the other side in thin
blocks, as in the Triton fused-attention tutorial; one shared tile makes one of the two passes either small
(low reuse of the tile it keeps) or register-bound.

Each walk is split into the blocks that need per-element masks and the ones that do not: a block wholly under
the causal diagonal, right of the window's band, inside both sequences and without document ids needs no
comparison per score and no bounds on its loads (``MASKED=False``). The masked blocks (the diagonal band,
the window's edge, the sequences' last partial blocks, every block of a packed row) are visited by a second
loop whose block index skips the unmasked run, so each kernel holds two copies of the step, not three.
A key padding mask costs the dK/dV kernel nothing per step (a padded key's dK and dV rows depend on that key
alone: they are zeroed at the store); the dQ kernel loads it per key block in both loops.

Scores live in the log2 domain (``qk_scale = scale * log2(e)``, the saved lse times log2(e)); rows with no kept
key (lse = -inf) get P = 0 through an lse of +inf. Tiles are loaded in the input dtype, P and dS are rounded to
it for the dots, and every dot accumulates in fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .flash_attention_fwd import doc_span, key_loop_bounds, tile_ids


@triton.jit
def attn_bwd_preprocess_kernel(
    O,  # (B, H, Sq, Dv) forward output, any strides
    DO,  # (B, H, Sq, Dv) gradient of the output, any strides
    DLSE,  # (B, H, Sq) fp32 gradient of lse, contiguous; unused unless HAS_DLSE
    DELTA,  # (B, H, Sq) fp32 output, contiguous: rowsum(dO * O) - dlse
    LSE, SINKS, DSINK,  # (B, H, Sq) fp32 lse, (H,) fp32 sinks, (B, H, Sq) fp32 output; unused unless HAS_SINKS
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, SEQ_Q, HEAD_D,
    HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, pid_bh = tile_ids(SEQ_Q, BLOCK_M)
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < SEQ_Q
    mask = m_ok[:, None] & (offs_d < HEAD_D)[None, :]
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)  # fp32
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + pid_bh * SEQ_Q + offs_m, mask=m_ok, other=0.0)
    tl.store(DELTA + pid_bh * SEQ_Q + offs_m, delta, mask=m_ok)
    if HAS_SINKS:  # d lse / d sink = P_sink; d out / d sink = -P_sink out
        lse = tl.load(LSE + pid_bh * SEQ_Q + offs_m, mask=m_ok, other=float("-inf"))
        p_sink = tl.where(lse == float("-inf"), 0.0, tl.exp(tl.load(SINKS + off_h) - lse))
        tl.store(DSINK + pid_bh * SEQ_Q + offs_m, -p_sink * delta, mask=m_ok)


@triton.jit
def _full_run(n_blocks, first, last):
    """(t_lo, t_hi): the run of loop blocks ``t`` in [0, n_blocks) (block t starts at ``start + t * BLOCK``)
    that need no mask, given ``first`` = blocks before the first unmasked one and ``last`` = blocks up to and
    including the last unmasked one (both clamped here; t_lo <= t_hi)."""
    t_lo = tl.minimum(tl.maximum(first, 0), n_blocks)
    t_hi = tl.maximum(tl.minimum(tl.maximum(last, 0), n_blocks), t_lo)
    return t_lo, t_hi


@triton.jit
def _masked_start(t, start, t_lo, t_hi, BLOCK: tl.constexpr):
    """Start of the ``t``-th masked block: blocks [0, t_lo) of the loop, then those from t_hi on."""
    return start + (t + tl.where(t < t_lo, 0, t_hi - t_lo)) * BLOCK


@triton.jit
def _dkdv_step(dk, dv, k, v, lo_n, hi_n, q_base, do_base, lse_base, delta_base, start_m, offs_m0, offs_n,
               offs_d, d_ok, offs_dv, dv_ok, stride_qm, stride_qd, stride_dom, stride_dod, SEQ_Q, SEQ_K, WIN_LO,
               qk_scale, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dK, dV += this program's keys' share of one block of BLOCK_M queries (rows start_m..).

    Padded keys are not masked here: a key's dK and dV rows depend on that key alone, so the kernel zeroes the
    padded keys' rows once at the store instead of masking every score tile."""
    offs_m = start_m + offs_m0
    if MASKED:
        m_ok = offs_m < SEQ_Q
        io = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=io, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
        delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
    else:  # every row in range: bounds on the head dim only
        io = (offs_m0 >= 0)[:, None] & d_ok[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=io, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=(offs_m0 >= 0)[:, None] & dv_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m)
        delta = tl.load(delta_base + offs_m)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # empty rows: P = 0
    st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M) = S^T, log2 domain
    pt = tl.exp2(st - lse[None, :])  # P^T, fp32
    if MASKED:  # rows past Sq need no mask: their lse is +inf, so P = 0
        if HAS_DOCS:  # the key's range holds the causal rule and the window too
            pt = tl.where((offs_m[None, :] >= lo_n[:, None]) & (offs_m[None, :] < hi_n[:, None]), pt, 0.0)
        elif IS_CAUSAL:
            pt = tl.where(offs_n[:, None] <= offs_m[None, :] + (SEQ_K - SEQ_Q), pt, 0.0)
        if HAS_WINDOW:
            pt = tl.where(offs_n[:, None] >= offs_m[None, :] + WIN_LO, pt, 0.0)
    dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = dP^T
    dst = pt * (dpt - delta[None, :])  # dS^T, w.r.t. the scaled scores
    dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _query_walk(RANGE_LO, RANGE_HI, off_b, start_n, offs_n, n_ok, SEQ_Q, SEQ_K, WIN_LO, IS_CAUSAL: tl.constexpr,
                HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(lo, n_blocks, t_lo, t_hi, lo_n, hi_n) of the dK/dV program whose first key is ``start_n``: its query
    blocks start at ``lo + t * BLOCK_M`` for t in [0, n_blocks); those in [t_lo, t_hi) need no mask. With
    documents, each key's query range [lo_n, hi_n) (else placeholders) and every block is masked.

    The mirror of the forward's key loop: causal skips the query blocks wholly before the keys' diagonal,
    documents visit the queries from the first key's range start to the last key's end, a window stops at
    the last query that sees the last key.
    """
    lo = 0
    hi = SEQ_Q
    lo_n = offs_n
    hi_n = offs_n
    if HAS_DOCS:
        lo, hi, lo_n, hi_n = doc_span(RANGE_LO, RANGE_HI, off_b, start_n, offs_n, n_ok, SEQ_K, BLOCK_N, BLOCK_M)
    elif IS_CAUSAL:
        lo = (tl.maximum(start_n - (SEQ_K - SEQ_Q), 0) // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:  # key j is seen by queries i <= j - WIN_LO
        hi = tl.minimum(hi, tl.minimum(start_n + BLOCK_N, SEQ_K) - WIN_LO)
    n_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    if HAS_DOCS:
        t_lo, t_hi = _full_run(n_blocks, n_blocks, n_blocks)
    else:
        first = 0
        if IS_CAUSAL:  # a block is under the diagonal once start_m + Sk - Sq >= the program's last key
            first = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - (SEQ_K - SEQ_Q) - lo, 0), BLOCK_M)
        last = tl.maximum(SEQ_Q - lo, 0) // BLOCK_M  # blocks wholly inside the queries
        if HAS_WINDOW:  # ... and wholly left of the window's edge: start_m + BLOCK_M - 1 <= start_n - WIN_LO
            last = tl.minimum(last, tl.maximum(start_n - WIN_LO - lo + 1, 0) // BLOCK_M)
        t_lo, t_hi = _full_run(n_blocks, first, last)
    return lo, n_blocks, t_lo, t_hi, lo_n, hi_n


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V,  # (B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv) inputs, any strides
    DO,  # (B, H, Sq, Dv) gradient of the output, any strides
    LSE,  # (B, H, Sq) fp32 forward lse (natural log), contiguous
    DELTA,  # (B, H, Sq) fp32 from the preprocess kernel, contiguous
    DK, DV,  # (B, Hkv, Sk, D), (B, Hkv, Sk, Dv) outputs, input dtype, contiguous
    MASK,  # (B, Sk) uint8 key keep-mask; unused unless HAS_MASK
    RANGE_LO, RANGE_HI,  # (B, Sk) int32: key j is seen by queries [lo, hi) (its document, causal); HAS_DOCS only
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_mb, stride_mn,
    H, GROUP, SEQ_Q, SEQ_K, HEAD_D, HEAD_DV,  # GROUP = H // Hkv query heads per K/V head
    sm_scale, qk_scale,  # scale, and scale * log2(e)
    WIN_LO,  # window: query i keeps keys j >= i + WIN_LO; unused unless HAS_WINDOW
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT_DV: tl.constexpr,  # v has its own head dim (HEAD_DV, BLOCK_DV); else it shares q/k's offsets and mask
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    # The group sum of dK/dV happens in the program's fp32 tiles: no (B, H, Sk, D) per-query-head temporaries,
    # no atomics. The price is Hkv (not H) programs per key block; long sequences keep the grid full.
    pid_n, pid_bkv = tile_ids(SEQ_K, BLOCK_N)  # pid_bkv = b * Hkv + hkv
    Hkv = H // GROUP
    off_b = pid_bkv // Hkv
    off_hkv = pid_bkv % Hkv
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < SEQ_K
    d_ok = offs_d < HEAD_D
    offs_dv, dv_ok = offs_d, d_ok
    if SPLIT_DV:
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < HEAD_DV
    kv_mask = n_ok[:, None] & d_ok[None, :]
    v_mask = n_ok[:, None] & dv_ok[None, :]

    k = tl.load(K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, mask=v_mask, other=0.0)  # (BLOCK_N, BLOCK_DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # fp32 accumulators, summed over the group
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, n_blocks, t_lo, t_hi, lo_n, hi_n = _query_walk(RANGE_LO, RANGE_HI, off_b, start_n, offs_n, n_ok, SEQ_Q,
                                                       SEQ_K, WIN_LO, IS_CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M,
                                                       BLOCK_N)
    n_masked = n_blocks - (t_hi - t_lo)
    for g in range(0, GROUP):
        off_h = off_hkv * GROUP + g  # a query head that reads this K/V head
        row0 = (off_b * H + off_h) * SEQ_Q  # its first row in LSE / DELTA
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        for t in range(t_lo, t_hi):  # the blocks that need no mask
            dk, dv = _dkdv_step(dk, dv, k, v, lo_n, hi_n, q_base, do_base, LSE + row0, DELTA + row0,
                                lo + t * BLOCK_M, offs_m0, offs_n, offs_d, d_ok, offs_dv, dv_ok, stride_qm, stride_qd,
                                stride_dom, stride_dod, SEQ_Q, SEQ_K, WIN_LO, qk_scale, False, IS_CAUSAL, HAS_DOCS,
                                HAS_WINDOW, UPCAST, PRECISION)
        for t in range(0, n_masked):  # the diagonal band, the window's edge, the last partial block, documents
            dk, dv = _dkdv_step(dk, dv, k, v, lo_n, hi_n, q_base, do_base, LSE + row0, DELTA + row0,
                                _masked_start(t, lo, t_lo, t_hi, BLOCK_M), offs_m0, offs_n, offs_d, d_ok, offs_dv,
                                dv_ok, stride_qm,
                                stride_qd, stride_dom, stride_dod, SEQ_Q, SEQ_K, WIN_LO, qk_scale, True, IS_CAUSAL,
                                HAS_DOCS, HAS_WINDOW, UPCAST, PRECISION)

    dk = dk * sm_scale
    if HAS_MASK:  # a padded key is seen by no query: its rows are zero (the tiles hold whatever its scores gave)
        km = tl.load(MASK + off_b * stride_mb + offs_n * stride_mn, mask=n_ok, other=0)
        dk = tl.where((km != 0)[:, None], dk, 0.0)
        dv = tl.where((km != 0)[:, None], dv, 0.0)
    tl.store(DK + pid_bkv * SEQ_K * HEAD_D + offs_n[:, None] * HEAD_D + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + pid_bkv * SEQ_K * HEAD_DV + offs_n[:, None] * HEAD_DV + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _dq_step(dq, q, do, lse, delta, lo_m, hi_m, k_base, v_base, mask_base, start_n, offs_m, offs_n0, offs_d, d_ok,
             offs_dv, dv_ok, stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, SEQ_Q, SEQ_K, WIN_LO, qk_scale,
             MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr,
             HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dQ += the program's queries' share from one block of BLOCK_N keys (keys start_n..)."""
    offs_n = start_n + offs_n0
    if MASKED:
        n_ok = offs_n < SEQ_K
        rows = n_ok
    else:  # every key in range: bounds on the head dim only
        rows = offs_n0 >= 0
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=rows[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=rows[:, None] & dv_ok[None, :], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 domain
    p = tl.exp2(s - lse[:, None])  # rows past Sq have lse = +inf: P = 0
    if MASKED:  # keys past Sk load as zeros, whose P = exp2(-lse) may overflow: masked too
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(mask_base + offs_n * stride_mn, mask=n_ok, other=0) != 0)
        p = tl.where(keep[None, :], p, 0.0)
        if HAS_DOCS:
            p = tl.where((offs_n[None, :] >= lo_m[:, None]) & (offs_n[None, :] < hi_m[:, None]), p, 0.0)
        elif IS_CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + (SEQ_K - SEQ_Q), p, 0.0)
        if HAS_WINDOW:
            p = tl.where(offs_n[None, :] >= offs_m[:, None] + WIN_LO, p, 0.0)
    elif HAS_MASK:
        p = tl.where((tl.load(mask_base + offs_n * stride_mn) != 0)[None, :], p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V,  # (B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D) inputs, any strides
    DO,  # (B, H, Sq, D) gradient of the output, any strides
    LSE,  # (B, H, Sq) fp32 forward lse (natural log), contiguous
    DELTA,  # (B, H, Sq) fp32 from the preprocess kernel, contiguous
    DQ,  # (B, H, Sq, D) output, input dtype, contiguous
    MASK,  # (B, Sk) uint8 key keep-mask; unused unless HAS_MASK
    RANGE_LO, RANGE_HI,  # (B, Sq) int32: query i sees keys [lo, hi) (its document, causal); HAS_DOCS only
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_mb, stride_mn,
    H, GROUP, SEQ_Q, SEQ_K, HEAD_D, HEAD_DV,  # GROUP = H // Hkv
    sm_scale, qk_scale,  # scale, and scale * log2(e)
    WIN_LO,  # window: query i keeps keys j >= i + WIN_LO; unused unless HAS_WINDOW
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT_DV: tl.constexpr,  # v has its own head dim (HEAD_DV, BLOCK_DV); else it shares q/k's offsets and mask
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m, pid_bh = tile_ids(SEQ_Q, BLOCK_M)
    off_b = pid_bh // H
    off_h = pid_bh % H
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < SEQ_Q
    d_ok = offs_d < HEAD_D
    offs_dv, dv_ok = offs_d, d_ok
    if SPLIT_DV:
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_ok = offs_dv < HEAD_DV
    qd_mask = m_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=qd_mask, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_DV)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + pid_bh * SEQ_Q + offs_m, mask=m_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634  # empty rows: P = 0
    delta = tl.load(DELTA + pid_bh * SEQ_Q + offs_m, mask=m_ok, other=0.0)
    off_hkv = off_h // GROUP  # the K/V head this query head shares
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh
    mask_base = MASK + off_b * stride_mb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # fp32 accumulator

    lo, hi, lo_m, hi_m = key_loop_bounds(RANGE_LO, RANGE_HI, off_b, start_m, offs_m, m_ok, SEQ_Q, SEQ_K, WIN_LO,
                                          IS_CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M, BLOCK_N)
    n_blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    if HAS_DOCS:
        t_lo, t_hi = _full_run(n_blocks, n_blocks, n_blocks)
    else:
        first = 0
        if HAS_WINDOW:  # a block is right of the window's edge once start_n >= the last row + WIN_LO
            first = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + WIN_LO - lo, 0), BLOCK_N)
        last = tl.maximum(SEQ_K - lo, 0) // BLOCK_N  # blocks wholly inside the keys
        if IS_CAUSAL:  # ... and wholly under the diagonal: start_n + BLOCK_N - 1 <= start_m + Sk - Sq
            last = tl.minimum(last, tl.maximum(start_m + (SEQ_K - SEQ_Q) - lo + 1, 0) // BLOCK_N)
        t_lo, t_hi = _full_run(n_blocks, first, last)
    for t in range(t_lo, t_hi):  # the blocks that need no mask
        dq = _dq_step(dq, q, do, lse, delta, lo_m, hi_m, k_base, v_base, mask_base, lo + t * BLOCK_N, offs_m,
                      offs_n0, offs_d, d_ok, offs_dv, dv_ok, stride_kn, stride_kd, stride_vn, stride_vd, stride_mn, SEQ_Q,
                      SEQ_K,
                      WIN_LO, qk_scale, False, IS_CAUSAL, HAS_MASK, HAS_DOCS, HAS_WINDOW, UPCAST, PRECISION)
    for t in range(0, n_blocks - (t_hi - t_lo)):  # the window's edge, the diagonal band, the last partial block
        dq = _dq_step(dq, q, do, lse, delta, lo_m, hi_m, k_base, v_base, mask_base,
                      _masked_start(t, lo, t_lo, t_hi, BLOCK_N), offs_m, offs_n0, offs_d, d_ok, offs_dv, dv_ok,
                      stride_kn, stride_kd,
                      stride_vn, stride_vd, stride_mn, SEQ_Q, SEQ_K, WIN_LO, qk_scale, True, IS_CAUSAL, HAS_MASK,
                      HAS_DOCS, HAS_WINDOW, UPCAST, PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + pid_bh * SEQ_Q * HEAD_D + offs_m[:, None] * HEAD_D + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qd_mask)
