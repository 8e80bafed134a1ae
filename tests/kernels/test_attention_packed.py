"""cuboid.kernels.flash_attention on packed rows (document ids): Triton (interpreter on CPU) against the reference,
the reference against float64, gradients that stay inside a document, and tiles no document spans never read.

Sizes are small on purpose: the interpreter runs programs one after another. The interpreter's tiles are
BLOCK_M = 32 queries x BLOCK_N = 64 keys (flash_attention._config): the layouts below put document boundaries
inside tiles and on their edges.
"""
import pytest
import torch

from cuboid.kernels.flash_attention import attention, attention_ref
from tests.kernels.test_flash_attention import (BF16, F16, F32, F64, GRAD_TOL, TOL, _bad, assert_lse_close,
                                                attention_mod, compare_with_ref, fwd_bwd, leaf_copy, make_inputs,
                                                naive64)


def doc_ids(*rows):
    """(B, S) int64 document ids from each row's document lengths (rows of one total length)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


# three layouts in one batch of 100 tokens: boundaries inside a tile (31) and on tile edges (32 = BLOCK_M,
# 64 = BLOCK_N), a row that is one document, documents of length 1 (at the start, inside, at the end)
LAYOUT = doc_ids([31, 1, 32, 36], [100], [1, 1, 40, 1, 56, 1])

# (H, Hkv, causal, dtype)
DOC_CASES = [(4, 2, True, F32), (2, 2, False, F32), (2, 1, True, F16), (4, 2, False, F16)]


def check_docs_vs_ref(q, k, v, docs, causal, mask=None):
    """Triton against the reference on fp32 copies, and the reference against float64, for one doc layout."""
    kw = dict(causal=causal, key_padding_mask=mask, doc_ids=docs[0], doc_ids_k=docs[1])
    out, lse, grads = fwd_bwd(attention, q, k, v, backend="triton", **kw)
    r, (rout, rlse, rgrads) = compare_with_ref((out, lse, grads), q, k, v, **kw)
    h = [leaf_copy(t, F64) for t in r]
    dev = (docs[0].to(q.device), docs[1].to(q.device))
    nout, nlse, ngrads = fwd_bwd(naive64, *h, causal=causal, mask=mask, docs=dev)
    torch.testing.assert_close(rout.double(), nout, atol=1e-5, rtol=1e-5)
    assert_lse_close(rlse, nlse, atol=1e-5, rtol=1e-5)
    for a, b in zip(rgrads, ngrads):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)
    return out, lse


@pytest.mark.parametrize("H,Hkv,causal,dtype", DOC_CASES,
                         ids=[f"h{h}kv{kv}-{'causal' if c else 'full'}-{str(d)[6:]}" for h, kv, c, d in DOC_CASES])
def test_packed_rows_match_reference_and_float64(H, Hkv, causal, dtype):
    q, k, v, _ = make_inputs(3, H, 100, 100, 16, dtype, Hkv=Hkv)
    check_docs_vs_ref(q, k, v, (LAYOUT, LAYOUT), causal)


def test_packed_rows_with_padding_and_other_block_sizes(monkeypatch):
    # a padded tail as its own document, masked out; tiles where BLOCK_N < BLOCK_M
    real = attention_mod._config
    monkeypatch.setattr(attention_mod, "_config", lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=32, BLOCK_N=16))
    docs = doc_ids([20, 17, 1, 30, 12], [50, 30])
    mask = torch.ones(2, 80, dtype=torch.bool)
    mask[0, 68:] = False
    q, k, v, _ = make_inputs(2, 2, 80, 80, 32, Hkv=1)
    check_docs_vs_ref(q, k, v, (docs, docs), True, mask=mask)


def test_chunks_with_their_own_document_ids_merge_by_lse():
    """Ring attention's case: queries of one slice of a packed row against key chunks with their own ids.

    Some queries' documents have no key in a chunk (out 0, lse -inf there); merged by lse, the chunks give
    the whole row's attention of those queries.
    """
    row = doc_ids([10, 45, 1, 34, 50, 20])  # 160 tokens, 6 documents
    q, k, v, _ = make_inputs(1, 4, 160, 160, 16, Hkv=2)
    qs = slice(40, 110)  # the queries: part of document 1, documents 2 and 3, part of document 4
    qq = q[:, :, qs].detach().requires_grad_()
    parts = []
    for ks in (slice(0, 50), slice(50, 160)):
        out, lse = check_docs_vs_ref(qq, k[:, :, ks], v[:, :, ks], (row[:, qs], row[:, ks]), False)
        parts.append((out, lse))
    (o1, l1), (o2, l2) = parts
    assert torch.isneginf(l1[:, :, 15:]).all() and not o1[:, :, 15:].any()  # documents 2.. have no key below 50
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    want, want_lse = naive64(*(t.detach().double() for t in (q, k, v)), docs=(row, row))
    torch.testing.assert_close(out.double(), want[:, :, qs], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse[:, :, qs], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward_per_key_block_from_the_merged_lse(causal):
    """Ring attention's backward: each key block's call with the merged out and lse gives its share of the grads."""
    row = doc_ids([10, 45, 1, 34, 50, 20])
    q, k, v, _ = make_inputs(1, 4, 160, 160, 16, Hkv=2)
    want_out, want_lse = naive64(q, k, v, causal=causal, docs=(row, row))
    go = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad(want_out, (q, k, v), go.double())
    out, lse = want_out.detach().float(), want_lse.detach().float()
    lo, hi = slice(0, 60), slice(60, 160)  # two key blocks, and the query rows' pairs with them
    blocks = [(lo, lo, True), (hi, lo, False), (hi, hi, True)] if causal else [(slice(0, 160), lo, False),
                                                                             (slice(0, 160), hi, False)]
    got = [torch.zeros(t.shape) for t in (q, k, v)]
    for qs, ks, blk_causal in blocks:
        a, b, c = attention_mod.attention_backward(
            go[:, :, qs], q[:, :, qs].detach(), k[:, :, ks].detach(), v[:, :, ks].detach(), out[:, :, qs],
            lse[:, :, qs], causal=blk_causal, scale=1 / 4, doc_ids=row[:, qs], doc_ids_k=row[:, ks])
        got[0][:, :, qs] += a
        got[1][:, :, ks] += b
        got[2][:, :, ks] += c
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5, msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("chunk", [1024, 30])
def test_reference_packed_rows_match_float64(chunk):
    q, k, v, m = make_inputs(3, 4, 100, 100, 8, F64, "random", Hkv=2)
    for causal in (False, True):
        kw = dict(causal=causal, key_padding_mask=m)
        nout, nlse, ngrads = fwd_bwd(naive64, q, k, v, mask=m, causal=causal, docs=(LAYOUT, LAYOUT))
        out, lse, grads = fwd_bwd(attention_ref, q, k, v, chunk_size=chunk, doc_ids=LAYOUT, **kw)
        torch.testing.assert_close(out, nout, atol=1e-12, rtol=1e-10)
        assert_lse_close(lse, nlse, atol=1e-12, rtol=1e-10)
        for a, b in zip(grads, ngrads):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("return_lse", [True, False])
def test_document_b_has_no_gradient_from_document_a(backend, return_lse):
    """d(out and lse of document B) / d(q, k, v of document A) is exactly zero; B's own are not."""
    docs = doc_ids([37, 50, 13])
    a, b = slice(0, 37), slice(37, 87)
    q, k, v, _ = make_inputs(1, 4, 100, 100, 16, Hkv=2)
    res = attention(q, k, v, causal=False, doc_ids=docs, return_lse=return_lse, backend=backend)
    out, lse = res if return_lse else (res, None)
    loss = (out[:, :, b] ** 2).sum() + (0 if lse is None else lse[:, :, b].sum())
    grads = torch.autograd.grad(loss, (q, k, v))
    for name, g in zip("qkv", grads):
        assert torch.equal(g[:, :, a], torch.zeros_like(g[:, :, a])), f"d{name} of document A is not zero"
        assert g[:, :, b].abs().min() > 0, f"d{name} of document B has zeros"
    assert torch.equal(grads[0][:, :, 87:], torch.zeros_like(grads[0][:, :, 87:]))


