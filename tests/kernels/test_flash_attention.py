"""cuboid.kernels.flash_attention: Triton (interpreter on CPU) vs the torch reference,
and the reference vs a float64 computation that materializes the softmax.

Sizes are small on purpose: the interpreter runs programs one after another.
"""
import importlib
import math

import pytest
import torch

from cuboid.kernels.flash_attention import attention, attention_ref

# `cuboid.kernels.flash_attention` the attribute is the function (lazy export); the module:
attention_mod = importlib.import_module("cuboid.kernels.flash_attention")

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: dict(atol=1e-5, rtol=1e-5), F16: dict(atol=2e-3, rtol=2e-3), BF16: dict(atol=3e-2, rtol=2e-2)}
# gradients of half inputs go through half-precision P and dS tiles (as in FlashAttention-2)
# (measured on CPU: fp16 grads within 2e-3 abs; the bf16 bound is a GPU estimate)
GRAD_TOL = {F32: dict(atol=2e-5, rtol=1e-5), F16: dict(atol=4e-3, rtol=4e-3), BF16: dict(atol=8e-2, rtol=5e-2)}
# compiled on CUDA (the gpu tests): bench/gpu.py's tolerances (ATTN_OUT_TOL, ATTN_GRAD_TOL) where they are looser
# than the interpreter's above: other tiles and summation orders, fp32 exp2 and dots on the GPU's units
GPU_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=3e-3, rtol=3e-3), BF16: dict(atol=3e-2, rtol=2e-2)}
GPU_LSE_TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: TOL[F16], BF16: TOL[F16]}
GPU_GRAD_TOL = {F32: dict(atol=2e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=5e-3), BF16: dict(atol=8e-2, rtol=5e-2)}


def make_inputs(B, H, Sq, Sk, D, dtype=F32, mask=None, seed=0, device="cpu", Hkv=None):
    """q (B, H, Sq, D), k, v (B, Hkv, Sk, D) leaf tensors (Hkv defaults to H) and a key_padding_mask.

    mask: None; "pad" = batch 0 keeps a prefix (tail padded), batch 1 (if any)
    is fully padded, later batches random; "random" = random keep pattern.
    """
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    q, k, v = (torch.randn(B, h, S, D, generator=g).to(device=device, dtype=dtype).requires_grad_()
               for h, S in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    m = None
    if mask == "pad":
        m = torch.rand(B, Sk, generator=g) > 0.3
        m[0] = torch.arange(Sk) < max(1, (2 * Sk) // 3)
        if B > 1:
            m[1] = False
    elif mask == "random":
        m = torch.rand(B, Sk, generator=g) > 0.5
    return q, k, v, (None if m is None else m.to(device))


def naive64(q, k, v, causal=False, mask=None, scale=None, return_lse=True, docs=None):
    """float64, full (Sq x Sk) softmax; empty rows give out 0, lse -inf. Returns (out, lse).

    Grouped K/V heads are repeated here (autograd of the repeat sums each group's gradients).
    ``docs``: (doc ids of the queries (B, Sq), of the keys (B, Sk)); a query sees keys of its document only.
    """
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    Sq, Sk, D = q.shape[2], k.shape[2], q.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        keep = torch.arange(Sk, device=q.device)[None, :] <= torch.arange(Sq, device=q.device)[:, None] + (Sk - Sq)
    keep = keep.expand(q.shape[0], q.shape[1], Sq, Sk)
    if mask is not None:
        keep = keep & mask[:, None, None, :]
    if docs is not None:
        keep = keep & (docs[0][:, None, :, None] == docs[1][:, None, None, :])
    empty = ~keep.any(-1)
    s = s.masked_fill(~keep, float("-inf")).masked_fill(empty[..., None], 0.0)
    p = torch.softmax(s, dim=-1).masked_fill(~keep, 0.0)
    out = p @ v
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty, float("-inf"))
    return out, lse


def fwd_bwd(fn, q, k, v, seed=1, **kw):
    """out, lse and (dq, dk, dv) for a loss through both out and the finite lse."""
    out, lse = fn(q, k, v, return_lse=True, **kw)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g).to(out.device)
    gl = torch.randn(lse.shape, generator=g).to(lse.device)
    loss = (out.float() * go).sum() + (torch.where(torch.isfinite(lse), lse, 0.0).float() * gl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    return out, lse, grads


def assert_lse_close(a, b, **tol):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "fully masked rows differ"
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin].double(), b[fin].double(), **tol)


