"""Attention's argument checks and its plain-torch path (the reference, and the CPU path).

:func:`attention_ref` is the reference the Triton kernels of
:mod:`.flash_attention` are tested against, computed in fp32 (float64 stays
float64) in query chunks; :func:`sdpa_attention` is the fast torch path where
no log-sum-exp is wanted (torch's fused SDPA; packed rows on CPU one document
at a time). Conventions (layout, end-aligned causal, masks, document ids) are
:mod:`.flash_attention`'s, whose :func:`~.flash_attention.attention` chooses
the backend.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ._backend import check_floating, check_same_dtype

_OP = "attention"


def validate(q, k, v, causal, key_padding_mask, scale, *, triton_path: bool) -> float:
    """Check the arguments; return the softmax scale to use."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    if not triton_path:
        dtypes = dtypes + (torch.float64,)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_floating(_OP, name, t, dtypes)
    check_same_dtype(_OP, q=q, k=k, v=v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"{_OP}: q, k, v must share batch (dim 0), got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{_OP}: q and k must share head_dim (dim 3), got {q.shape[3]} and {k.shape[3]} "
                         f"(v's may differ)")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"{_OP}: k and v must share heads (dim 1), got {k.shape[1]} and {v.shape[1]}")
    if k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{_OP}: q's {q.shape[1]} heads must be a multiple of k/v's {k.shape[1]} heads "
                         f"(grouped-query attention).")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"{_OP}: k and v must have the same sequence length, got {k.shape[2]} and {v.shape[2]}")
    if q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"{_OP}: sequence lengths must be >= 1, got Sq={q.shape[2]}, Sk={k.shape[2]}")
    if not isinstance(causal, bool):
        raise TypeError(f"{_OP}: causal must be a bool, got {type(causal).__name__}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
            raise TypeError(f"{_OP}: key_padding_mask must be a bool tensor (True = keep), got {got}")
        want = (q.shape[0], k.shape[2])
        if tuple(key_padding_mask.shape) != want:
            raise ValueError(f"{_OP}: key_padding_mask must have shape (batch, seq_k) = {want}, "
                             f"got {tuple(key_padding_mask.shape)}")
    D = q.shape[3]
    for name, d in (("head_dim", D), ("v's head_dim", v.shape[3])):
        if triton_path and not 16 <= d <= 256:
            raise ValueError(f"{_OP}: the Triton kernel supports {name} 16..256, got {d} (use backend='torch')")
        if d < 1:
            raise ValueError(f"{_OP}: {name} must be >= 1, got {d}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{_OP}: scale must be a positive number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{_OP}: scale must be positive and finite, got {scale}")
    return float(scale)


def check_sinks(sinks, q) -> Optional[torch.Tensor]:
    """``sinks`` as given (None, or (H,) float on q's device, one logit per query head); raises on a bad one.

    A sink is gpt-oss's learned logit that joins every softmax's denominator
    and contributes no value: ``out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} +
    e^{sink_h})``, whatever the mask keeps (a row with no kept key gives 0).
    """
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"{_OP}: sinks must be a float tensor (one logit per query head), got {got}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"{_OP}: sinks must have shape (heads,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"{_OP}: sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks


def check_docs(q, k, doc_ids, doc_ids_k) -> Optional[tuple]:
    """(doc_q (B, Sq), doc_k (B, Sk)) as given, or None without documents; raises on a bad argument.

    Non-decreasing ids are checked on the device (``torch._assert_async``: an
    error at once on CPU, a device-side assert on CUDA), never with a host sync.
    """
    if doc_ids is None:
        if doc_ids_k is not None:
            raise ValueError(f"{_OP}: doc_ids_k (the keys' document ids) needs doc_ids (the queries')")
        return None
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    if doc_ids_k is None:
        if Sq != Sk:
            raise ValueError(f"{_OP}: doc_ids alone serves q and k of one length; Sq={Sq} != Sk={Sk}: "
                             f"pass the keys' ids as doc_ids_k")
        doc_ids_k = doc_ids
    for name, t, want in (("doc_ids", doc_ids, (B, Sq)), ("doc_ids_k", doc_ids_k, (B, Sk))):
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
                or t.dtype == torch.bool:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{_OP}: {name} must be an integer tensor of document ids, got {got}")
        if tuple(t.shape) != want:
            raise ValueError(f"{_OP}: {name} must have shape {want} (batch, seq), got {tuple(t.shape)}")
        if not t.is_meta and t.shape[1] > 1:
            torch._assert_async((t[:, 1:] >= t[:, :-1]).all(),
                                f"{_OP}: {name} must be non-decreasing along each row (documents one after another)")
    return doc_ids, doc_ids_k


def check_window(window, window_shift, q, k) -> Optional[int]:
    """The window's left bound as a diagonal offset ``lo``: query ``i`` keeps keys ``j >= i + lo``; None when
    there is no window or it drops no key of these shapes (the paths without a window then apply).

    ``window`` W (int >= 1): with end alignment query ``i`` sits at key index
    ``i + Sk - Sq``, and it sees the W keys ending there (``i + Sk - Sq - W <
    j``), transformers' sliding window. ``window_shift`` (int): the queries sit
    that many positions further right of the keys than end alignment says
    (ring attention's chunk pairs), so ``lo = Sk - Sq + window_shift - W + 1``.
    """
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{_OP}: window must be an int >= 1 (keys a query sees, itself included) or None, "
                         f"got {window!r}")
    if isinstance(window_shift, bool) or not isinstance(window_shift, int):
        raise TypeError(f"{_OP}: window_shift must be an int, got {type(window_shift).__name__}")
    lo = k.shape[2] - q.shape[2] + window_shift - window + 1
    return None if lo <= -(q.shape[2] - 1) else lo  # every (i, j) has j - i >= -(Sq - 1): no key dropped


def window_keep(lo: Optional[int], rows: range, Sk: int, device) -> Optional[torch.Tensor]:
    """(len(rows), Sk) bool: key ``j >= i + lo`` for the query rows ``rows``; None without a window."""
    if lo is None:
        return None
    i = torch.arange(rows.start, rows.stop, device=device)[:, None]
    return torch.arange(Sk, device=device)[None, :] >= i + lo


def doc_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) int32 document ids of packed rows from position ids that restart at 0 at each document.

    Hugging Face's convention for packed rows (``DataCollatorWithFlattening``):
    a new document starts where the position is 0. Ids count documents from
    the row's start, so they are non-decreasing, as :func:`attention` needs;
    compute them on whole rows before splitting a sequence into chunks.
    """
    return torch.cumsum(position_ids == 0, dim=-1, dtype=torch.int32)


def _ref_chunk(q, k, v, keep, scale: float, sink=None):
    """Softmax attention for one chunk of queries, heads grouped.

    ``q`` is (B, Hkv, G, c, D), ``k``/``v`` (B, Hkv, 1, Sk, D) / (B, Hkv, 1, Sk, Dv): the matmuls
    broadcast each K/V head over its G query heads (no copies), and autograd
    sums dK/dV over the group. ``keep`` broadcasts to (B, Hkv, G, c, Sk).
    ``sink`` (1, Hkv, G, 1, 1) or None: one more logit in each row's denominator (lse includes it).
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (B, Hkv, G, c, Sk)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    if sink is not None:
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # empty rows: shift by 0
    p = torch.exp(s - m)  # unnormalized; exactly 0 where masked
    l = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        l = l + torch.exp(sink - m)
    empty = l == 0
    l_safe = torch.where(empty, torch.ones_like(l), l)
    out = torch.matmul(p, v) / l_safe
    lse = torch.where(empty, torch.full_like(l, float("-inf")), m + torch.log(l_safe))
    return out, lse.squeeze(-1)


