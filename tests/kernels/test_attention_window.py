"""Sliding-window attention (``window``) in cuboid.kernels.attention: Triton (interpreter on CPU) against the
reference, the reference against float64, the CPU SDPA path's banded mask, and tiles left of the band never read.

A query ``i`` sees keys ``i + Sk - Sq - window < j`` (and, causal, ``j <= i + Sk - Sq``): transformers' sliding
window. The interpreter's tiles are BLOCK_M = 32 queries x BLOCK_N = 64 keys (flash_attention._config), so the
windows below are 1, a key tile (64), a query tile (32), not a tile multiple (45) and longer than the sequence.
Sizes are small: the interpreter runs programs one after another.
"""
import pytest
import torch

from cuboid.kernels.flash_attention import attention, attention_ref
from tests.kernels.test_attention_packed import doc_ids
from tests.kernels.test_flash_attention import (F16, F32, F64, GRAD_TOL, TOL, assert_lse_close, attention_mod,
                                                compare_with_ref, fwd_bwd, leaf_copy, make_inputs)


def band(Sq, Sk, window, shift=0):
    """(Sq, Sk) bool: query i keeps key j iff j > i + Sk - Sq + shift - window."""
    i = torch.arange(Sq)[:, None]
    return torch.arange(Sk)[None, :] > i + (Sk - Sq) + shift - window


def naive_window64(q, k, v, causal=False, mask=None, docs=None, window=None, shift=0, return_lse=True):
    """float64, full (Sq x Sk) softmax with the band, as :func:`naive64`: empty rows give out 0, lse -inf."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    B, Sq, Sk = q.shape[0], q.shape[2], k.shape[2]
    keep = torch.ones(B, Sq, Sk, dtype=torch.bool)
    if window is not None:
        keep = keep & band(Sq, Sk, window, shift)
    if causal:
        keep = keep & (torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq))
    if mask is not None:
        keep = keep & mask[:, None, :]
    if docs is not None:
        keep = keep & (docs[0][:, :, None] == docs[1][:, None, :])
    keep = keep[:, None]  # (B, 1, Sq, Sk)
    s = torch.einsum("bhid,bhjd->bhij", q, k) / q.shape[3] ** 0.5
    empty = ~keep.any(-1)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty[..., None], 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(~keep, 0.0)
    return p @ v, torch.logsumexp(s, dim=-1).masked_fill(empty, float("-inf"))


def check_window_vs_ref(q, k, v, causal, window, docs=None, mask=None, shift=0):
    """Triton against the reference (fp32 copies), the reference against float64; returns Triton's (out, lse)."""
    kw = dict(causal=causal, key_padding_mask=mask, window=window, window_shift=shift)
    if docs is not None:
        kw.update(doc_ids=docs[0], doc_ids_k=docs[1])
    out, lse, grads = fwd_bwd(attention, q, k, v, backend="triton", **kw)
    r, (rout, rlse, rgrads) = compare_with_ref((out, lse, grads), q, k, v, **kw)
    h = [leaf_copy(t, F64) for t in r]
    nout, nlse, ngrads = fwd_bwd(naive_window64, *h, causal=causal, mask=mask, docs=docs, window=window,
                                 shift=shift)
    torch.testing.assert_close(rout.double(), nout, atol=1e-5, rtol=1e-5)
    assert_lse_close(rlse, nlse, atol=1e-5, rtol=1e-5)
    for a, b in zip(rgrads, ngrads):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)
    return out, lse


# (window, H, Hkv, dtype): 1, a key tile, a query tile, not a tile multiple, longer than the sequence
WINDOWS = [(1, 4, 2, F32), (64, 4, 2, F32), (32, 2, 1, F16), (45, 4, 1, F32), (500, 2, 2, F32)]
WIN_IDS = [f"w{w}-h{h}kv{kv}-{str(d)[6:]}" for w, h, kv, d in WINDOWS]


