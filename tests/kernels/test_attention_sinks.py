"""Attention sinks (gpt-oss) and a value head dim other than the query/key one (DeepSeek-V3's latent attention)
in cuboid.kernels.attention: the torch path against a float64 softmax that appends the sink as one more column
(transformers' gpt-oss eager attention), and the Triton kernels (interpreter on CPU) against the torch path.

A sink is one logit per query head in every row's denominator that carries no value; its gradient is (H,).
Sizes are tiny: the interpreter runs programs one after another.
"""
import pytest
import torch

from cuboid.kernels.flash_attention import attention, attention_ref
from tests.kernels.test_attention_packed import doc_ids
from tests.kernels.test_attention_window import band
from tests.kernels.test_flash_attention import F16, F32, F64, GRAD_TOL, TOL, assert_lse_close, leaf_copy


def make(B, H, Hkv, Sq, Sk, D, Dv, dtype=F32, seed=0):
    """q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv) and sinks (H,) (fp32, spread around the scores)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    v = torch.randn(B, Hkv, Sk, Dv, generator=g)
    sinks = torch.randn(H, generator=g) * 2
    return [t.to(dtype).requires_grad_() for t in (q, k, v)] + [sinks.requires_grad_()]


def naive_sinks64(q, k, v, sinks, causal=False, mask=None, docs=None, window=None, shift=0, return_lse=True):
    """float64: scores with the kept keys, the sink appended as the last column, softmax, the column dropped.

    Returns (out, lse) with lse over keys and sink; a row with no kept key puts all its weight on the sink.
    """
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    B, H, Sq, Sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    keep = torch.ones(B, Sq, Sk, dtype=torch.bool)
    if window is not None:
        keep = keep & band(Sq, Sk, window, shift)
    if causal:
        keep = keep & (torch.arange(Sk)[None, :] <= torch.arange(Sq)[:, None] + (Sk - Sq))
    if mask is not None:
        keep = keep & mask[:, None, :]
    if docs is not None:
        keep = keep & (docs[0][:, :, None] == docs[1][:, None, :])
    s = torch.einsum("bhid,bhjd->bhij", q, k) / q.shape[3] ** 0.5
    s = s.masked_fill(~keep[:, None], float("-inf"))
    full = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, Sq, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return p @ v, torch.logsumexp(full, dim=-1)


def loss_grads(fn, q, k, v, sinks, seed=1, **kw):
    """out, lse and the gradients of q, k, v, sinks for a loss through both out and lse."""
    out, lse = fn(q, k, v, sinks=sinks, return_lse=True, **kw)
    g = torch.Generator().manual_seed(seed)
    go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    loss = (out.double() * go.double()).sum() + (lse.double() * gl.double()).sum()
    return out, lse, torch.autograd.grad(loss, (q, k, v, sinks))


def naive_kw(kw):
    """attention's keyword arguments as naive_sinks64 takes them."""
    docs = None if kw.get("doc_ids") is None else (kw["doc_ids"], kw.get("doc_ids_k", kw["doc_ids"]))
    return dict(causal=kw.get("causal", False), mask=kw.get("key_padding_mask"), docs=docs,
                window=kw.get("window"), shift=kw.get("window_shift", 0))


def check_ref_vs_float64(tensors, **kw):
    """The torch reference (fp32) against float64; returns the reference's (out, lse, grads)."""
    out, lse, grads = loss_grads(attention_ref, *tensors, **kw)
    h = [leaf_copy(t, F64) for t in tensors]
    nout, nlse, ngrads = loss_grads(naive_sinks64, *h, **naive_kw(kw))
    assert out.shape == nout.shape and lse.shape == nlse.shape
    torch.testing.assert_close(out.double(), nout, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), nlse, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("q", "k", "v", "sinks"), grads, ngrads):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=3e-5, rtol=1e-5, msg=lambda s: f"d{name}: {s}")
    return out, lse, grads


# (B, H, Hkv, Sq, Sk, D, Dv, extra keyword arguments): GQA, windows, packed rows and padding with sinks
REF_CASES = [
    (2, 4, 2, 9, 9, 8, 8, dict(causal=True)),
    (1, 4, 1, 7, 12, 12, 8, dict(causal=True, window=4)),        # MQA, Sq < Sk, a window, Dv < D
    (2, 2, 2, 10, 10, 6, 10, dict(causal=True, window=3, doc_ids=doc_ids([4, 6], [1, 3, 6]))),  # Dv > D
    (2, 2, 1, 6, 9, 8, 4, dict(key_padding_mask=torch.tensor([[1] * 5 + [0] * 4, [0] * 9], dtype=torch.bool))),
]


@pytest.mark.parametrize("case", REF_CASES, ids=[f"case{i}" for i in range(len(REF_CASES))])
def test_reference_with_sinks_matches_float64(case):
    B, H, Hkv, Sq, Sk, D, Dv, kw = case
    tensors = make(B, H, Hkv, Sq, Sk, D, Dv)
    out, _, grads = check_ref_vs_float64(tensors, **kw)
    assert out.shape == (B, H, Sq, Dv) and grads[3].shape == (H,)
    if "key_padding_mask" in kw:  # batch 1 keeps no key: its rows give 0 and only the sink's weight
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_reference_chunks_and_checkpoint_with_sinks():
    """Several query chunks (each recomputed in backward) give the one-chunk result, sinks' gradient included."""
    tensors = make(1, 2, 1, 11, 11, 8, 6)
    one = loss_grads(attention_ref, *tensors, causal=True, window=5)
    many = loss_grads(attention_ref, *tensors, causal=True, window=5, chunk_size=4)
    torch.testing.assert_close(many[0], one[0])
    for a, b in zip(many[2], one[2]):
        torch.testing.assert_close(a, b)


