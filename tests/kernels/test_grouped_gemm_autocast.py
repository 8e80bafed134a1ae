"""The experts' grouped GEMM under autocast takes the autocast dtype, as ``F.linear`` does (issue 49 item 13:
under ``--dtype bf16`` it ran on fp32 operands, on a GPU the slow fp32 path)."""
import torch

from cuboid.kernels import grouped_mm


def test_grouped_mm_casts_to_the_autocast_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 8, 16, generator=g, requires_grad=True)
    counts = torch.tensor([3, 0, 4])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, counts, backend="torch")
    assert y.dtype == torch.bfloat16
    want = grouped_mm(x.detach().bfloat16(), w.detach().bfloat16(), counts, backend="torch")
    assert torch.equal(y.detach(), want)
    y.float().sum().backward()  # the fp32 leaves still get their gradients
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32 and w.grad[1].abs().sum() == 0
    assert grouped_mm(x, w, counts, backend="torch").dtype == torch.float32  # autocast off: as given