@pytest.mark.parametrize("window,H,Hkv,dtype", WINDOWS, ids=WIN_IDS)
def test_window_matches_reference_and_float64(window, H, Hkv, dtype):
    q, k, v, m = make_inputs(2, H, 150, 150, 16, dtype, "pad", Hkv=Hkv)
    check_window_vs_ref(q, k, v, True, window, mask=m)


# packed rows: documents shorter and longer than the windows, boundaries inside tiles and on their edges
PACKED = doc_ids([31, 1, 70, 48], [150], [1, 45, 64, 40])


@pytest.mark.parametrize("window,H,Hkv,dtype", WINDOWS, ids=WIN_IDS)
def test_window_on_packed_rows(window, H, Hkv, dtype):
    q, k, v, _ = make_inputs(3, H, 150, 150, 16, dtype, Hkv=Hkv)
    check_window_vs_ref(q, k, v, True, window, docs=(PACKED, PACKED))


def test_window_inside_a_document_counts_its_positions():
    # one packed row and the same documents one per row: each document's queries see the same keys either way
    docs = doc_ids([40, 30, 50])
    q, k, v, _ = make_inputs(1, 2, 120, 120, 16, Hkv=1)
    packed = attention(q, k, v, causal=True, doc_ids=docs, window=7, backend="triton")
    for a, b in ((0, 40), (40, 70), (70, 120)):
        alone = attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal=True, window=7, backend="triton")
        torch.testing.assert_close(packed[:, :, a:b], alone, **TOL[F32])


@pytest.mark.parametrize("Sq,Sk", [(40, 150), (150, 150)])
@pytest.mark.parametrize("shift", [0, 70])
def test_window_shift_non_causal_chunks(Sq, Sk, shift):
    """Ring attention's chunk pairs: the queries sit ``shift`` positions right of end alignment; a non-causal
    call keeps only the band's left bound; queries with no key left give out 0, lse -inf."""
    q, k, v, _ = make_inputs(1, 4, Sq, Sk, 16, Hkv=2)
    out, lse = check_window_vs_ref(q, k, v, False, 30, shift=shift)
    if shift == 70 and Sq == Sk:  # query i keeps keys j > i + 40: rows from 109 on see none
        assert torch.isneginf(lse[:, :, 109:]).all() and not out[:, :, 109:].any()


def test_tiles_left_of_the_window_are_never_read():
    """Skipped, not masked: a kernel that read a tile a query (or key) tile does not need would spread its NaN
    through a tl.dot even where the mask drops the scores. Window 32, BLOCK_M 32, BLOCK_N 64:

    - NaN in the first 64 tokens (q, k, v, dO): the queries from 96 on start their key loop at key 64, so
      their out, lse and dq are exact, and so are dk, dv of keys 128.. (their query tiles are clean);
    - NaN in the q and dO of the last 64 tokens: dK/dV of keys 0..63 loop over queries 0..94 only (the
      band's right end), so they are exact, as are out and dq of the first 96 queries.
    """
    q, k, v, _ = make_inputs(1, 2, 192, 192, 16)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    want_out = attention_ref(q, k, v, causal=True, window=32)
    want = torch.autograd.grad(want_out, (q, k, v), go)
    cases = ((slice(0, 64), slice(96, None), slice(128, None)), (slice(128, None), slice(0, 96), slice(0, 64)))
    for rows, keep_q, keep_k in cases:
        poisoned = [t.detach().clone() for t in (q, k, v)]
        for t in poisoned if rows.start == 0 else poisoned[:1]:
            t[:, :, rows] = float("nan")
        poisoned = [t.requires_grad_() for t in poisoned]
        g = go.clone()
        g[:, :, rows] = float("nan")
        out, lse = attention(*poisoned, causal=True, window=32, return_lse=True, backend="triton")
        grads = torch.autograd.grad([out, lse], poisoned, [g, torch.zeros_like(lse)])
        torch.testing.assert_close(out[:, :, keep_q], want_out[:, :, keep_q], **TOL[F32])
        for name, a, b, keep in zip("qkv", grads, want, (keep_q, keep_k, keep_k)):
            torch.testing.assert_close(a[:, :, keep], b[:, :, keep], **GRAD_TOL[F32], msg=lambda s: f"d{name}: {s}")


