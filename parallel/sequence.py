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
lse), D = rowsum(dO * O), dS = P (dP - D)): with Triton (CUDA, or the
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
from . import comm

__all__ = ["ring_attention", "all_to_all_attention", "zigzag_split", "zigzag_merge", "zigzag_positions",
           "causal_work"]

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
            comm._record("send", group, s.numel() * s.element_size())
            ops += [dist.P2POp(dist.isend, s, to, group, tag + i), dist.P2POp(dist.irecv, buf, frm, group, tag + i)]
        self.works = dist.batch_isend_irecv(ops)
        self.group, self.op = group, f"ring attention hop (send to rank {to}, receive from rank {frm})"

    def wait(self) -> list:
        comm.wait_p2p(self.works, self.op, self.group)  # a stalled peer is a CollectiveTimeout, not a hang
        self.sent = None
        return self.recv


def _blocks(r: int, s: int, causal: bool, c: int) -> list:
    """(query slice, key slice, causal) kernel calls when rank r's queries meet rank s's zigzag keys."""
    every = slice(None)
    if not causal:
        return [(every, every, False)]
    if s == r:
        return [(every, every, True)]
    if s < r:
        return [(every, slice(0, c), False)]
    return [(slice(c, None), every, False)]


def _merge(out, lse, o, l) -> None:
    """Fold a block's (o, l) into the running (out, lse) in place; -inf rows add nothing, never NaN."""
    new = torch.logaddexp(lse, l)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(l - safe).unsqueeze(-1))
    lse.copy_(new)