@pytest.mark.parametrize("causal", [False, True])
def test_doc_ranges_are_the_block_diagonal_mask(causal):
    """Each query's key range, and each key's query range, is exactly its row / column of the mask."""
    for dq, dk in ((LAYOUT, LAYOUT), (LAYOUT[:, 20:70], LAYOUT[:, 50:]), (LAYOUT[:, 50:], LAYOUT[:, :30])):
        dq, dk = dq.to(torch.int32).contiguous(), dk.to(torch.int32).contiguous()
        (klo, khi), (qlo, qhi) = attention_mod.doc_ranges(dq, dk, causal)
        Sq, Sk = dq.shape[1], dk.shape[1]
        keep = dq[:, :, None] == dk[:, None, :]
        if causal:
            keep = keep & (torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + Sk - Sq)
        for lo, hi, m in ((klo, khi, keep), (qlo, qhi, keep.transpose(1, 2))):
            assert lo.dtype == hi.dtype == torch.int32
            idx = torch.arange(m.shape[2])
            got = (idx >= lo[..., None]) & (idx < hi[..., None])
            assert torch.equal(got, m)
            assert (lo[:, 1:] >= lo[:, :-1]).all() and (hi[:, 1:] >= hi[:, :-1]).all()  # what the tile loop needs
    # the layout of test_tiles_outside_the_documents_are_never_read: every query sees only its 64-key block
    aligned = doc_ids([64, 64, 64]).to(torch.int32)
    (klo, khi), _ = attention_mod.doc_ranges(aligned, aligned, False)
    assert torch.equal(klo[0], torch.arange(192, dtype=torch.int32) // 64 * 64) and torch.equal(khi[0], klo[0] + 64)


@pytest.mark.parametrize("causal", [False, True])
def test_tiles_outside_the_documents_are_never_read(causal):
    """Skipped, not masked: NaN in every input of document 1 leaves documents 0 and 2 exact.

    Three documents of 64 tokens fill whole tiles. A kernel that read document 1's K/V tile for document 0's
    queries (non-causal) or document 2's (causal), or its Q/dO tile for another document's keys, would
    multiply NaN by a masked zero in a tl.dot and spread it, even though the mask drops those scores.
    """
    docs = doc_ids([64, 64, 64])
    q, k, v, _ = make_inputs(1, 2, 192, 192, 16)
    poisoned = [t.detach().clone() for t in (q, k, v)]
    for t in poisoned:
        t[:, :, 64:128] = float("nan")
    poisoned = [t.requires_grad_() for t in poisoned]
    out, lse = attention(*poisoned, causal=causal, doc_ids=docs, return_lse=True, backend="triton")
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    go[:, :, 64:128] = float("nan")  # document 1's output gradient too
    grads = torch.autograd.grad([out, lse], poisoned, [go, torch.zeros_like(lse)])
    keep = torch.cat([torch.arange(64), torch.arange(128, 192)])
    want_out = attention_ref(q, k, v, causal=causal, doc_ids=docs)
    want = torch.autograd.grad(want_out, (q, k, v), torch.nan_to_num(go))
    torch.testing.assert_close(out[:, :, keep], want_out[:, :, keep], **TOL[F32])
    for name, a, b in zip("qkv", grads, want):
        torch.testing.assert_close(a[:, :, keep], b[:, :, keep], **GRAD_TOL[F32], msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_packed_rows_without_lse(backend):
    # the torch backend runs SDPA with the block-diagonal mask; a query whose document has no key takes the
    # reference instead (out 0)
    q, k, v, _ = make_inputs(3, 2, 100, 100, 16, Hkv=1)
    out = attention(q, k, v, causal=True, doc_ids=LAYOUT, backend=backend)
    want = naive64(*(t.detach().double() for t in (q, k, v)), causal=True, docs=(LAYOUT, LAYOUT))[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    dq, dk = LAYOUT[:, :40], LAYOUT[:, 60:]
    out = attention(q[:, :, :40], k[:, :, 60:], v[:, :, 60:], doc_ids=dq, doc_ids_k=dk, backend=backend)
    want = naive64(*(t.detach().double() for t in (q[:, :, :40], k[:, :, 60:], v[:, :, 60:])), docs=(dq, dk))[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    assert not out[0, :, :32].any()  # row 0: documents 0 and 1 have no key from 60 on


@pytest.mark.parametrize("H,Hkv,causal", [(4, 2, True), (2, 2, False), (2, 1, True)])
def test_torch_path_attends_per_document(monkeypatch, H, Hkv, causal):
    # on CPU the torch path runs SDPA once per document (the row's square is never built): one call per
    # document of LAYOUT's rows, forward and gradients against float64
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q, k, v, **kw):
        calls.append((q.shape[2], kw.get("attn_mask")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    q, k, v, _ = make_inputs(3, H, 100, 100, 16, Hkv=Hkv)
    out = attention(q, k, v, causal=causal, doc_ids=LAYOUT, backend="torch")
    assert [n for n, _ in calls] == [31, 1, 32, 36, 100, 1, 1, 40, 1, 56, 1]
    assert all(m is None for _, m in calls)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * go).sum(), (q, k, v))
    h = [leaf_copy(t, F64) for t in (q, k, v)]
    nout = naive64(*h, causal=causal, docs=(LAYOUT, LAYOUT))[0]
    ngrads = torch.autograd.grad((nout * go.double()).sum(), h)
    torch.testing.assert_close(out.double(), nout, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ngrads):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


def test_torch_path_one_document_a_row_builds_no_mask(monkeypatch):
    # position ids 0..T-1 (one document a row, as generation or an unpacked batch may pass them): SDPA's own
    # causal path, no (B, S, S) mask
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append(kw) or sdpa(q, k, v, **kw))
    q, k, v, _ = make_inputs(2, 2, 40, 40, 16)
    out = attention(q, k, v, causal=True, doc_ids=torch.ones(2, 40, dtype=torch.int32), backend="torch")
    assert len(calls) == 1 and calls[0]["attn_mask"] is None and calls[0]["is_causal"]
    torch.testing.assert_close(out, attention(q, k, v, causal=True, backend="torch"))


def test_doc_ids_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 0, 0]])  # row 2 starts mid-document
    want = torch.tensor([[1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 2, 3]], dtype=torch.int32)
    assert torch.equal(attention_mod.doc_ids_from_positions(pos), want)