def test_reference_window_matches_float64():
    q, k, v, m = make_inputs(3, 4, 90, 90, 8, F64, "random", Hkv=2)
    for causal, chunk in ((True, 1024), (True, 25), (False, 40)):
        docs = (PACKED[:, :90], PACKED[:, :90])
        got = fwd_bwd(attention_ref, q, k, v, causal=causal, key_padding_mask=m, doc_ids=docs[0], window=13,
                      chunk_size=chunk)
        want = fwd_bwd(naive_window64, q, k, v, causal=causal, mask=m, docs=docs, window=13)
        torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=1e-10)
        assert_lse_close(got[1], want[1], atol=1e-12, rtol=1e-10)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def _counting_sdpa(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q, k, v, **kw):
        calls.append((q.shape[2], kw.get("attn_mask"), kw.get("is_causal")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("packed", [False, True])
def test_torch_path_passes_a_banded_mask(monkeypatch, packed):
    calls = _counting_sdpa(monkeypatch)
    q, k, v, _ = make_inputs(3, 4, 150, 150, 16, Hkv=2)
    docs = PACKED if packed else None
    out = attention(q, k, v, causal=True, window=20, doc_ids=docs, backend="torch")
    assert calls and all(m is not None and m.dtype == torch.bool and not c for _, m, c in calls)
    if packed:  # one call per document, each with its own band
        assert [n for n, _, _ in calls] == [31, 1, 70, 48, 150, 1, 45, 64, 40]
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * go).sum(), (q, k, v))
    h = [leaf_copy(t, F64) for t in (q, k, v)]
    nout = naive_window64(*h, causal=True, docs=None if docs is None else (docs, docs), window=20)[0]
    ngrads = torch.autograd.grad((nout * go.double()).sum(), h)
    torch.testing.assert_close(out.double(), nout, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ngrads):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


def test_torch_path_keeps_the_fast_path_when_the_window_covers_the_sequence(monkeypatch):
    calls = _counting_sdpa(monkeypatch)
    q, k, v, _ = make_inputs(2, 2, 40, 40, 16)
    out = attention(q, k, v, causal=True, window=40, backend="torch")
    assert len(calls) == 1 and calls[0][1] is None and calls[0][2]  # SDPA's own causal path, no mask built
    torch.testing.assert_close(out, attention(q, k, v, causal=True, backend="torch"))
    step = attention(q[:, :, -1:], k, v, causal=True, window=3, backend="torch")  # a decoding step: 3 keys
    torch.testing.assert_close(step, attention(q[:, :, -1:], k[:, :, -3:], v[:, :, -3:], backend="torch"))


def test_window_without_effect_launches_the_plain_kernel(monkeypatch):
    seen = []
    real = attention_mod._flash_fwd
    monkeypatch.setattr(attention_mod, "_flash_fwd", lambda *a: seen.append(a[-1]) or real(*a))
    q, k, v, _ = make_inputs(1, 2, 20, 20, 16)
    attention(q, k, v, causal=True, window=20, backend="triton")
    attention(q, k, v, causal=True, window=19, backend="triton")
    assert seen == [None, -18]  # the band's bound: query i keeps keys j >= i - 18


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("window,exc", [(0, ValueError), (-3, ValueError), (2.0, ValueError), (True, ValueError)])
def test_bad_window(backend, window, exc):
    q, k, v, _ = make_inputs(1, 2, 8, 8, 16)
    with pytest.raises(exc, match="window must be an int >= 1"):
        attention(q, k, v, causal=True, window=window, backend=backend)


def test_attention_core_carries_its_window():
    from cuboid.parallel.layers import Attention

    q, k, v, _ = make_inputs(2, 4, 30, 30, 16, Hkv=2)
    core = Attention(window=5)
    assert core.window == 5 and Attention().window is None and "window=5" in repr(core)
    want = attention(q, k, v, causal=True, window=5, backend="torch")
    torch.testing.assert_close(core(q, k, v, causal=True), want)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        Attention(window=0)