def _block_bwd_torch(do, q, k, v, delta, lse, keep_k, causal: bool, scale: float):
    """dq, dk, dv (accumulator dtype) of one block, from the FINAL lse and delta = rowsum(dO * O).

    q, do: (B, H, Sq, D); k, v: (B, Hkv, Sk, D). Heads are grouped (B, Hkv, G, ...)
    so each K/V head broadcasts over its G query heads; dk, dv sum over the group.
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
    for start in range(0, Sq, _BWD_CHUNK):
        rows = slice(start, min(Sq, start + _BWD_CHUNK))
        keep = torch.ones((1, 1, 1, 1, Sk), dtype=torch.bool, device=q.device)
        if causal:  # end-aligned, as in the kernel
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            keep = keep & (j[None, :] <= i + (Sk - Sq))
        if keep_k is not None:
            keep = keep & keep_k[:, None, None, None, :]
        s = torch.matmul(qf[..., rows, :], kf.transpose(-1, -2)) * scale  # (B, Hkv, G, c, Sk)
        p = torch.where(keep, torch.exp(s - lse[..., rows, None]), torch.zeros_like(s))
        dp = torch.matmul(dof[..., rows, :], vf.transpose(-1, -2))
        ds = p * (dp - delta[..., rows, None])
        dq[..., rows, :] = torch.matmul(ds, kf) * scale
        # group and rows contracted in one matmul: (B, Hkv, Sk, G c) @ (B, Hkv, G c, D)
        dk += torch.matmul(ds.flatten(2, 3).transpose(-1, -2), qf[..., rows, :].flatten(2, 3)) * scale
        dv += torch.matmul(p.flatten(2, 3).transpose(-1, -2), dof[..., rows, :].flatten(2, 3))
    return dq.flatten(1, 2), dk, dv


def _block_bwd_triton(do, q, k, v, out, lse, keep_k, causal: bool, scale: float):
    from cuboid.kernels.flash_attention import attention_backward

    return attention_backward(do, q, k, v, out, lse, causal=causal, scale=scale, key_padding_mask=keep_k)


# ----------------------------------------------------------------- ring attention


class _RingAttention(torch.autograd.Function):
    """Zigzag ring attention; forward and backward are each one pass of sp ring steps."""

    @staticmethod
    def forward(ctx, q, k, v, mask, group, causal: bool, scale: float, backend: str):
        sp, r = comm.group_size(group), comm.group_rank(group)
        c = q.shape[2] // 2
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        masks = [None] * sp  # every block's mask, kept for backward (B x T bools in all)
        kb, vb, mb = k, v, mask
        out = lse = None
        for t in range(sp):
            s = (r - t) % sp
            masks[s] = mb
            nxt = None
            if t < sp - 1:  # the next block travels while this one is computed
                nxt = _Exchange([kb, vb] + ([] if mb is None else [mb.view(torch.uint8)]), group, _TAG_KV)
            for qs, ks, blk_causal in _blocks(r, s, causal, c):
                o, l = kernels.attention(q[:, :, qs], kb[:, :, ks], vb[:, :, ks], causal=blk_causal,
                                         key_padding_mask=None if mb is None else mb[:, ks], scale=scale,
                                         return_lse=True, backend=backend)
                if out is None:  # step 0 covers every query row
                    out, lse = o.to(acc), l.to(acc)
                else:
                    _merge(out[:, :, qs], lse[:, :, qs], o, l.to(acc))
            if nxt is not None:
                got = nxt.wait()
                kb, vb = got[0], got[1]
                mb = None if mask is None else got[2].view(torch.bool)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.masks, ctx.group, ctx.causal, ctx.scale, ctx.backend = masks, group, causal, scale, backend
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        sp, r = comm.group_size(group), comm.group_rank(group)
        c = q.shape[2] // 2
        acc = lse.dtype
        do = dout.to(out.dtype).contiguous()
        triton = ctx.backend == "triton"
        delta = None if triton else (do.to(acc) * out.to(acc)).sum(-1)  # (B, H, S): rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kb, vb = k, v
        home = None  # the dK, dV accumulators in flight
        for t in range(sp):
            s = (r - t) % sp
            nxt = _Exchange([kb, vb], group, _TAG_KV) if t < sp - 1 else None
            gk = torch.zeros(kb.shape, dtype=acc, device=q.device)
            gv = torch.zeros(vb.shape, dtype=acc, device=q.device)
            mb = ctx.masks[s]
            for qs, ks, blk_causal in _blocks(r, s, causal, c):
                keep = None if mb is None else mb[:, ks]
                if triton:
                    a, b, d = _block_bwd_triton(do[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                                out[:, :, qs], lse[:, :, qs], keep, blk_causal, scale)
                else:
                    a, b, d = _block_bwd_torch(do[:, :, qs], q[:, :, qs], kb[:, :, ks], vb[:, :, ks],
                                               delta[:, :, qs], lse[:, :, qs], keep, blk_causal, scale)
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
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _check_qkv(q, k, v, key_padding_mask, what: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{what}: {name} must be a 4-D tensor (batch, heads, seq, head_dim)")
    B, H, S, D = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (B, S, D):
        raise ValueError(f"{what}: k and v must have one shape (batch, kv heads, seq, head_dim) matching q's "
                         f"batch, seq and head_dim, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"{what}: q's {H} heads must be a multiple of k/v's {k.shape[1]} heads "
                         f"(grouped-query attention).")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"{what}: key_padding_mask must be a bool tensor (True = keep)")
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"{what}: key_padding_mask must be (batch, local seq) = {(B, S)}, "
                             f"got {tuple(key_padding_mask.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                   key_padding_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """This rank's rows of the attention of the whole sequence, K/V passed around the ``group`` ring.

    Args:
        q: (B, H, T/sp, D), k, v: (B, Hkv, T/sp, D) with H a multiple of Hkv,
            this rank's tokens in the zigzag layout. Only the Hkv K/V heads
            travel the ring.
        group: the sp process group (``None`` or one rank: plain attention).
        causal: causal attention over global positions.
        key_padding_mask: (B, T/sp) bool, True = keep, zigzag layout like q.
        scale: softmax scale, default 1 / sqrt(D).

    Returns (B, H, T/sp, D) in q's dtype, differentiable w.r.t. q, k, v.
    """
    _check_qkv(q, k, v, key_padding_mask, "ring_attention")
    if not isinstance(causal, bool):
        raise TypeError(f"ring_attention: causal must be a bool, got {type(causal).__name__}")
    if not comm._active(group):
        return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
    if causal and q.shape[2] % 2:
        raise ValueError(f"ring_attention: a zigzag shard holds two equal chunks, got an odd length {q.shape[2]}")
    backend = kernels.resolve_backend("attention", [q, k, v, key_padding_mask])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale  # the kernel's default, bit for bit
    mask = None if key_padding_mask is None else key_padding_mask.contiguous()
    return _RingAttention.apply(q, k, v, mask, group, causal, scale, backend)


# ----------------------------------------------------------------- all-to-all attention


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                         key_padding_mask: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                         layout: str = "contiguous") -> torch.Tensor:
    """This rank's rows of the whole-sequence attention by a head/sequence all-to-all (Ulysses).

    Args:
        q: (B, H, T/sp, D), k, v: (B, Hkv, T/sp, D), this rank's tokens in
            ``layout``; H and Hkv divisible by sp, H a multiple of Hkv.
        group: the sp process group (``None`` or one rank: plain attention).
        causal: causal attention over global positions.
        key_padding_mask: (B, T/sp) bool, True = keep, same layout as q.
        layout: ``"contiguous"`` (rank i holds tokens [i T/sp, (i+1) T/sp)) or
            ``"zigzag"`` (as :func:`ring_attention`).

    Returns (B, H, T/sp, D) in the same layout, differentiable w.r.t. q, k, v.
    """
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"all_to_all_attention: layout must be 'contiguous' or 'zigzag', got {layout!r}")
    _check_qkv(q, k, v, key_padding_mask, "all_to_all_attention")
    sp = comm.group_size(group)
    if not comm._active(group):
        return kernels.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale)
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
    by_rank = torch.cat([t.unflatten(1, (sp, t.shape[1] // sp)) for t in (q, k, v)], dim=2)  # (B, sp, h, S, D)
    qkv = comm.all_to_all(by_rank.flatten(1, 2), group, scatter_dim=1, gather_dim=2)  # (B, (H + 2 Hkv)/sp, T, D)
    mask = None
    if key_padding_mask is not None:
        shards = [m.view(torch.bool) for m in comm.all_gather_list(key_padding_mask.view(torch.uint8), group)]
        mask = zigzag_merge(shards, sp, dim=1) if layout == "zigzag" else torch.cat(shards, dim=1)  # (B, T)
    if layout == "zigzag":  # rank order -> global order
        qkv = zigzag_merge(list(qkv.chunk(sp, dim=2)), sp, dim=2)
    # (B, H/sp, T, D) and (B, Hkv/sp, T, D): the whole sequence for this rank's heads
    qa, ka, va = qkv.split([H // sp, Hkv // sp, Hkv // sp], dim=1)
    out = kernels.attention(qa, ka, va, causal=causal, key_padding_mask=mask, scale=scale)
    if layout == "zigzag":  # global order -> rank order
        out = torch.cat([zigzag_split(out, sp, i, dim=2) for i in range(sp)], dim=2)
    return comm.all_to_all(out, group, scatter_dim=2, gather_dim=1)
