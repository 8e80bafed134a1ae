"""layer_norm / rms_norm: Triton (through the interpreter on CPU) vs the torch
reference, the reference vs float64 formulas, and argument errors.

Sizes are small on purpose: the interpreter runs programs one after another.
"""
import pytest
import torch

from cuboid.kernels import layer_norm, layer_norm_ref, rms_norm, rms_norm_ref, use_backend

# hidden size -> leading shape of x (a few rows; several programs for the small sizes)
SHAPES = {1: (3, 5), 100: (3, 7), 1000: (2, 5), 4096: (5,)}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def _make(lead, N, dtype, *, weight=True, bias=True, residual=False, wdtype=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    wdtype = wdtype or dtype

    def rnd(*shape, dt=dtype, scale=1.0, shift=0.0):
        t = torch.randn(*shape, generator=g) * scale + shift
        return t.to(device=device, dtype=dt).requires_grad_()

    x = rnd(*lead, N, shift=0.5)
    w = rnd(N, dt=wdtype, scale=0.5, shift=1.0) if weight else None
    b = rnd(N, dt=wdtype, scale=0.5) if bias else None
    r = rnd(*lead, N) if residual else None
    return x, w, b, r


def _call(kind, fn, x, w, b, r, **kw):
    args = (x, w, b) if kind == "layer" else (x, w)
    out = fn(*args, residual=r, **kw) if r is not None else fn(*args, **kw)
    return out if isinstance(out, tuple) else (out,)


def _grads(outs, ups, inputs):
    present = [t for t in inputs if t is not None]
    gs = iter(torch.autograd.grad(outs, present, ups))
    return [None if t is None else next(gs) for t in inputs]


def _upstream(outs, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g).to(o) for o in outs]


FNS = {"layer": (layer_norm, layer_norm_ref), "rms": (rms_norm, rms_norm_ref)}


def _compare_triton(kind, x, w, b, r, tol):
    fn, ref = FNS[kind]
    inputs = [x, w, b, r] if kind == "layer" else [x, w, r]
    got = _call(kind, fn, x, w, b, r, backend="triton")
    exp = _call(kind, ref, x, w, b, r)
    assert len(got) == len(exp) == (2 if r is not None else 1)
    ups = _upstream(exp)
    for o_got, o_exp in zip(got, exp):
        assert o_got.dtype == x.dtype and o_got.shape == x.shape
        torch.testing.assert_close(o_got, o_exp, **tol)
    g_got, g_exp = _grads(got, ups, inputs), _grads(exp, ups, inputs)
    for t, a, e in zip(inputs, g_got, g_exp):
        if t is not None:
            assert a.dtype == t.dtype and a.shape == t.shape
            torch.testing.assert_close(a, e, **tol)


AFFINE = {"layer": [(True, True), (True, False), (False, False), (False, True)],
          "rms": [(True, False), (False, False)]}
