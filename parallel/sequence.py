"""Sequence parallelism: ring attention (zigzag, flash form) and all-to-all (Ulysses) attention.

Both functions take this rank's shard of the sequence of q (B, H, T/sp, D)
and k, v (B, Hkv, T/sp, D) (grouped-query attention: H a multiple of Hkv,
query head h reads K/V head h // (H / Hkv), as in the kernel), and return this
rank's rows of the full attention ``cuboid.kernels.attention(Q, K, V,
causal=..., key_padding_mask=...)`` of the whole sequence (length T),
(B, H, T/sp, D). The mask is (B, T/sp) bool,
True = keep, in the same layout as q. A group of ``None`` or of one rank is
plain attention.

**Layouts.** *Contiguous*: rank i holds tokens [i T/sp, (i+1) T/sp).
*Zigzag*: the sequence is cut into 2 sp chunks of c = T/(2 sp) tokens and rank
i holds chunks i and 2 sp - 1 - i, concatenated (so T must divide by 2 sp).
:func:`zigzag_split`, :func:`zigzag_merge` and :func:`zigzag_positions` move
between the global order and the zigzag shards.

- :func:`ring_attention` takes the **zigzag** layout (for causal attention:
  without a mask or causality any layout works, since attention does not care
  how keys are ordered, as long as q, k, v and the mask agree).
- :func:`all_to_all_attention` takes ``layout="contiguous"`` (default,
  DeepSpeed-Ulysses) or ``layout="zigzag"``; the zigzag form reorders the
  gathered sequence to global order before the attention and back after, so a
  model can keep its tokens zigzag-sharded whichever ``sp_mode`` it runs.

**Ring attention** (Li et al., arXiv 2105.13120, in the flash form of the
public ring-flash-attention / zigzag designs). K, V (and the mask) travel the
ring: at step t rank r holds the block of rank s = (r - t) mod sp, attends its
own queries to it with ``cuboid.kernels.attention(..., return_lse=True)``, and
merges the partial outputs with the log-sum-exp (fp32 accumulators; a row that
sees no key in a block has lse = -inf and adds nothing; a row that sees no key
at all ends as out = 0, lse = -inf, like the kernel). The send of the next
block overlaps the current block's compute. For causal attention each (query
chunk, key chunk) pair is full if the key chunk comes first, causal on the
diagonal, skipped if it comes after; with the zigzag chunks r, 2sp-1-r (queries)
and s, 2sp-1-s (keys) that gives one kernel call per step:

- s == r: all local queries vs all local keys, causal (the local order is
  already increasing);
- s < r: all local queries vs the first key chunk (s), non-causal;
- s > r: the second query chunk (2sp-1-r) vs all local keys, non-causal.

Every step after the first costs 2c^2 scores on every rank (the first
2c^2 + c), so the work is balanced; the contiguous split gives rank r
r L^2 + L(L+1)/2 (L = T/sp), and the ring waits for the last rank. Scores
computed per rank for causal attention at T = 4096 (:func:`causal_work`;
"critical path" sums, over ring steps, the busiest rank's scores, i.e. what
the ring waits for; the total is T(T+1)/2 = 8,390,656):

=====  ==========  ====================================  =============
sp     layout      scores per rank (rank 0, 1, ...)      critical path
=====  ==========  ====================================  =============
2      contiguous  2,098,176 / 6,292,480                 6,292,480
2      zigzag      4,195,328 / 4,195,328                 4,195,328
4      contiguous  524,800 / 1,573,376 / 2,621,952 /     3,670,528
                   3,670,528
4      zigzag      2,097,664 / 2,097,664 / 2,097,664 /   2,097,664
                   2,097,664
=====  ==========  ====================================  =============

The backward is its own ring: it saves only the local q, k, v, the output,
the lse and the (small, bool) masks of every block seen in forward (B x T
bytes), sends K, V around again, and lets each block's dK, dV accumulator
(fp32) travel with it, so that it arrives home after sp hops. Block gradients
use the FINAL output and lse (the standard flash backward: P = exp(S scale -
lse), D = rowsum(dO * O), dS = P (dP - D)); sinks (gpt-oss) join the merged
lse once at the end, the blocks run without them, and the sink's gradient
-sum exp(sink - lse) D is this rank's rows' share (summed over sp as for any
replicated weight): with Triton (CUDA, or the
interpreter) the kernel's own backward (``attention_backward``), which takes
out and lse as arguments; on the torch backend a plain-torch block backward
in fp32 (fp64 for fp64 inputs), queries in chunks so at most a
(B, H, 1024, Sk) matrix lives.

Under GQA only the Hkv K/V heads travel (and their dK, dV, summed over each
group by the block backward before they move), never copies per query head.

**Bytes per rank** (``comm.count()``, op ``send``; n_kv = B Hkv (T/sp) D the
elements of k (n_kv = n = B H (T/sp) D without GQA), e the element size of
q/k/v, a = 4 (8 for fp64) the accumulator's, m = B T/sp the mask's bytes when
a mask is given, else 0):

- forward: (sp - 1) (2 n_kv e + m)  -- K, V and the mask, sp - 1 hops;
- backward: (sp - 1) 2 n_kv e + sp 2 n_kv a  -- K, V again (the masks were
  kept), and dK, dV sp hops home.

**Packed rows** (several documents in a row; ``doc_ids``, the kernel's
convention). Both functions take the WHOLE rows' (B, T) document ids in
sequence order, the same on every rank: the sequence split embeds the whole
row, so the ids are computed once before the cut and no rank sends them. The
ring gives each kernel call its query and key chunks' ids
(``doc_ids``/``doc_ids_k``) and skips the chunk pairs that hold no common
document: :class:`ZigzagDocs` finds them from each chunk's first and last id
(one host read of a (2 sp, 2 sp) table per ZigzagDocs; build it once per
model forward and every layer's forward and backward reuse it). A pair group
above with a pair that shares nothing is cut into one call per pair that
does. Only compute is skipped: every hop runs on every rank (the collective
rule), and the bytes are those without documents. After all-to-all's
exchange each rank holds the whole sequence, so the kernel takes the whole
rows' ids as they are (no host read).

**All-to-all attention** (DeepSpeed-Ulysses, arXiv 2309.14509): one all-to-all
of q, k, v (their heads cut in sp groups, rank i's q, k and v heads side by
side) turns the (B, H, T/sp, D) / (B, Hkv, T/sp, D) shards into (B, H/sp, T, D)
/ (B, Hkv/sp, T, D), the kernel runs on the whole sequence for those heads
(rank i's query heads read exactly rank i's K/V heads) with the all-gathered
mask, and one all-to-all brings the output back. Bytes per rank, forward +
backward: 4 (sp-1)/sp (n + n_kv) e (all_to_all; 8 (sp-1)/sp n e without GQA)
+ (sp - 1) m (all_gather of the mask, forward). The zigzag layout costs only a
local reorder (a cat of chunks) on each side. H and Hkv must divide by sp
(with Hkv < sp, e.g. multi-query, use ring attention).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

import cuboid.kernels as kernels
from cuboid.kernels.attention_torch import check_sinks, check_window, window_keep
from . import comm

__all__ = ["ring_attention", "all_to_all_attention", "zigzag_split", "zigzag_merge", "zigzag_positions",
           "causal_work", "ZigzagDocs"]

_BWD_CHUNK = 1024  # query rows per step of the torch block backward
_TAG_KV, _TAG_DKV = 100, 200  # p2p tags (gloo matches on them; NCCL ignores them)


# ----------------------------------------------------------------- zigzag layout


def _chunk_len(T: int, sp: int, what: str) -> int:
    if sp < 1 or T % (2 * sp):
        raise ValueError(f"{what}: a sequence of {T} tokens does not cut into 2*sp = {2 * sp} equal chunks")
    return T // (2 * sp)


def zigzag_split(x: torch.Tensor, sp: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the global ``x``: chunks rank and 2 sp - 1 - rank along ``dim``."""
    c = _chunk_len(x.shape[dim], sp, "zigzag_split")
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * sp - 1 - rank) * c, c)], dim=dim)