def leaf_copy(t, dtype):
    return t.detach().to(dtype).requires_grad_()


# (B, H, Sq, Sk, D, causal, mask, dtype)
TRITON_CASES = [
    (1, 2, 1, 1, 16, False, None, F32),
    (1, 2, 17, 17, 16, True, None, F32),
    (2, 1, 127, 127, 40, True, "pad", F32),
    (1, 2, 200, 200, 64, False, None, F32),
    (1, 1, 39, 200, 80, True, None, F32),       # Sq < Sk, causal aligned to the end
    (1, 1, 200, 17, 128, True, None, F32),      # Sq > Sk causal: first rows see no key
    (2, 1, 127, 200, 64, False, "pad", F32),
    (2, 1, 200, 127, 40, True, "pad", F32),
    (1, 1, 1, 127, 128, True, None, F32),
    (1, 1, 127, 1, 16, False, None, F32),
    (1, 1, 33, 40, 256, True, "random", F32),
    (1, 1, 17, 30, 20, False, None, F32),       # head dim padded 20 -> 32
    (1, 2, 127, 127, 64, True, None, F16),
    (2, 1, 200, 127, 80, True, "pad", F16),
    (1, 1, 17, 200, 40, False, "pad", F16),
    (1, 1, 127, 200, 128, True, None, F16),
    (2, 2, 1, 17, 64, False, "pad", F16),
    (2, 1, 64, 50, 256, True, "pad", F16),
]


def _case_id(c):
    B, H, Sq, Sk, D, causal, mask, dtype = c
    return f"B{B}H{H}-q{Sq}k{Sk}-d{D}-{'causal' if causal else 'full'}-{mask or 'nomask'}-{str(dtype)[6:]}"


def check_triton_vs_ref(case, device="cpu", Hkv=None):
    B, H, Sq, Sk, D, causal, mask, dtype = case
    q, k, v, m = make_inputs(B, H, Sq, Sk, D, dtype, mask, device=device, Hkv=Hkv)
    out, lse, grads = fwd_bwd(attention, q, k, v, causal=causal, key_padding_mask=m, backend="triton")
    assert out.dtype == dtype and lse.dtype == F32 and out.shape == (B, H, Sq, D) and lse.shape == (B, H, Sq)
    assert all(g.dtype == dtype and g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    compare_with_ref((out, lse, grads), q, k, v, causal=causal, key_padding_mask=m)


def compare_with_ref(got, q, k, v, **kw):
    """Triton's (out, lse, grads) against the reference on fp32 copies of the same values (the tolerance is
    the kernel's own error); returns the copies and the reference's (out, lse, grads)."""
    out, lse, grads = got
    dtype = q.dtype
    r = [leaf_copy(t, F32) for t in (q, k, v)]
    rout, rlse, rgrads = fwd_bwd(attention_ref, *r, **kw)
    gpu = q.is_cuda
    torch.testing.assert_close(out.float(), rout, **(GPU_TOL if gpu else TOL)[dtype])
    assert_lse_close(lse, rlse, **(GPU_LSE_TOL[dtype] if gpu else TOL[F32 if dtype == F32 else F16]))
    for name, a, b in zip("qkv", grads, rgrads):
        assert torch.isfinite(a).all(), f"d{name} has non-finite values"
        torch.testing.assert_close(a.float(), b, **(GPU_GRAD_TOL if gpu else GRAD_TOL)[dtype],
                                   msg=lambda s: f"d{name}: {s}")
    return r, (rout, rlse, rgrads)


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_matches_reference(case):
    check_triton_vs_ref(case)


@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)])
def test_triton_other_block_sizes(monkeypatch, blocks):
    # the causal loop bounds round to BLOCK_M / BLOCK_N: check both orders
    real = attention_mod._config
    monkeypatch.setattr(attention_mod, "_config",
                        lambda *a, **kw: dict(real(*a, **kw), BLOCK_M=blocks[0], BLOCK_N=blocks[1]))
    check_triton_vs_ref((2, 1, 70, 45, 32, True, "pad", F32))
    check_triton_vs_ref((1, 1, 45, 78, 16, True, None, F32))  # Sk - Sq = 33: a key block starts on the diagonal


