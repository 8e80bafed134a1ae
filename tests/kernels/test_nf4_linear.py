"""cuboid.kernels.nf4_linear: the Triton NF4 dequantize and fused NF4 linear (interpreter on CPU) against the torch
references (bit-equal dequantize; the linear within matmul rounding, and against float64), the dx-only backward,
and the custom ops under torch.compile's fake tensors. Sizes are small: the interpreter runs one program at a time."""
import pytest
import torch

from cuboid.kernels import nf4
from cuboid.kernels.nf4_linear import dequantize_nf4, nf4_linear, nf4_linear_ref

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def qweight(n, k, seed=0, double_quant=True, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2).to(dtype)
    return nf4.quantize_nf4(w, double_quant=double_quant)


# (N, K, double quant): 300 x 70 has blocks straddling rows and an odd tail (21000 values: 329 blocks, 2 groups)
DEQ = [(300, 70, True), (33, 17, False), (8, 64, True)]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])  # bf16 stores round in the interpreter: GPU test
@pytest.mark.parametrize("n,k,dq", DEQ, ids=[f"{n}x{k}{'-dq' if d else ''}" for n, k, d in DEQ])
def test_dequantize_triton_is_bit_equal_to_reference(n, k, dq, dtype):
    qw = qweight(n, k, seed=n, double_quant=dq)
    got = dequantize_nf4(qw, dtype, backend="triton")
    want = nf4.dequantize_nf4_ref(qw, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, want)


LIN = [((2, 3, 70), 40, True), ((5, 128), 96, False), ((1, 64), 130, True)]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("xshape,n,dq", LIN, ids=[f"{'x'.join(map(str, s))}-{n}{'-dq' if d else ''}" for s, n, d in LIN])
def test_fused_linear_matches_reference_and_float64(xshape, n, dq, dtype):
    qw = qweight(n, xshape[-1], seed=n + 1, double_quant=dq)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(xshape, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(n, generator=g).to(dtype).requires_grad_()
    got = nf4_linear(x, qw, bias, backend="triton")
    want = nf4_linear_ref(x, qw, bias)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == F32 else dict(atol=2e-2, rtol=2e-2)
    assert got.dtype == dtype and got.shape == (*xshape[:-1], n)
    torch.testing.assert_close(got, want, **tol)
    w64 = nf4.dequantize_nf4_ref(qw, F32).double()
    torch.testing.assert_close(got.double(), x.detach().double() @ w64.T + bias.detach().double(),
                               **(dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=3e-2, rtol=3e-2)))
    dy = torch.randn(got.shape, generator=g).to(dtype)
    gx, gb = torch.autograd.grad(got, (x, bias), dy)
    rx, rb = torch.autograd.grad(want, (x, bias), dy)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gb, rb, **tol)
    torch.testing.assert_close(gx.double(), dy.double().reshape(-1, n).matmul(
        nf4.dequantize_nf4_ref(qw, dtype).double()).view(xshape), **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 stores are exact only on a GPU (the interpreter "
                    "truncates fp32 to bf16)")
def test_gpu_bf16_dequantize_bit_equal_and_linear_close():
    qw = qweight(512, 1000, seed=3).to("cuda")
    for dtype in (BF16, F16, F32):
        assert torch.equal(dequantize_nf4(qw, dtype), nf4.dequantize_nf4_ref(qw, dtype))
    x = torch.randn(257, 1000, device="cuda", dtype=BF16, requires_grad=True)
    y = nf4_linear(x, qw)
    torch.testing.assert_close(y, nf4_linear_ref(x, qw), atol=2e-2, rtol=2e-2)
    (gx,) = torch.autograd.grad(y.float().sum(), x)
    torch.testing.assert_close(gx, torch.ones(257, 512, device="cuda", dtype=BF16) @ dequantize_nf4(qw, BF16))


def test_weight_takes_no_gradient_and_fake_shapes():
    qw = qweight(16, 64)
    x = torch.randn(3, 64, requires_grad=True)
    y = nf4_linear(x, qw, backend="triton")
    assert not qw.weight.requires_grad and y.requires_grad
    y.sum().backward()
    assert x.grad is not None and qw.weight.grad is None
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = (qw.weight.reshape(-1), qw.absmax, qw.nested_absmax, qw.nested_quant_map, qw.offset.reshape(1),
            qw.quant_map)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        args = [mode.from_tensor(t) for t in real]
        out = torch.ops.cuboid.nf4_linear(fx, *args, 16, 64)
        assert out.shape == (3, 16)
        deq = torch.ops.cuboid.nf4_dequantize(*args, 1024, 64, torch.bfloat16)
        assert deq.shape == (1024,) and deq.dtype == torch.bfloat16


def test_bad_input_is_a_clear_error():
    qw = qweight(16, 64)
    with pytest.raises(ValueError, match="does not match the weight"):
        nf4_linear(torch.randn(2, 32), qw)
    with pytest.raises(TypeError, match="dtype must be"):
        dequantize_nf4(qw, torch.int8)