_ids = torch.zeros(2, 8, dtype=torch.long)
DOC_ERRORS = [
    ("float", dict(doc_ids=_ids.float()), TypeError, r"doc_ids must be an integer tensor"),
    ("bool", dict(doc_ids=_ids.bool()), TypeError, r"doc_ids must be an integer tensor"),
    ("shape", dict(doc_ids=_ids[:, :7]), ValueError, r"doc_ids must have shape \(2, 8\)"),
    ("k-shape", dict(doc_ids=_ids, doc_ids_k=_ids[:1]), ValueError, r"doc_ids_k must have shape \(2, 8\)"),
    ("k-alone", dict(doc_ids_k=_ids), ValueError, r"doc_ids_k .* needs doc_ids"),
    ("lengths", dict(k=torch.randn(2, 2, 9, 16), v=torch.randn(2, 2, 9, 16), doc_ids=_ids), ValueError,
     r"Sq=8 != Sk=9: pass the keys' ids as doc_ids_k"),
    ("decreasing", dict(doc_ids=torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 2, 1, 3, 4, 5, 6]])), RuntimeError,
     r"doc_ids must be non-decreasing"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name,over,exc,match", DOC_ERRORS, ids=[e[0] for e in DOC_ERRORS])
def test_bad_doc_ids(backend, name, over, exc, match):
    with pytest.raises(exc, match=match):
        attention(**_bad(**over), backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_cuda_packed_rows_match_reference(dtype):
    docs = doc_ids([1, 63, 64, 200, 7, 300, 365], [1000], [1] * 10 + [490, 500]).cuda()
    for causal, hkv in ((True, 2), (False, 8)):
        q, k, v, _ = make_inputs(3, 8, 1000, 1000, 128, dtype, device="cuda", Hkv=hkv)
        check_docs_vs_ref(q, k, v, (docs, docs), causal)