def attention_ref(q, k, v, *, causal: bool = False, key_padding_mask: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None, return_lse: bool = False, doc_ids: Optional[torch.Tensor] = None,
                  doc_ids_k: Optional[torch.Tensor] = None, chunk_size: int = 1024, window: Optional[int] = None,
                  window_shift: int = 0, sinks: Optional[torch.Tensor] = None):
    """Plain-torch attention with the same conventions as :func:`attention`.

    Computes in fp32 (halves are upcast; float64 stays float64), queries in
    chunks of ``chunk_size`` so that at most a (B, H, chunk, Sk) score matrix is
    live; when gradients are needed and there are several chunks, each chunk is
    recomputed in backward (activation checkpointing) so memory stays bounded
    there too. Document ids make the mask block-diagonal (query and key in one
    document); a ``window`` bands it (:func:`check_window`); ``sinks`` (H,) add
    one logit per head to every row's denominator (:func:`check_sinks`; the
    lse then includes it). Differentiable by autograd, including through
    ``lse`` and into ``sinks``.
    """
    scale = validate(q, k, v, causal, key_padding_mask, scale, triton_path=False)
    sinks = check_sinks(sinks, q)
    docs = check_docs(q, k, doc_ids, doc_ids_k)
    lo = check_window(window, window_shift, q, k)
    if chunk_size < 1:
        raise ValueError(f"{_OP}: chunk_size must be >= 1, got {chunk_size}")
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    # heads grouped: q (B, Hkv, G, Sq, D), k, v (B, Hkv, 1, Sk, D); query head h = hkv * G + g
    qf = q.to(cdt).unflatten(1, (Hkv, H // Hkv))
    kf, vf = k.to(cdt).unsqueeze(2), v.to(cdt).unsqueeze(2)
    key_keep = None if key_padding_mask is None else key_padding_mask[:, None, None, None, :]  # (B, 1, 1, 1, Sk)
    sink = None if sinks is None else sinks.to(cdt).view(1, Hkv, H // Hkv, 1, 1)
    checkpoint = Sq > chunk_size and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sinks))
    outs, lses = [], []
    for start in range(0, Sq, chunk_size):
        stop = min(Sq, start + chunk_size)
        keep = torch.ones((1, 1, 1, stop - start, Sk), dtype=torch.bool, device=q.device)
        if causal:
            i = torch.arange(start, stop, device=q.device)[:, None]
            j = torch.arange(Sk, device=q.device)[None, :]
            keep = keep & (j <= i + (Sk - Sq))
        if lo is not None:
            keep = keep & window_keep(lo, range(start, stop), Sk, q.device)
        if key_keep is not None:
            keep = keep & key_keep
        if docs is not None:  # (B, 1, 1, c, Sk): block-diagonal
            keep = keep & (docs[0][:, None, None, start:stop, None] == docs[1][:, None, None, None, :])
        if checkpoint:
            o, l = torch.utils.checkpoint.checkpoint(_ref_chunk, qf[:, :, :, start:stop], kf, vf, keep, scale,
                                                     sink, use_reentrant=False)
        else:
            o, l = _ref_chunk(qf[:, :, :, start:stop], kf, vf, keep, scale, sink)
        outs.append(o)
        lses.append(l)
    out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)).flatten(1, 2).to(q.dtype)
    if not return_lse:
        return out
    lse = (lses[0] if len(lses) == 1 else torch.cat(lses, dim=3)).flatten(1, 2)
    return out, lse