def zigzag_merge(chunks_list, sp: int, dim: int) -> torch.Tensor:
    """The global tensor from every rank's zigzag shard (a list in rank order); inverse of :func:`zigzag_split`."""
    if len(chunks_list) != sp:
        raise ValueError(f"zigzag_merge: expected {sp} shards (one per rank), got {len(chunks_list)}")
    firsts, seconds = zip(*(x.chunk(2, dim=dim) for x in chunks_list))
    if any(a.shape != b.shape for a, b in zip(firsts, seconds)):
        raise ValueError("zigzag_merge: every shard must have an even length along dim")
    return torch.cat(list(firsts) + list(reversed(seconds)), dim=dim)


def zigzag_positions(T: int, sp: int, rank: int, device=None) -> torch.Tensor:
    """Global position ids (LongTensor, length T/sp) of rank ``rank``'s tokens in the zigzag layout."""
    c = _chunk_len(T, sp, "zigzag_positions")
    lo, hi = rank * c, (2 * sp - 1 - rank) * c
    return torch.cat([torch.arange(lo, lo + c, device=device), torch.arange(hi, hi + c, device=device)])


class ZigzagDocs:
    """A packed batch's document ids as the ring sees them: the whole rows' ids (B, T), every rank's zigzag
    share of them, and which of the 2 sp chunks hold a common document.

    Every sp rank has the whole row (the sequence split embeds the whole
    sequence), so each rank knows every chunk's ids without communication.
    Ids are non-decreasing along a row, so chunk i holds the documents
    ``first_i .. last_i`` of its row and chunks i, j share one iff those
    ranges meet (then ``max(first_i, first_j)`` is in both). ``shares[i][j]``
    is that, in any row of the batch: building one reads this (2 sp, 2 sp)
    table to the host, the one host sync of packed ring attention. Build it
    once per model forward and give it to every layer (a tensor given to
    :func:`ring_attention` builds one per call).
    """

    def __init__(self, doc_ids: torch.Tensor, sp: int) -> None:
        if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point \
                or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
            raise TypeError("ZigzagDocs: doc_ids must be a (batch, seq) integer tensor of the whole rows' "
                            "document ids")
        c = _chunk_len(doc_ids.shape[1], sp, "ZigzagDocs")
        chunks = doc_ids.unflatten(1, (2 * sp, c))
        first, last = chunks[..., 0], chunks[..., -1]  # (B, 2 sp): each chunk's documents
        meet = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
        self.ids, self.sp = doc_ids, sp
        self.shares = meet.any(0).tolist()  # the host read
        self.ranks = [zigzag_split(doc_ids, sp, i, 1) for i in range(sp)]  # (B, T/sp) ids of rank i's tokens