CASES = [(k, wb) for k in ("layer", "rms") for wb in AFFINE[k]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("N", sorted(SHAPES))
@pytest.mark.parametrize("kind,affine", CASES, ids=[f"{k}-w{int(w)}b{int(b)}" for k, (w, b) in CASES])
def test_triton_matches_ref(kind, affine, N, residual, dtype):
    x, w, b, r = _make(SHAPES[N], N, dtype, weight=affine[0], bias=affine[1], residual=residual)
    tol = dict(TOL[dtype])
    if N == 1 and dtype == torch.float32:
        # one element per row: xhat is ~0 and the ref's rounding noise is scaled by 1/sqrt(eps)
        tol = dict(atol=1e-4, rtol=1e-5)
    _compare_triton(kind, x, w, b, r, tol)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_largest_hidden(kind):
    x, w, b, r = _make((2,), 65536, torch.float32, bias=kind == "layer", residual=True)
    _compare_triton(kind, x, w, b, r, dict(atol=2e-5, rtol=1e-5))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_many_rows_partial_sums(kind):
    # 300 rows of 100: 10 row tiles over 4 backward programs, ragged last group
    x, w, b, r = _make((300,), 100, torch.float32, bias=kind == "layer", residual=True)
    _compare_triton(kind, x, w, b, r, dict(atol=2e-5, rtol=1e-5))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_fp32_weights_with_fp16_activations(kind):
    x, w, b, r = _make((4, 3), 200, torch.float16, bias=kind == "layer", residual=True, wdtype=torch.float32)
    _compare_triton(kind, x, w, b, r, TOL[torch.float16])


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_noncontiguous_input_and_expanded_grad(kind):
    fn, ref = FNS[kind]
    base = torch.randn(64, 6, dtype=torch.float32)
    outs = {}
    for name, f in (("triton", lambda *a: fn(*a, backend="triton")), ("ref", ref)):
        x = base.clone().requires_grad_()
        w = torch.linspace(0.5, 1.5, 64).requires_grad_()
        xt = x.t()  # (6, 64): last dim has stride 6
        y = f(xt, w, None) if kind == "layer" else f(xt, w)
        y.sum().backward()  # upstream grad is a stride-0 expanded tensor
        outs[name] = (y.detach(), x.grad, w.grad)
    for a, e in zip(outs["triton"], outs["ref"]):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_triton_strided_weight_and_bias():
    x = torch.randn(3, 40, requires_grad=True)
    wb = torch.randn(40, 2, requires_grad=True)
    w, b = wb[:, 0], wb[:, 1]  # (40,) each, stride 2
    assert w.stride() == (2,)
    outs = []
    for f in (lambda *a: layer_norm(*a, backend="triton"), layer_norm_ref):
        y = f(x, w, b)
        outs.append((y, *torch.autograd.grad(y, [x, wb], torch.ones_like(y) * torch.arange(40.0))))
    for a, e in zip(*outs):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("use", ["y", "h"])
def test_triton_one_output_used(kind, use):
    fn, ref = FNS[kind]
    results = []
    for f in (lambda *a, **k: fn(*a, backend="triton", **k), ref):
        x, w, b, r = _make((3, 4), 50, torch.float32, bias=kind == "layer", residual=True)
        y, h = _call(kind, f, x, w, b, r)
        ((y * y).sum() if use == "y" else (h * h).sum()).backward()
        results.append([t.grad for t in (x, w, b, r) if t is not None])
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_triton_backward_is_deterministic():
    x, w, b, r = _make((40,), 300, torch.float32, residual=True)
    ups = None
    runs = []
    for _ in range(2):
        outs = _call("layer", layer_norm, x, w, b, r, backend="triton")
        ups = ups or _upstream(outs)
        runs.append(_grads(outs, ups, [x, w, b, r]))
    for a, e in zip(*runs):
        assert torch.equal(a, e)


def test_triton_empty_rows_and_no_grad():
    x = torch.randn(0, 8)
    w = torch.ones(8)
    assert layer_norm(x, w, None, backend="triton").shape == (0, 8)
    xr = torch.randn(2, 3, 8)
    torch.testing.assert_close(rms_norm(xr, w, backend="triton"), rms_norm_ref(xr, w), atol=1e-6, rtol=1e-6)


def test_automatic_and_forced_backend():
    x, w, b, r = _make((4,), 16, torch.float32, residual=True)
    exp = layer_norm_ref(x, w, b, residual=r)
    with use_backend("torch"):
        got = layer_norm(x, w, b, residual=r)
    for a, e in zip(got, exp):
        assert torch.equal(a, e)
    got = layer_norm(x, w, b, residual=r)  # CPU + interpreter: automatic rule picks Triton
    assert "cuboid_norm" in type(got[0].grad_fn).__name__  # the Triton path is the custom op
    for a, e in zip(got, exp):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------
# references vs float64 formulas
# --------------------------------------------------------------------------


def _residual64(x, r, dtype):
    """float64 h = x + r, with the value rounded to ``dtype`` as the kernels do (gradient passes straight)."""
    if r is None:
        return x
    h = x + r
    return h + ((x.to(dtype) + r.to(dtype)).double() - h).detach()


def _layer_norm64(x, w, b, eps, r, dtype=torch.float32):
    h = _residual64(x, r, dtype)
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    y = (h - mu) / torch.sqrt(var + eps)
    y = y * w if w is not None else y
    y = y + b if b is not None else y
    return (y,) if r is None else (y, h)


def _rms_norm64(x, w, eps, r, dtype=torch.float32):
    h = _residual64(x, r, dtype)
    y = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    y = y * w if w is not None else y
    return (y,) if r is None else (y, h)


def _d64(t):
    return None if t is None else t.detach().double().requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("N", [1, 7, 100, 1000, 4096])
@pytest.mark.parametrize("kind,affine", CASES, ids=[f"{k}-w{int(w)}b{int(b)}" for k, (w, b) in CASES])
def test_ref_matches_float64(kind, affine, N, residual, dtype):
    x, w, b, r = _make((6,), N, dtype, weight=affine[0], bias=affine[1], residual=residual)
    eps = 1e-5 if kind == "layer" else 1e-6
    inputs = [x, w, b, r] if kind == "layer" else [x, w, r]
    ins64 = [_d64(t) for t in inputs]
    if kind == "layer":
        got, exp = layer_norm_ref(x, w, b, eps, r), _layer_norm64(*ins64[:3], eps, ins64[3], dtype)
    else:
        got, exp = rms_norm_ref(x, w, eps, r), _rms_norm64(*ins64[:2], eps, ins64[2], dtype)
    got = got if isinstance(got, tuple) else (got,)
    ups = _upstream(got)
    tol = TOL[dtype] if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    for a, e in zip(got, exp):
        assert a.dtype == dtype
        torch.testing.assert_close(a, e.to(dtype), **tol)
    g_got = _grads(got, ups, inputs)
    g_exp = _grads(exp, [u.double() for u in ups], ins64)
    gtol = dict(tol)
    if N == 1:
        gtol["atol"] = max(gtol["atol"], 1e-4)  # gradients scale with 1/sqrt(eps) at N=1
    if dtype != torch.float32:
        gtol = dict(atol=gtol["atol"] * 4, rtol=gtol["rtol"] * 2)  # grads rounded to half at each cast
    for t, a, e in zip(inputs, g_got, g_exp):
        if t is not None:
            assert a.dtype == t.dtype
            torch.testing.assert_close(a, e.to(t.dtype), **gtol)


def test_ref_handles_hidden_above_triton_limit():
    x = torch.randn(2, 70000)
    y = rms_norm_ref(x, None)
    torch.testing.assert_close(y.double(), _rms_norm64(x.double(), None, 1e-6, None)[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------
# GPU (bf16 only runs there: the interpreter's bf16 arithmetic is unreliable)
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("wdtype", ["same", "fp32"])
@pytest.mark.parametrize("N", [1, 100, 1000, 4096, 8192, 65536])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_triton_matches_ref_cuda(kind, N, wdtype, dtype):
    wdt = dtype if wdtype == "same" else torch.float32
    for residual in (False, True):
        x, w, b, r = _make((4, 33), N, dtype, bias=kind == "layer", residual=residual, wdtype=wdt, device="cuda")
        tol = dict(TOL[dtype])
        if dtype == torch.float32:
            tol = dict(atol=1e-4 if N == 1 else 2e-5, rtol=1e-5)
        _compare_triton(kind, x, w, b, r, tol)


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_errors(backend):
    x = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\), expected \(8,\)"):
        layer_norm(x, torch.ones(7), None, backend=backend)
    with pytest.raises(ValueError, match=r"bias has shape \(8, 1\), expected \(8,\)"):
        layer_norm(x, w, torch.ones(8, 1), backend=backend)
    with pytest.raises(TypeError, match="x has dtype int64"):
        rms_norm(torch.ones(4, 8, dtype=torch.long), w, backend=backend)
    with pytest.raises(TypeError, match="weight has dtype int32"):
        rms_norm(x, torch.ones(8, dtype=torch.int32), backend=backend)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        rms_norm(x, [1.0] * 8, backend=backend)
    with pytest.raises(TypeError, match="weight has dtype float16, expected x's dtype float32 or float32"):
        layer_norm(x, w.half(), None, backend=backend)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 7\), expected x's shape \(4, 8\)"):
        rms_norm(x, w, residual=torch.randn(4, 7), backend=backend)
    with pytest.raises(TypeError, match="residual has dtype float16, expected x's dtype float32"):
        layer_norm(x, w, None, residual=x.half(), backend=backend)
    for eps in (0.0, -1e-5, None):
        with pytest.raises(ValueError, match="eps must be a number > 0"):
            layer_norm(x, w, None, eps=eps, backend=backend)
    with pytest.raises(ValueError, match="last .hidden. dimension"):
        rms_norm(torch.tensor(1.0), None, backend=backend)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        layer_norm(x, w.to("meta"), None, backend=backend)


def test_errors_backend_and_size():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        layer_norm(x, None, None, backend="cuda")
    with pytest.raises(ValueError, match="hidden size 65537 exceeds the Triton limit 65536"):
        rms_norm(torch.randn(1, 65537), None, backend="triton")
