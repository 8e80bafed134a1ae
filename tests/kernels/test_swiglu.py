"""cuboid.kernels.swiglu: Triton (interpreter on CPU) vs the torch reference, and the
reference vs ``a * sigmoid(a) * b`` in float64 (with its closed-form gradients).
"""
import pytest
import torch

from cuboid.kernels import swiglu, swiglu_ref, use_backend

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: dict(atol=2e-6, rtol=2e-6), F16: dict(atol=2e-3, rtol=2e-3), BF16: dict(atol=2e-2, rtol=2e-2)}


def make(shape, dtype, fused=False, scale=3.0, seed=0, device="cpu"):
    """(gate, up) leaves; ``fused``: the two halves of one (..., 2N) projection (strided rows), leaf = that."""
    g = torch.Generator().manual_seed(seed)
    if fused:
        x = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * scale).to(device, dtype).requires_grad_()
        gate, up = x.chunk(2, dim=-1)
        return x, gate, up
    gate, up = ((torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_() for _ in range(2))
    return None, gate, up


def swiglu64(a, b):
    """float64 value and closed-form gradients (d gate, d up) for an upstream dy."""
    a, b = a.detach().double(), b.detach().double()
    s = 1.0 / (1.0 + torch.exp(-a))
    return a * s * b, (lambda dy: (dy * b * s * (1 + a * (1 - s)), dy * a * s))


def upstream(y, seed=1):
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y)


# (shape, fused)
CASES = [((2, 3, 300), True), ((4, 1), False), ((1, 4100), False), ((7, 64), True)]  # 4100: two column blocks


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape,fused", CASES, ids=[f"{'x'.join(map(str, s))}-{'fused' if f else 'sep'}"
                                                    for s, f in CASES])
def test_triton_matches_reference(shape, fused, dtype):
    x, gate, up = make(shape, dtype, fused)
    leaves = (x,) if fused else (gate, up)
    got = swiglu(gate, up, backend="triton")
    want = swiglu_ref(gate, up)
    assert got.dtype == dtype and got.shape == gate.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, **TOL[dtype])
    dy = upstream(got)
    for a, b in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy in the interpreter: exp(100) = inf
def test_triton_saturated_gate_and_expanded_grad():
    # |gate| up to 100: sigmoid saturates to 0 / 1 without NaN; y.sum() gives a stride-0 upstream gradient
    gate = torch.linspace(-100, 100, 2 * 33).view(2, 33).requires_grad_()
    up = torch.randn(2, 33).requires_grad_()
    y = swiglu(gate, up, backend="triton")
    y.sum().backward()
    want, back = swiglu64(gate, up)
    dg, du = back(torch.ones(2, 33, dtype=F64))
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(gate.grad.double(), dg, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(up.grad.double(), du, atol=1e-5, rtol=1e-6)
    assert gate.grad[0, 0] == 0 and up.grad[0, 0] == 0  # silu(-100) = 0 exactly in fp32


def test_automatic_backend_and_forced_torch():
    _, gate, up = make((3, 16), F32)
    fn = swiglu(gate, up).grad_fn  # CPU + interpreter: Triton's op (under the view back to the input's shape)
    names = {type(fn).__name__} | {type(f).__name__ for f, _ in fn.next_functions if f is not None}
    assert any("cuboid_swiglu" in n for n in names), names
    with use_backend("torch"):
        assert torch.equal(swiglu(gate, up), swiglu_ref(gate, up))


@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("fused", [False, True], ids=["sep", "fused"])
def test_torch_path_equals_autograd_bit_for_bit(fused, dtype):
    # the CPU training path: its own Function (fewer temporaries), autograd's values exactly, vs float64 too
    x, gate, up = make((3, 5, 300), dtype, fused)
    leaves = (x,) if fused else (gate, up)
    with use_backend("torch"):
        got = swiglu(gate, up)
    assert "SwiGLUTorch" in type(got.grad_fn).__name__ and got.is_contiguous()
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(got, want)
    dy = upstream(got)
    grads = torch.autograd.grad(got, leaves, dy)
    for a, b in zip(grads, torch.autograd.grad(want, leaves, dy)):
        assert torch.equal(a, b)
    if not fused:
        tol = TOL.get(dtype, dict(atol=1e-12, rtol=1e-12))
        y64, back = swiglu64(gate, up)
        torch.testing.assert_close(got.double(), y64, **tol)
        for a, b in zip(grads, back(dy.double())):
            torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
def test_reference_matches_float64(dtype):
    _, gate, up = make((6, 257), dtype)
    got = swiglu_ref(gate, up)
    want, back = swiglu64(gate, up)
    dy = upstream(got)
    gg, gu = torch.autograd.grad(got, (gate, up), dy)
    wg, wu = back(dy.double())
    tol = TOL[dtype]
    for a, b in ((got, want), (gg, wg), (gu, wu)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.to(dtype).double(), **tol)
    # float64 inputs stay float64
    g64, u64 = gate.detach().double(), up.detach().double()
    torch.testing.assert_close(swiglu_ref(g64, u64), swiglu64(g64, u64)[0], atol=1e-12, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_cuda_matches_reference(dtype):
    for shape, fused in CASES + [((4, 300, 8192), True)]:
        x, gate, up = make(shape, dtype, fused, device="cuda")
        leaves = (x,) if fused else (gate, up)
        got, want = swiglu(gate, up), swiglu_ref(gate, up)
        torch.testing.assert_close(got, want, **TOL[dtype])
        dy = upstream(got)
        for a, b in zip(torch.autograd.grad(got, leaves, dy), torch.autograd.grad(want, leaves, dy)):
            torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_errors(backend):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"gate and up must have one shape, got \(4, 8\) and \(4, 7\)"):
        swiglu(x, x[:, :7], backend=backend)
    with pytest.raises(TypeError, match="share one dtype"):
        swiglu(x, x.half(), backend=backend)
    with pytest.raises(TypeError, match="gate has dtype int64"):
        swiglu(x.long(), x.long(), backend=backend)
    with pytest.raises(TypeError, match="up must be a torch.Tensor"):
        swiglu(x, 1.0, backend=backend)
    with pytest.raises(ValueError, match="need a last .hidden. dimension"):
        swiglu(torch.tensor(1.0), torch.tensor(2.0), backend=backend)