def test_torch_backend_keeps_sinks_and_takes_other_value_dims():
    """backend='torch' without lse (the SDPA fast path otherwise) keeps the sinks, and SDPA takes Dv != D."""
    q, k, v, sinks = make(2, 4, 2, 8, 8, 12, 6)
    for kw in (dict(causal=True), dict(causal=True, window=3), dict(doc_ids=doc_ids([3, 5], [8]))):
        got = attention(q, k, v, sinks=sinks, backend="torch", **kw)
        want, _ = naive_sinks64(q, k, v, sinks, **naive_kw(kw))
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        plain = attention(q, k, v, backend="torch", **kw)  # SDPA, Dv = 6 != D = 12
        assert plain.shape == (2, 4, 8, 6)
        want, _ = naive_sinks64(q, k, v, torch.full((4,), float("-inf")), **naive_kw(kw))
        torch.testing.assert_close(plain.double(), want, atol=1e-5, rtol=1e-5)
    g_sinks = torch.autograd.grad(attention(q, k, v, sinks=sinks, backend="torch").sum(), sinks)[0]
    assert g_sinks.shape == (4,) and bool((g_sinks != 0).all())


def test_sinks_and_head_dims_are_checked():
    q, k, v, sinks = make(1, 4, 2, 5, 5, 8, 6)
    with pytest.raises(ValueError, match="sinks must have shape"):
        attention(q, k, v, sinks=sinks[:2], backend="torch")
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long), backend="torch")
    with pytest.raises(ValueError, match="q and k must share head_dim"):
        attention(q, k[..., :4], v, backend="torch")


# Triton (the interpreter on CPU): (B, H, Hkv, S, D, Dv, dtype, keyword arguments); the interpreter's tiles are
# 32 queries x 64 keys, so S = 40 gives two query tiles and a partial key tile
TRITON_CASES = [
    (1, 4, 2, 40, 16, 32, F32, dict(causal=True, window=21)),  # GQA, a window, Dv > D
    (2, 2, 1, 40, 32, 16, F32, dict(causal=True, window=9, doc_ids=doc_ids([13, 27], [1, 30, 9]),
                                    key_padding_mask=torch.arange(40)[None, :].expand(2, 40) < 38)),  # packed, MQA
    (1, 4, 2, 40, 32, 16, F16, dict(causal=True, doc_ids=doc_ids([25, 15]))),
    (1, 2, 1, 24, 192, 128, F32, dict(causal=True)),  # DeepSeek-V3's split, v not padded to 192
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=[f"case{i}" for i in range(len(TRITON_CASES))])
def test_triton_with_sinks_matches_reference_and_float64(case):
    """The kernels' out, lse and gradients (the sinks' included) against the torch reference on fp32 copies,
    and the sinks' gradient against float64 directly."""
    B, H, Hkv, S, D, Dv, dtype, kw = case
    tensors = make(B, H, Hkv, S, S, D, Dv, dtype)
    out, lse, grads = loss_grads(attention, *tensors, backend="triton", **kw)
    assert out.shape == (B, H, S, Dv) and out.dtype == dtype and grads[3].shape == (H,)
    assert grads[2].shape == (B, Hkv, S, Dv) and grads[3].dtype == F32
    r = [leaf_copy(t, F32) for t in tensors]
    rout, rlse, rgrads = check_ref_vs_float64(r, **kw)
    torch.testing.assert_close(out.float(), rout, **TOL[dtype])
    assert_lse_close(lse, rlse, **TOL[dtype])
    for name, a, b in zip("qkv", grads, rgrads):
        torch.testing.assert_close(a.float(), b, **GRAD_TOL[dtype], msg=lambda s: f"d{name}: {s}")
    h = [leaf_copy(t, F64) for t in r]
    ngrads = loss_grads(naive_sinks64, *h, **naive_kw(kw))[2]
    sink_tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=5e-3, rtol=2e-3)  # measured 1e-6, 1e-3
    torch.testing.assert_close(grads[3].double(), ngrads[3], **sink_tol)


def test_op_with_sinks_and_value_dim_passes_opcheck_and_compiles_to_one_graph():
    """cuboid::flash_attention with sinks and Dv != D: schema, fake impl and autograd (opcheck), and a
    compiled function with sinks is one forward and one backward graph over the two ops, as in eager."""
    from tests.test_compile import _counting_backend, _opcheck

    q, k, v, sinks = make(1, 2, 1, 8, 8, 16, 32)
    _opcheck(torch.ops.cuboid.flash_attention.default, (q, k, v, None, None, None, True, 0.25, -3, sinks))

    def f(q, k, v, sinks):
        return attention(q, k, v, causal=True, sinks=sinks, backend="triton").square().sum()

    eager = torch.autograd.grad(f(q, k, v, sinks), (q, k, v, sinks))
    backend, counts, ops = _counting_backend()
    got = torch.autograd.grad(torch.compile(f, backend=backend, fullgraph=True)(q, k, v, sinks), (q, k, v, sinks))
    assert counts == {"forward": 1, "backward": 1}
    assert ops == {"cuboid.flash_attention.default", "cuboid.flash_attention_backward.default"}, sorted(ops)
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)