def causal_work(T: int, sp: int, layout: str = "zigzag") -> list:
    """Causal (query, key) scores each rank computes at each ring step: ``[rank][step]`` ints.

    Counts the kept pairs j <= i between the rank's query positions and the
    positions of the key block it holds at that step (block skipping makes
    that the work, up to tile granularity).
    """
    if layout == "zigzag":
        pos = [zigzag_positions(T, sp, r) for r in range(sp)]
    elif layout == "contiguous":
        if T % sp:
            raise ValueError(f"causal_work: T = {T} does not divide over sp = {sp}")
        pos = [torch.arange(r * T // sp, (r + 1) * T // sp) for r in range(sp)]
    else:
        raise ValueError(f"causal_work: layout must be 'zigzag' or 'contiguous', got {layout!r}")
    keys = [p.sort().values for p in pos]
    return [[int(torch.searchsorted(keys[(r - t) % sp], pos[r], right=True).sum()) for t in range(sp)]
            for r in range(sp)]


# ----------------------------------------------------------------- ring plumbing


class _Exchange:
    """One asynchronous ring hop: send ``tensors`` to the next rank, receive the previous rank's."""

    def __init__(self, tensors, group, tag: int):
        p, r = comm.group_size(group), comm.group_rank(group)
        to, frm = dist.get_global_rank(group, (r + 1) % p), dist.get_global_rank(group, (r - 1) % p)
        self.sent = [t.contiguous() for t in tensors]  # kept alive until the sends finish
        self.recv = [torch.empty_like(t) for t in self.sent]
        ops = []
        for i, (s, buf) in enumerate(zip(self.sent, self.recv)):
            comm.record("send", group, s.numel() * s.element_size())
            ops += [dist.P2POp(dist.isend, s, to, group, tag + i), dist.P2POp(dist.irecv, buf, frm, group, tag + i)]
        self.works = dist.batch_isend_irecv(ops)
        self.group, self.op = group, f"ring attention hop (send to rank {to}, receive from rank {frm})"

    def wait(self) -> list:
        comm.wait_p2p(self.works, self.op, self.group)  # a stalled peer is a CollectiveTimeout, not a hang
        self.sent = None
        return self.recv


def _blocks(r: int, s: int, causal: bool, c: int, sp: int, shares=None, window: Optional[int] = None) -> list:
    """(query slice, key slice, causal, window) kernel calls when rank r's queries meet rank s's zigzag keys;
    ``window`` of a call is None or (window, shift) for the kernel's ``window`` / ``window_shift``.

    ``shares[i][j]``: whether global chunks i and j hold a common document in
    some row (None: every pair does). The chunk pairs with work are grouped in
    one call as in the module docstring; when a pair of that group shares no
    document, the group is cut into one call per pair that does (a pair on the
    diagonal causal), and pairs without a common document get no call.
    A ``window`` (which drops some keys of the sequence) cuts the group into
    one call per chunk pair: query chunk qi sits ``(qi - kj) c`` positions
    right of key chunk kj (the call's shift); a pair wholly left of the window
    gets no call, and one wholly inside it is called without a window.
    """
    every, first, second = slice(None), slice(0, c), slice(c, None)
    pairs = [(qi, qs, kj, ks, causal and kj == qi)
             for qi, qs in ((r, first), (2 * sp - 1 - r, second))
             for kj, ks in ((s, first), (2 * sp - 1 - s, second)) if not (causal and kj > qi)]
    if window is not None:
        calls = []
        for qi, qs, kj, ks, diag in pairs:
            shift = (qi - kj) * c
            lo = shift - window + 1  # key jj of the pair is kept iff jj >= ii + lo
            if (shares is not None and not shares[qi][kj]) or lo > c - 1:
                continue
            calls.append((qs, ks, diag, None if lo <= -(c - 1) else (window, shift)))
        return calls
    if shares is not None and not all(shares[qi][kj] for qi, _, kj, _, _ in pairs):
        return [(qs, ks, diag, None) for qi, qs, kj, ks, diag in pairs if shares[qi][kj]]
    if not causal:
        return [(every, every, False, None)]
    if s == r:
        return [(every, every, True, None)]
    if s < r:
        return [(every, first, False, None)]
    return [(second, every, False, None)]


def _merge(out, lse, o, l) -> None:
    """Fold a block's (o, l) into the running (out, lse) in place; -inf rows add nothing, never NaN."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - safe).unsqueeze(-1))
    lse.copy_(new)


def _block_bwd_torch(do, q, k, v, delta, lse, keep_k, causal: bool, scale: float, docs=None, win=None):
    """dq, dk, dv (accumulator dtype) of one block, from the FINAL lse and delta = rowsum(dO * O).

    q, do: (B, H, Sq, D); k, v: (B, Hkv, Sk, D). Heads are grouped (B, Hkv, G, ...)
    so each K/V head broadcasts over its G query heads; dk, dv sum over the group.
    ``docs``: None or the (B, Sq), (B, Sk) document ids of the queries and keys; ``win``: None or the
    call's (window, shift) (:func:`_blocks`).
    """
    acc = lse.dtype
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = (Hkv, H // Hkv)
    qf, dof = (t.to(acc).unflatten(1, group) for t in (q, do))  # (B, Hkv, G, Sq, D)
    kf, vf = (t.to(acc).unsqueeze(2) for t in (k, v))  # (B, Hkv, 1, Sk, D): broadcast over the group
    delta = delta.unflatten(1, group)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)  # empty rows: P = 0
    lse = lse.unflatten(1, group)
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf.squeeze(2)), torch.zeros_like(vf.squeeze(2))  # (B, Hkv, Sk, D)
    j = torch.arange(Sk, device=q.device)
    lo = None if win is None else check_window(win[0], win[1], q, k)
    for start in range(0, Sq, _BWD_CHUNK):
        rows = slice(start, min(Sq, start + _BWD_CHUNK))
        keep = torch.ones((1, 1, 1, 1, Sk), dtype=torch.bool, device=q.device)
        if causal:  # end-aligned, as in the kernel
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            keep = keep & (j[None, :] <= i + (Sk - Sq))
        if lo is not None:
            keep = keep & window_keep(lo, range(rows.start, rows.stop), Sk, q.device)
        if keep_k is not None:
            keep = keep & keep_k[:, None, None, None, :]
        if docs is not None:  # (B, 1, 1, rows, Sk): block-diagonal
            keep = keep & (docs[0][:, None, None, rows, None] == docs[1][:, None, None, None, :])
        s = torch.matmul(qf[..., rows, :], kf.transpose(-1, -2)) * scale  # (B, Hkv, G, c, Sk)
        p = torch.where(keep, torch.exp(s - lse[..., rows, None]), torch.zeros_like(s))
        dp = torch.matmul(dof[..., rows, :], vf.transpose(-1, -2))
        ds = p * (dp - delta[..., rows, None])
        dq[..., rows, :] = torch.matmul(ds, kf) * scale
        # group and rows contracted in one matmul: (B, Hkv, Sk, G c) @ (B, Hkv, G c, D)
        dk += torch.matmul(ds.flatten(2, 3).transpose(-1, -2), qf[..., rows, :].flatten(2, 3)) * scale
        dv += torch.matmul(p.flatten(2, 3).transpose(-1, -2), dof[..., rows, :].flatten(2, 3))
    return dq.flatten(1, 2), dk, dv


def _block_bwd_triton(do, q, k, v, out, lse, keep_k, causal: bool, scale: float, docs=None, win=None):
    from cuboid.kernels.flash_attention import attention_backward

    doc_q, doc_k = (None, None) if docs is None else docs
    window, shift = (None, 0) if win is None else win
    return attention_backward(do, q, k, v, out, lse, causal=causal, scale=scale, key_padding_mask=keep_k,
                              doc_ids=doc_q, doc_ids_k=doc_k, window=window, window_shift=shift)


# ----------------------------------------------------------------- ring attention


def _ids(docs, rank: int, sl: slice):
    return None if docs is None else docs.ranks[rank][:, sl]


class _RingAttention(torch.autograd.Function):
    """Zigzag ring attention; forward and backward are each one pass of sp ring steps.

    ``docs``: None or a :class:`ZigzagDocs`: each kernel call takes its query
    and key chunks' document ids (known on every rank, never sent), and chunk
    pairs without a common document get no call (:func:`_blocks`). Only
    compute is skipped: every hop of the ring runs on every rank.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, group, causal: bool, scale: float, backend: str, docs, window, sinks):
        sp, r = comm.group_size(group), comm.group_rank(group)
        c = q.shape[2] // 2
        shares = None if docs is None else docs.shares
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        masks = [None] * sp  # every block's mask, kept for backward (B x T bools in all)
        calls = [None] * sp  # every block's kernel calls, the same in backward
        kb, vb, mb = k, v, mask
        out = torch.zeros((*q.shape[:3], v.shape[3]), dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for t in range(sp):
            s = (r - t) % sp
            masks[s], calls[s] = mb, _blocks(r, s, causal, c, sp, shares, window)
            nxt = None
            if t < sp - 1:  # the next block travels while this one is computed
                nxt = _Exchange([kb, vb] + ([] if mb is None else [mb.view(torch.uint8)]), group, _TAG_KV)
            for qs, ks, blk_causal, win in calls[s]:
                o, l = kernels.attention(q[:, :, qs], kb[:, :, ks], vb[:, :, ks], causal=blk_causal,
                                         key_padding_mask=None if mb is None else mb[:, ks], scale=scale,
                                         return_lse=True, doc_ids=_ids(docs, r, qs), doc_ids_k=_ids(docs, s, ks),
                                         window=None if win is None else win[0], window_shift=0 if win is None
                                         else win[1], backend=backend)
                _merge(out[:, :, qs], lse[:, :, qs], o, l.to(acc))
            if nxt is not None:
                got = nxt.wait()
                kb, vb = got[0], got[1]
                mb = None if mask is None else got[2].view(torch.bool)
        if sinks is not None:  # the blocks' lse are over keys alone: the sink joins the merged denominator once
            full = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
            out.mul_(torch.exp(lse - full).unsqueeze(-1))
            lse = full
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.masks, ctx.calls, ctx.docs, ctx.group = masks, calls, docs, group
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, scale, docs = ctx.group, ctx.scale, ctx.docs
        sp, r = comm.group_size(group), comm.group_rank(group)
        acc = lse.dtype
        do = dout.to(out.dtype).contiguous()
        triton = ctx.backend == "triton"
        delta = None if triton and sinks is None else (do.to(acc) * out.to(acc)).sum(-1)  # (B, H, S): rowsum(dO O)
        dsinks = None  # this rank's rows' share: d out / d sink = -P_sink out, P_sink = exp(sink - lse)
        if sinks is not None:
            dsinks = -(torch.exp(sinks.to(acc)[None, :, None] - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kb, vb = k, v
        home = None  # the dK, dV accumulators in flight
        for t in range(sp):
            s = (r - t) % sp
            nxt = _Exchange([kb, vb], group, _TAG_KV) if t < sp - 1 else None
            gk = torch.zeros(kb.shape, dtype=acc, device=q.device)
            gv = torch.zeros(vb.shape, dtype=acc, device=q.device)
            mb = ctx.masks[s]
            for qs, ks, blk_causal, win in ctx.calls[s]:
                keep = None if mb is None else mb[:, ks]
                ids = None if docs is None else (_ids(docs, r, qs), _ids(docs, s, ks))
                if triton:
                    a, b, d = _block_bwd_triton(do[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                                out[:, :, qs], lse[:, :, qs], keep, blk_causal, scale, ids, win)
                else:
                    a, b, d = _block_bwd_torch(do[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                               delta[:, :, qs], lse[:, :, qs], keep, blk_causal, scale, ids, win)
                dq[:, :, qs] += a
                gk[:, :, ks] += b
                gv[:, :, ks] += d
            if home is not None:  # this block's accumulators from the previous rank
                rk, rv = home.wait()
                gk += rk
                gv += rv
            home = _Exchange([gk, gv], group, _TAG_DKV)
            if nxt is not None:
                kb, vb = nxt.wait()
        dk, dv = home.wait()  # after sp hops, our own block's sums
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, dsinks


def _check_qkv(q, k, v, key_padding_mask, what: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be a 4-D tensor (batch, heads, seq, head_dim)")
    B, H, S, D = q.shape
    if k.shape[:3] != v.shape[:3] or (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D):
        raise ValueError(f"{what}: k and v must share (batch, kv heads, seq), matching q's batch and seq, and k "
                         f"q's head_dim (v's may differ), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"{what}: q's {H} heads must be a multiple of k/v's {k.shape[1]} heads "
                         f"(grouped-query attention).")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{what}: key_padding_mask must be a bool tensor (True = keep)")
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"{what}: key_padding_mask must be (batch, local seq) = {(B, S)}, "
                             f"got {tuple(key_padding_mask.shape)}")


def _check_window(window, q, sp: int, what: str) -> Optional[int]:
    """``window`` checked; None when it drops no key of the whole sequence (T = sp x the local length)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{what}: window must be an int >= 1 (keys a query sees, itself included) or None, "
                         f"got {window!r}")
    return None if window >= q.shape[2] * max(sp, 1) else window


def _row_docs(doc_ids, q, sp: int, what: str):
    """The whole rows' (B, T) document ids of ``doc_ids`` (a tensor or a :class:`ZigzagDocs`), checked
    against q's (B, H, T/sp, D) shard; None without."""
    if doc_ids is None:
        return None
    ids = doc_ids.ids if isinstance(doc_ids, ZigzagDocs) else doc_ids
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{what}: doc_ids must be a tensor or a ZigzagDocs, got {type(doc_ids).__name__}")
    want = (q.shape[0], q.shape[2] * sp)
    if tuple(ids.shape) != want:
        raise ValueError(f"{what}: doc_ids are the whole rows' document ids in sequence order, (batch, seq) = "
                         f"{want}, got {tuple(ids.shape)}")
    if isinstance(doc_ids, ZigzagDocs) and doc_ids.sp != sp:
        raise ValueError(f"{what}: these ZigzagDocs were cut for sp = {doc_ids.sp}, the group has {sp} ranks")
    return ids


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                   key_padding_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                   doc_ids=None, window: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's rows of the attention of the whole sequence, K/V passed around the ``group`` ring.

    Args:
        q: (B, H, T/sp, D), k, v: (B, Hkv, T/sp, D) with H a multiple of Hkv,
            this rank's tokens in the zigzag layout. Only the Hkv K/V heads
            travel the ring.
        group: the sp process group (``None`` or one rank: plain attention).
        causal: causal attention over global positions.
        key_padding_mask: (B, T/sp) bool, True = keep, zigzag layout like q.
        scale: softmax scale, default 1 / sqrt(D).
        doc_ids: packed rows: the WHOLE rows' (B, T) document ids in sequence
            order, non-decreasing (the same on every rank;
            ``kernels.flash_attention.doc_ids_from_positions``), or a
            :class:`ZigzagDocs` of them built once for every layer. A query
            sees only keys of its document; chunk pairs that share no
            document are not computed. A tensor costs one host sync per call
            (building its ZigzagDocs), a ZigzagDocs none.
        window: sliding-window attention over global positions (the kernel's
            ``window``; inside a packed document index differences are position
            differences). Chunk pairs wholly left of the window are not
            computed, so a rank's work is its T/sp tokens x the window.
        sinks: (H,) attention sinks (the kernel's ``sinks``), the same on
            every rank; each rank's gradient of them is its rows' share.

    ``v`` may have its own head dim Dv (latent attention). Returns (B, H, T/sp, Dv) in q's dtype,
    differentiable w.r.t. q, k, v and sinks.
    """
    _check_qkv(q, k, v, key_padding_mask, "ring_attention")
    sinks = check_sinks(sinks, q)
    window = _check_window(window, q, comm.group_size(group), "ring_attention")
    if not isinstance(causal, bool):
        raise TypeError(f"ring_attention: causal must be a bool, got {type(causal).__name__}")
    sp = comm.group_size(group)
    ids = _row_docs(doc_ids, q, sp if comm.active(group) else 1, "ring_attention")
    if not comm.active(group):
        return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                 doc_ids=ids, window=window, sinks=sinks)
    if causal and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a zigzag shard holds two equal chunks, got an odd length {q.shape[2]}")
    backend = kernels.resolve_backend("attention", [q, k, v, key_padding_mask])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # the kernel's default, bit for bit
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    docs = doc_ids if isinstance(doc_ids, ZigzagDocs) or ids is None else ZigzagDocs(ids, sp)
    return _RingAttention.apply(q, k, v, mask, group, causal, scale, backend, docs, window, sinks)


# ----------------------------------------------------------------- all-to-all attention


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                         key_padding_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                         layout: str = "contiguous", doc_ids=None, window: Optional[int] = None,
                         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This rank's rows of the whole-sequence attention by a head/sequence all-to-all (Ulysses).

    Args:
        q: (B, H, T/sp, D), k, v: (B, Hkv, T/sp, D), this rank's tokens in
            ``layout``; H and Hkv divisible by sp, H a multiple of Hkv.
        group: the sp process group (``None`` or one rank: plain attention).
        causal: causal attention over global positions.
        key_padding_mask: (B, T/sp) bool, True = keep, same layout as q.
        layout: ``"contiguous"`` (rank i holds tokens [i T/sp, (i+1) T/sp)) or
            ``"zigzag"`` (as :func:`ring_attention`).
        doc_ids: packed rows: the WHOLE rows' (B, T) document ids in sequence
            order (or a :class:`ZigzagDocs`), whatever the layout: after the
            exchange each rank holds the whole sequence in that order. No
            host sync.
        window: sliding-window attention over global positions, passed to
            the kernel's attention of the whole sequence.
        sinks: (H,) attention sinks, the same on every rank; rank i's kernel
            takes its heads' (its gradient: theirs whole, the others' 0).

    ``v`` may have its own head dim Dv (then its own all-to-all). Returns (B, H, T/sp, Dv) in the same
    layout, differentiable w.r.t. q, k, v and sinks.
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"all_to_all_attention: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    _check_qkv(q, k, v, key_padding_mask, "all_to_all_attention")
    sinks = check_sinks(sinks, q)
    window = _check_window(window, q, comm.group_size(group), "all_to_all_attention")
    sp = comm.group_size(group)
    ids = _row_docs(doc_ids, q, sp if comm.active(group) else 1, "all_to_all_attention")
    if not comm.active(group):
        return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                                 doc_ids=ids, window=window, sinks=sinks)
    H, Hkv = q.shape[1], k.shape[1]
    if H % sp:
        raise ValueError(f"all_to_all_attention needs heads ({H}) divisible by sp ({sp}).")
    if Hkv % sp:
        raise ValueError(f"all_to_all_attention needs the K/V heads ({Hkv}) divisible by sp ({sp}); "
                         f"ring attention (sp_mode='ring') takes any number of K/V heads.")
    if layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(f"all_to_all_attention: a zigzag shard holds two equal chunks, got an odd length {q.shape[2]}")
    # rank i gets query heads [i H/sp, (i+1) H/sp) and the K/V heads they read, [i Hkv/sp, (i+1) Hkv/sp):
    # cut each tensor's heads in sp groups and put rank i's q, k, v heads side by side, one all-to-all
    # (v apart when its head dim differs: one more all-to-all of the same bytes)
    same = v.shape[3] == q.shape[3]
    parts = (q, k, v) if same else (q, k)
    by_rank = torch.cat([t.unflatten(1, (sp, t.shape[1] // sp)) for t in parts], dim=2)  # (B, sp, h, S, D)
    qkv = comm.all_to_all(by_rank.flatten(1, 2), group, scatter_dim=1, gather_dim=2)  # (B, (H + 2 Hkv)/sp, T, D)
    va = None if same else comm.all_to_all(v, group, scatter_dim=1, gather_dim=2)  # (B, Hkv/sp, T, Dv)
    mask = None
    if key_padding_mask is not None:
        shards = [m.view(torch.bool) for m in comm.all_gather_list(key_padding_mask.view(torch.uint8), group)]
        mask = zigzag_merge(shards, sp, dim=1) if layout == "zigzag" else torch.cat(shards, dim=1)  # (B, T)
    if layout == "zigzag":  # rank order -> global order
        qkv = zigzag_merge(list(qkv.chunk(sp, dim=2)), sp, dim=2)
        va = None if same else zigzag_merge(list(va.chunk(sp, dim=2)), sp, dim=2)
    # (B, H/sp, T, D) and (B, Hkv/sp, T, D): the whole sequence for this rank's heads
    if same:
        qa, ka, va = qkv.split([H // sp, Hkv // sp, Hkv // sp], dim=1)
    else:
        qa, ka = qkv.split([H // sp, Hkv // sp], dim=1)
    r = comm.group_rank(group)
    own = None if sinks is None else sinks[r * (H // sp):(r + 1) * (H // sp)]  # the sinks of this rank's heads
    out = kernels.attention(qa, ka, va, causal=causal, key_padding_mask=mask, scale=scale, doc_ids=ids,
                            window=window, sinks=own)
    if layout == "zigzag":  # global order -> rank order
        out = torch.cat([zigzag_split(out, sp, i, dim=2) for i in range(sp)], dim=2)
    return comm.all_to_all(out, group, scatter_dim=2, gather_dim=1)