def sdpa_attention(q, k, v, causal: bool, key_padding_mask: Optional[torch.Tensor], scale: float,
                    docs: Optional[tuple] = None, window_lo: Optional[int] = None):
    """The fast torch path when no lse is wanted: torch's fused SDPA, or None where it does not apply.

    SDPA has no lse output and its fully-masked rows are NaN, so rows without a
    kept key (padded-out batches, causal with Sq > Sk, a query whose document
    has no key) and float64 go to :func:`attention_ref` instead. SDPA's
    ``is_causal`` is top-left aligned, so an end-aligned causal mask with
    Sq != Sk is passed explicitly. Documents pass a (B, 1, Sq, Sk) block-diagonal mask, a window
    (``window_lo``, :func:`check_window`'s offset) a banded one.
    """
    Sq, Sk = q.shape[2], k.shape[2]
    if q.dtype == torch.float64 or (causal and Sq > Sk):
        return None
    traced = torch.compiler.is_compiling()  # no host reads: rows without a key are handled in the graph
    if docs is not None and docs[0] is docs[1] and key_padding_mask is None and q.device.type == "cpu" \
            and not q.is_meta and not traced:
        lengths = _document_lengths(docs[0])
        if lengths is not None:
            return _sdpa_per_document(q, k, v, lengths, causal, scale, window_lo)
        docs = None  # one document a row: the ids change nothing
    if key_padding_mask is not None and not key_padding_mask.is_meta and not traced \
            and not bool(key_padding_mask.any(dim=1).all()):
        return None
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, Sk)
    if docs is not None:
        same = docs[0][:, None, :, None] == docs[1][:, None, None, :]  # (B, 1, Sq, Sk)
        mask = same if mask is None else mask & same
    if window_lo is not None:
        band = window_keep(window_lo, range(0, Sq), Sk, q.device)  # (Sq, Sk)
        mask = band if mask is None else mask & band
    if causal and Sq == 1:  # one query, end-aligned: it sees every key (a decoding step), no mask to build
        causal = False
    if causal and (Sq != Sk or mask is not None):
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        keep = j <= i + (Sk - Sq)  # (Sq, Sk)
        mask = keep if mask is None else mask & keep
        causal = False
    gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}  # no K/V repeat on the fused kernels
    if traced and mask is not None:
        # a row without a kept key attends every key instead (no NaN), and its output is set to 0: zero gradients
        # flow back through it, as attention_ref gives
        has = mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~has, is_causal=causal, scale=scale, **gqa)
        return torch.where(has, out, torch.zeros((), dtype=out.dtype, device=out.device))
    if (docs is not None or window_lo is not None) and not mask.is_meta and not bool(mask.any(dim=-1).all()):
        return None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, **gqa)


