"""The forward Triton kernel of :mod:`.flash_attention` and the program-index and key-loop helpers its backward
kernels (:mod:`.flash_attention_bwd`) share. Layout, masks and the meaning of every argument are described in
:mod:`.flash_attention`; the launchers live there.
"""
from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def tile_ids(SEQ, BLOCK: tl.constexpr):
    """(block index along the sequence, batch * head index as int64) of this program.

    The grid is flat, (cdiv(SEQ, BLOCK) * B * heads,) on grid x (see :func:`_grid`):
    CUDA allows 2^31 - 1 programs there but only 65535 on y, which B * H passes
    (ViT inference at batch 4096 x 16 heads). Sequence blocks vary fastest, so
    neighbouring programs share one head's K/V in L2, as with a 2-D grid.
    """
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(SEQ, BLOCK)
    return pid % n_blocks, (pid // n_blocks).to(tl.int64)


@triton.jit
def doc_span(RANGE_LO, RANGE_HI, off_b, start, offs, ok, SEQ, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """(lo, hi, lo_i, hi_i) of a tile of packed rows: the loop over the other side runs from the tile's first
    token's range start (rounded down to a STEP multiple) to its last token's range end; (lo_i, hi_i) are each
    token's range. ``RANGE_LO``/``RANGE_HI`` are (B, SEQ) int32 and non-decreasing along a row; the tile is
    tokens ``start .. start + BLOCK`` (``offs``, in range where ``ok``). The forward and dQ kernels call it on
    query tiles, the dK/dV kernel on key tiles."""
    row0 = off_b * SEQ + start
    lo = (tl.load(RANGE_LO + row0) // STEP) * STEP
    hi = tl.load(RANGE_HI + row0 + tl.minimum(BLOCK, SEQ - start) - 1)
    lo_i = tl.load(RANGE_LO + off_b * SEQ + offs, mask=ok, other=0)
    hi_i = tl.load(RANGE_HI + off_b * SEQ + offs, mask=ok, other=0)
    return lo, hi, lo_i, hi_i


@triton.jit
def key_loop_bounds(RANGE_LO, RANGE_HI, off_b, start_m, offs_m, m_ok, SEQ_Q, SEQ_K, WIN_LO, IS_CAUSAL: tl.constexpr,
                     HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """(lo, hi, lo_m, hi_m): the key loop [lo, hi) of the query tile whose first row is ``start_m`` (lo a
    multiple of BLOCK_N) and, with documents, each row's key range [lo_m, hi_m) (else placeholders).

    Causal: key blocks wholly above the (end-aligned) diagonal are skipped.
    Documents: the rows' key ranges are non-decreasing, so the tile visits
    only the keys from its first row's ``lo`` to its last row's ``hi`` (causal
    included): a packed row costs the sum of its documents' squares.
    Window: row ``i`` keeps keys ``j >= i + WIN_LO``, so the loop starts at the
    first row's bound: a windowed row costs its window, not its length.
    """
    lo = 0
    hi = SEQ_K
    lo_m = offs_m
    hi_m = offs_m
    if HAS_DOCS:
        lo, hi, lo_m, hi_m = doc_span(RANGE_LO, RANGE_HI, off_b, start_m, offs_m, m_ok, SEQ_Q, BLOCK_M, BLOCK_N)
    elif IS_CAUSAL:
        hi = tl.minimum(SEQ_K, start_m + BLOCK_M + SEQ_K - SEQ_Q)
    if HAS_WINDOW:
        lo = tl.maximum(lo, (tl.maximum(start_m + WIN_LO, 0) // BLOCK_N) * BLOCK_N)
    return lo, hi, lo_m, hi_m


@triton.jit
def attn_fwd_kernel(
    Q,  # (B, H, Sq, D) input, any strides
    K,  # (B, Hkv, Sk, D) input, any strides; H % Hkv == 0
    V,  # (B, Hkv, Sk, Dv) input, any strides (Dv may differ from D: latent attention)
    O,  # (B, H, Sq, Dv) output, q's dtype, any strides
    LSE,  # (B, H, Sq) fp32 output, contiguous (with sinks: over the keys and the sink)
    SINKS,  # (H,) fp32 sink logits (natural log), contiguous; unused unless HAS_SINKS
    MASK,  # (B, Sk) uint8 key keep-mask (1 = keep); unused unless HAS_MASK
    RANGE_LO, RANGE_HI,  # (B, Sq) int32: query i sees keys [lo, hi) (its document, causal); HAS_DOCS only
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_mb, stride_mn,
    H, GROUP, SEQ_Q, SEQ_K, HEAD_D, HEAD_DV,  # GROUP = H // Hkv query heads per K/V head
    qk_scale,  # softmax scale * log2(e): scores live in the log2 domain
    WIN_LO,  # window: query i keeps keys j >= i + WIN_LO; unused unless HAS_WINDOW
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SPLIT_DV: tl.constexpr,  # v has its own head dim (HEAD_DV, BLOCK_DV); else it shares q/k's offsets and mask
    UPCAST: tl.constexpr,  # convert tiles to fp32 before tl.dot (fp32 inputs, bf16 in the interpreter)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" for fp32 operands
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

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    off_hkv = off_h // GROUP  # the K/V head this query head shares
    k_base = K + off_b * stride_kb + off_hkv * stride_kh
    v_base = V + off_b * stride_vb + off_hkv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (log2 domain)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fp32 accumulator of P @ V

    lo, hi, lo_m, hi_m = key_loop_bounds(RANGE_LO, RANGE_HI, off_b, start_m, offs_m, m_ok, SEQ_Q, SEQ_K, WIN_LO,
                                          IS_CAUSAL, HAS_DOCS, HAS_WINDOW, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        n_ok = offs_n < SEQ_K
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # (BLOCK_N, BLOCK_DV)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N) fp32
        keep = n_ok[None, :]
        if HAS_MASK:
            km = tl.load(MASK + off_b * stride_mb + offs_n * stride_mn, mask=n_ok, other=0)
            keep = keep & (km != 0)[None, :]
        if HAS_DOCS:  # the row's range holds the causal rule too
            keep = keep & (offs_n[None, :] >= lo_m[:, None]) & (offs_n[None, :] < hi_m[:, None])
        elif IS_CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None] + (SEQ_K - SEQ_Q))
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] >= offs_m[:, None] + WIN_LO)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf) for empty rows
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new

    if HAS_SINKS:  # one more logit in the denominator, no value: out and lse take it once, at the end
        # (a sink of -inf, no sink, is held at -1e30: the max stays finite, and exp2(-1e30 - m) is 0)
        sink = tl.maximum(tl.load(SINKS + off_h) * 1.4426950408889634, -1e30)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)  # the keys' sum rescaled to the new max, folded into out's row factor
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        m_i = m_new
        empty = l_i == 0.0
        out = acc * (alpha / l_i)[:, None]
    else:
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    tl.store(LSE + pid_bh * SEQ_Q + offs_m, lse, mask=m_ok)