# grouped-query (Hkv > 1) and multi-query (Hkv == 1): (Hkv, (B, H, Sq, Sk, D, causal, mask, dtype))
GQA_CASES = [
    (2, (1, 4, 37, 50, 16, True, "random", F32)),  # two groups of two, end-aligned causal
    (1, (1, 3, 70, 45, 32, True, None, F32)),     # MQA, Sq > Sk: first rows see no key
    (2, (1, 6, 33, 33, 24, False, "random", F16)),  # groups of three, head dim padded
]


@pytest.mark.parametrize("Hkv,case", GQA_CASES, ids=[f"kv{h}-{_case_id(c)}" for h, c in GQA_CASES])
def test_triton_gqa_matches_reference(Hkv, case):
    check_triton_vs_ref(case, Hkv=Hkv)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gqa_is_repeated_kv_with_group_summed_grads(backend):
    """Grouped K/V give what repeating each K/V head over its group gives; dK/dV are the group sums."""
    B, H, Hkv, Sq, Sk, D = 2, 6, 2, 29, 40, 16
    q, k, v, m = make_inputs(B, H, Sq, Sk, D, mask="pad", Hkv=Hkv)
    kw = dict(causal=True, key_padding_mask=m, backend=backend)
    out, lse, (dq, dk, dv) = fwd_bwd(attention, q, k, v, **kw)
    assert dk.shape == dv.shape == (B, Hkv, Sk, D)
    rq = leaf_copy(q, F32)
    rk, rv = (t.detach().repeat_interleave(H // Hkv, dim=1).requires_grad_() for t in (k, v))
    rout, rlse, (rdq, rdk, rdv) = fwd_bwd(attention, rq, rk, rv, **kw)  # plain multi-head, (B, H, Sk, D) grads
    torch.testing.assert_close(out, rout, atol=1e-6, rtol=1e-6)
    assert_lse_close(lse, rlse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(dq, rdq, atol=1e-6, rtol=1e-6)
    for got, per_head in ((dk, rdk), (dv, rdv)):
        torch.testing.assert_close(got, per_head.unflatten(1, (Hkv, H // Hkv)).sum(2), atol=2e-6, rtol=1e-6)
        # each group's heads really contribute: no single head's gradient equals the sum
        assert (got - per_head[:, :: H // Hkv]).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gqa_torch_fast_path_and_reference_agree(backend):
    # no lse: the torch backend runs SDPA with enable_gqa; the reference groups heads by broadcasting
    q, k, v, m = make_inputs(2, 4, 21, 21, 16, mask="random", Hkv=1)
    out = attention(q, k, v, causal=True, key_padding_mask=m, backend=backend)
    want = naive64(*(leaf_copy(t, F64) for t in (q, k, v)), causal=True, mask=m)[0]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# (B, H, Sq, Sk, D, causal, mask)
REF_CASES = [
    (1, 2, 1, 1, 16, False, None),
    (2, 2, 17, 17, 40, True, "pad"),
    (1, 1, 127, 200, 64, True, None),
    (2, 1, 200, 127, 80, True, "pad"),
    (1, 1, 200, 200, 128, False, "random"),
    (1, 1, 17, 5, 8, True, None),  # the reference takes any head dim
]


REF_GQA_CASES = [(2, 4, 33, 47, 16, True, "pad", 2), (1, 2, 52, 52, 8, False, "random", 1)]  # (..., Hkv)


@pytest.mark.parametrize("case", REF_CASES + REF_GQA_CASES,
                         ids=lambda c: _case_id((*c[:7], F64)) + (f"-kv{c[7]}" if len(c) > 7 else ""))
@pytest.mark.parametrize("chunk", [1024, 50])
def test_reference_matches_float64(case, chunk):
    B, H, Sq, Sk, D, causal, mask = case[:7]
    q, k, v, m = make_inputs(B, H, Sq, Sk, D, F64, mask, Hkv=case[7] if len(case) > 7 else None)
    kw = dict(causal=causal, key_padding_mask=m)
    nout, nlse, ngrads = fwd_bwd(naive64, q, k, v, mask=m, causal=causal)
    # float64 through the reference: same math, chunking (and its checkpointing) is exact
    out, lse, grads = fwd_bwd(attention_ref, q, k, v, chunk_size=chunk, **kw)
    torch.testing.assert_close(out, nout, atol=1e-12, rtol=1e-10)
    assert_lse_close(lse, nlse, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads, ngrads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    # fp32 and fp16 inputs compute in fp32
    for dtype, tol, gtol in ((F32, 1e-5, 1e-5), (F16, 2e-3, 2e-3)):
        r = [leaf_copy(t, dtype) for t in (q, k, v)]
        h = [leaf_copy(t, F64) for t in r]  # the same rounded values, in float64
        hout, hlse, hgrads = fwd_bwd(naive64, *h, mask=m, causal=causal)
        out, lse, grads = fwd_bwd(attention_ref, *r, chunk_size=chunk, **kw)
        assert out.dtype == dtype and lse.dtype == F32
        torch.testing.assert_close(out.double(), hout, atol=tol, rtol=tol)
        assert_lse_close(lse, hlse, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads, hgrads):
            assert a.dtype == dtype
            torch.testing.assert_close(a.double(), b, atol=gtol, rtol=gtol)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fully_masked_rows(backend):
    B, H, Sq, Sk, D = 2, 2, 40, 24, 32
    q, k, v, _ = make_inputs(B, H, Sq, Sk, D)
    m = torch.ones(B, Sk, dtype=torch.bool)
    m[1] = False  # batch 1: every key padded
    out, lse = attention(q, k, v, causal=True, key_padding_mask=m, return_lse=True, backend=backend)
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    empty = torch.zeros(B, H, Sq, dtype=torch.bool)
    empty[:, :, : Sq - Sk] = True  # causal with Sq > Sk: the first Sq - Sk queries see nothing
    empty[1] = True
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.isfinite(lse[~empty]).all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    assert not k.grad[1].any() and not v.grad[1].any()
    assert q.grad[0, :, Sq - Sk:].abs().sum() > 0


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sum_of_lse_only_and_out_only(backend):
    # gradient through lse alone (out unused), and through out alone
    q, k, v, m = make_inputs(1, 2, 33, 47, 16, mask="random")
    for pick in (1, 0):
        res = attention(q, k, v, key_padding_mask=m, return_lse=True, backend=backend)
        got = torch.autograd.grad(res[pick].sum(), (q, k, v), allow_unused=True)
        r = [leaf_copy(t, F64) for t in (q, k, v)]
        want = torch.autograd.grad(naive64(*r, mask=m)[pick].sum(), r, allow_unused=True)
        for a, b, t in zip(got, want, r):
            # lse does not depend on v: no gradient (torch) or a zero one (Triton)
            a, b = (torch.zeros_like(t) if x is None else x for x in (a, b))
            torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


def test_lse_merges_key_blocks():
    # ring attention: attend to two halves of the keys and merge by lse
    q, k, v, _ = make_inputs(2, 2, 37, 90, 32)
    o1, l1 = attention(q, k[:, :, :50], v[:, :, :50], return_lse=True, backend="triton")
    o2, l2 = attention(q, k[:, :, 50:], v[:, :, 50:], return_lse=True, backend="triton")
    lse = torch.logaddexp(l1, l2)
    out = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    got = torch.autograd.grad((out ** 2).sum(), (q, k, v))
    r = [leaf_copy(t, F64) for t in (q, k, v)]
    nout, nlse = naive64(*r)
    want = torch.autograd.grad((nout ** 2).sum(), r)
    torch.testing.assert_close(out.double(), nout, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), nlse, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_inputs(backend):
    B, H, Sq, Sk, D = 2, 3, 29, 41, 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Sq, H, D, generator=g).transpose(1, 2).requires_grad_()  # (B, S, H, D) layout
    k = torch.randn(B, H, D, Sk, generator=g).transpose(2, 3).requires_grad_()  # head-dim stride != 1
    v = torch.randn(B, H, Sk, 2 * D, generator=g)[..., ::2].requires_grad_()  # strided slice
    m = (torch.rand(B, 2 * Sk, generator=g) > 0.3)[:, ::2]  # non-contiguous mask
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or m.is_contiguous())
    out, lse = attention(q, k, v, causal=True, key_padding_mask=m, return_lse=True, backend=backend)
    out.sum().backward()  # an expanded (stride 0) output gradient
    r = [leaf_copy(t, F64) for t in (q, k, v)]
    nout, nlse = naive64(*r, causal=True, mask=m)
    nout.sum().backward()
    torch.testing.assert_close(out.double(), nout, atol=1e-5, rtol=1e-5)
    assert_lse_close(lse, nlse, atol=1e-5, rtol=1e-5)
    for t, n in zip((q, k, v), r):
        torch.testing.assert_close(t.grad.double(), n.grad, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_scale_and_default_path(backend):
    q, k, v, _ = make_inputs(1, 1, 20, 20, 16)
    got = attention(q, k, v, scale=0.37, backend=backend)
    torch.testing.assert_close(got.double(), naive64(q, k, v, scale=0.37)[0], atol=1e-5, rtol=1e-5)
    # no backend: CPU tensors with the interpreter on run Triton, same numbers
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, backend="triton"))


def _bad(**over):
    q, k, v, _ = make_inputs(2, 2, 8, 8, 16)
    args = dict(q=q.detach(), k=k.detach(), v=v.detach(), key_padding_mask=None, scale=None)
    args.update(over)
    return args


_x = torch.randn(2, 2, 8, 16)
ERRORS = [
    ("not-4d", dict(q=torch.randn(2, 8, 16)), ValueError, r"q must be 4-D"),
    ("batch", dict(k=torch.randn(3, 2, 8, 16)), ValueError, r"share batch"),
    ("heads", dict(v=torch.randn(2, 3, 8, 16)), ValueError, r"k and v must share heads"),
    ("gqa-ratio", dict(k=torch.randn(2, 3, 8, 16), v=torch.randn(2, 3, 8, 16)), ValueError,
     r"^attention: q's 2 heads must be a multiple of k/v's 3 heads \(grouped-query attention\)\.$"),
    ("head-dim", dict(k=torch.randn(2, 2, 8, 32)), ValueError, r"share head_dim"),
    ("kv-seq", dict(v=torch.randn(2, 2, 9, 16)), ValueError, r"k and v must have the same sequence length"),
    ("dtype-mix", dict(k=_x.half()), TypeError, r"share one dtype"),
    ("int", dict(q=_x.long(), k=_x.long(), v=_x.long()), TypeError, r"dtype int64"),
    ("not-tensor", dict(q=_x.numpy()), TypeError, r"q must be a torch.Tensor"),
    ("devices", dict(k=_x.to("meta")), ValueError, r"one device"),
    ("mask-shape", dict(key_padding_mask=torch.ones(2, 9, dtype=torch.bool)), ValueError, r"shape \(batch, seq_k\)"),
    ("mask-dtype", dict(key_padding_mask=torch.ones(2, 8)), TypeError, r"bool tensor"),
    ("scale-zero", dict(scale=0.0), ValueError, r"scale must be positive"),
    ("scale-neg", dict(scale=-1.0), ValueError, r"scale must be positive"),
    ("scale-type", dict(scale="0.5"), TypeError, r"scale must be a positive number"),
    ("empty-seq", dict(q=torch.randn(2, 2, 0, 16)), ValueError, r"sequence lengths must be >= 1"),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name,over,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input(backend, name, over, exc, match):
    with pytest.raises(exc, match=match):
        attention(**_bad(**over), backend=backend)


def test_head_dim_limits_are_triton_only():
    q = torch.randn(1, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"head_dim 16\.\.256, got 8"):
        attention(q, q, q, backend="triton")
    big = torch.randn(1, 1, 2, 257)
    with pytest.raises(ValueError, match=r"head_dim 16\.\.256, got 257"):
        attention(big, big, big, backend="triton")
    # an fp32 computation against float64, at fp32's tolerance (float64's default bound is below fp32's rounding)
    torch.testing.assert_close(attention(q, q, q, backend="torch").double(), naive64(q, q, q)[0], **TOL[F32])
    with pytest.raises(TypeError, match=r"dtype float64"):
        attention(_x.double(), _x.double(), _x.double(), backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_cuda_matches_reference(dtype):
    for case in [(2, 2, 127, 200, 64, True, "pad"), (1, 2, 200, 127, 128, True, None),
                 (2, 1, 1, 333, 80, False, "random"), (1, 1, 513, 513, 256, True, None)]:
        check_triton_vs_ref((*case, dtype), device="cuda")
    check_triton_vs_ref((2, 8, 300, 300, 128, True, "pad", dtype), device="cuda", Hkv=2)  # GQA
    check_triton_vs_ref((1, 4, 77, 200, 64, True, None, dtype), device="cuda", Hkv=1)  # MQA


@pytest.mark.parametrize("sq,sk,causal,pad", [(17, 17, True, False), (9, 17, True, True), (17, 9, False, True),
                                              (17, 9, True, False), (5, 5, False, False)])
def test_torch_path_fast_sdpa_matches_reference(sq, sk, causal, pad):
    """The torch backend without lse runs SDPA where it applies; same values and grads as the reference."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, s, 24, generator=g, requires_grad=True) for s in (sq, sk, sk))
    mask = None
    if pad:
        mask = torch.ones(2, sk, dtype=torch.bool)
        mask[1, sk // 2:] = False
        mask[0, 0] = False
    out = attention(q, k, v, causal=causal, key_padding_mask=mask, backend="torch")
    ref = attention_ref(q, k, v, causal=causal, key_padding_mask=mask)
    do = torch.randn(out.shape, generator=g)
    ga = torch.autograd.grad(out, (q, k, v), do)
    gb = torch.autograd.grad(ref, (q, k, v), do)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_decode_step_against_a_preallocated_cache(backend):
    """Generation's step: one query per row against the filled part of a (B, Hkv, capacity, D) cache (a slice
    along the sequence), grouped K/V heads, left padding, causal aligned to the end (the query sees every key)."""
    B, H, Hkv, filled, capacity, D = 3, 4, 2, 300, 333, 64
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, 1, D, generator=g)
    k_cache, v_cache = (torch.randn(B, Hkv, capacity, D, generator=g) for _ in range(2))
    k, v = k_cache[:, :, :filled], v_cache[:, :, :filled]
    assert not k.is_contiguous()
    m = torch.ones(B, filled, dtype=torch.bool)
    m[1, :40], m[2, :7] = False, False  # left padding
    out = attention(q, k, v, causal=True, key_padding_mask=m, backend=backend)
    ref, _ = naive64(*(t.double() for t in (q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))),
                     causal=True, mask=m)
    assert out.shape == (B, H, 1, D)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