def _document_lengths(doc_ids: torch.Tensor) -> Optional[list]:
    """The lengths of the documents of (B, S) rows, row after row (one host read), or None when each row is
    one document."""
    B = doc_ids.shape[0]
    low, high = doc_ids.min(), doc_ids.max()
    rows = torch.arange(B, device=doc_ids.device)[:, None] * (high - low + 1)  # each row's ids apart
    _, counts = torch.unique_consecutive((rows + doc_ids - low).flatten(), return_counts=True)
    return counts.tolist() if counts.numel() > B else None


def _sdpa_per_document(q, k, v, lengths: list, causal: bool, scale: float, window_lo: Optional[int] = None):
    """Self-attention of packed rows on CPU, one SDPA call per document (``lengths``, row after row): the
    cost is the sum of the documents' squares, as in the Triton kernels, instead of the row's square under a
    block-diagonal mask. Every slice is a view; autograd carries the gradients back through the concatenation.
    A window (``window_lo``, Sq == Sk here) bands each document's own square: index differences inside a
    document are its position differences.
    """
    B, S = q.shape[0], q.shape[2]
    i = 0
    gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}
    out_rows = []
    for b in range(B):
        parts, pos = [], 0
        while pos < S:
            e, i = pos + lengths[i], i + 1
            band = window_keep(window_lo, range(0, e - pos), e - pos, q.device)
            if band is not None and causal:
                band = band & torch.ones_like(band).tril()
            parts.append(F.scaled_dot_product_attention(q[b:b + 1, :, pos:e], k[b:b + 1, :, pos:e],
                                                        v[b:b + 1, :, pos:e], attn_mask=band,
                                                        is_causal=causal and band is None, scale=scale, **gqa))
            pos = e
        out_rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return torch.cat(out_rows, dim=0)
