"""cuboid.kernels.grouped_gemm: the Triton kernels (interpreter on CPU) against grouped_mm_ref, and the reference
against a float64 loop over groups (value, dx, dw).

Cases: empty groups (first, middle, last), one token, uneven groups, every row in one group, K and N not
multiples of any block, a group wider than one row tile, strided operands. bf16 runs in the reference tests
only (bf16 arithmetic is broken in the interpreter).
"""
import pytest
import torch

from cuboid.kernels import _backend, grouped_mm, grouped_mm_ref, use_backend
from cuboid.kernels import grouped_gemm as GG

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: dict(atol=1e-5, rtol=1e-5), F16: dict(atol=1e-2, rtol=2e-3), BF16: dict(atol=5e-2, rtol=1.6e-2),
       F64: dict(atol=1e-12, rtol=1e-12)}
INTERP = pytest.mark.skipif(not _backend.interpreter_active(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")

# (label, counts, K, N)
CASES = [
    ("uneven-empty-middle", [5, 0, 70, 1], 40, 130),  # 70 rows: two row tiles of 64; N 130: two column tiles
    ("empty-first-and-last", [0, 3, 9, 0], 33, 17),
    ("one-token", [0, 1, 0], 20, 24),
    ("all-in-one-group", [0, 0, 37], 64, 64),
    ("single-group", [11], 7, 5),
    ("no-rows", [0, 0], 16, 8),
]


def make(counts, K, N, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.int64)
    M = int(counts.sum())
    x = (torch.randn(M, K, generator=g) * scale).to(dtype).requires_grad_()
    w = (torch.randn(len(counts), N, K, generator=g) / K ** 0.5).to(dtype).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(dtype)
    return x, w, counts, dy


def loop64(x, w, counts, dy):
    """float64 per-group loop: value, dx, dw (dw[g] = 0 for an empty group)."""
    x, w, dy = x.detach().double(), w.detach().double(), dy.double()
    ends = torch.cumsum(counts, 0).tolist()
    y, dx, dw = torch.zeros(x.shape[0], w.shape[1], dtype=F64), torch.zeros_like(x), torch.zeros_like(w)
    for g, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
        y[a:b] = x[a:b] @ w[g].T
        dx[a:b] = dy[a:b] @ w[g]
        dw[g] = dy[a:b].T @ x[a:b]
    return y, dx, dw


def run(fn, x, w, counts, dy):
    y = fn(x, w, counts)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@INTERP
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("label,counts,K,N", CASES, ids=[c[0] for c in CASES])
def test_triton_matches_reference(label, counts, K, N, dtype):
    x, w, c, dy = make(counts, K, N, dtype)
    got = run(lambda *a: grouped_mm(*a, backend="triton"), x, w, c, dy)
    want = run(grouped_mm_ref, x, w, c, dy)
    assert "cuboid_grouped_mm" in type(got[0].grad_fn).__name__  # the op's registered backward
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{label} {name}: {m}")
    empty = (c == 0).nonzero().flatten()
    assert torch.all(got[2][empty] == 0), "an empty group's dw must be exactly zero"


@INTERP
@pytest.mark.parametrize("dtype,K,N", [(F32, 72, 40), (F16, 64, 48), (F16, 72, 40)],
                         ids=["fp32", "fp16-aligned", "fp16-unaligned"])
@pytest.mark.parametrize("pick", range(GG.AUTOTUNE["grouped_mm"]))
def test_triton_autotune_entries_match_float64(pick, dtype, K, N):
    """Every entry of every config row (fp32, half with 16-multiple strides, half without): groups of 1, 0, 130
    (several row tiles of any BLOCK_M, the last partial) and 60 rows."""
    x, w, c, dy = make([1, 0, 130, 60], K, N, dtype, seed=3)
    with _backend.autotune_pick("grouped_mm", pick):
        got = run(lambda *a: grouped_mm(*a, backend="triton"), x, w, c, dy)
    for a, b in zip(got, loop64(x, w, c, dy)):
        torch.testing.assert_close(a.double(), b.to(dtype).double(), **TOL[dtype])


@INTERP
def test_triton_strided_operands_and_expanded_gradient():
    """x a column slice, w a transposed (G, K, N) buffer, counts int32, and y.sum()'s stride-0 gradient."""
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([4, 0, 9], dtype=torch.int32)
    base = torch.randn(13, 50, generator=g).requires_grad_()
    x = base[:, 3:43]  # (13, 40), row stride 50
    w_kn = torch.randn(3, 40, 24, generator=g).requires_grad_()
    w = w_kn.transpose(1, 2)  # (3, 24, 40) with unit stride along N
    outs = {}
    for backend in ("triton", "torch"):
        y = grouped_mm(x, w, counts, backend=backend)
        outs[backend] = (y, *torch.autograd.grad(y.sum(), (base, w_kn)))
    got = outs["triton"]
    for a, b in zip(got, outs["torch"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.all(got[1][:, :3] == 0) and torch.all(got[1][:, 43:] == 0)


def test_triton_launch_reads_counts_on_the_device_only(monkeypatch):
    """The Triton path's host side (offsets, grids, autograd) on meta tensors, with the kernels replaced: any
    .item() / int() / .tolist() on counts would raise, so the launch has no host sync (torch.compile traces it)."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs["BLOCK_M"]))

    monkeypatch.setattr(GG, "_gmm_kernel", Recorder("mm"))
    monkeypatch.setattr(GG, "_gmm_dw_kernel", Recorder("dw"))
    monkeypatch.setattr(_backend, "_check_triton", lambda op, device: "triton")
    x = torch.empty(1000, 256, device="meta", dtype=BF16, requires_grad=True)
    w = torch.empty(8, 512, 256, device="meta", dtype=BF16, requires_grad=True)
    counts = torch.empty(8, device="meta", dtype=torch.int64)
    assert GG._mm_triton(x, w, counts, transpose_b=True).shape == (1000, 512)  # the op's launchers, called
    dy = torch.empty(1000, 512, device="meta", dtype=BF16)  # directly: the op itself gives meta tensors its fake
    assert GG._mm_triton(dy, w, counts, transpose_b=False).shape == x.shape
    assert GG._dw_triton(dy, x, counts).shape == w.shape
    assert [name for name, _, _ in launches] == ["mm", "mm", "dw"]  # forward, dx, dw
    (_, fwd, bm), (_, dx, _), (_, dw, _) = launches
    assert fwd == (-(-1000 // bm) + 8, -(-512 // 128)) and dx == (-(-1000 // bm) + 8, -(-256 // 128))
    assert dw[1] == 8


@pytest.mark.parametrize("dtype", [F32, F16, BF16, F64], ids=["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("label,counts,K,N", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_float64_loop(label, counts, K, N, dtype):
    x, w, c, dy = make(counts, K, N, dtype, seed=1)
    got = run(grouped_mm_ref, x, w, c, dy)
    for name, a, b in zip(("y", "dx", "dw"), got, loop64(x, w, c, dy)):
        assert a.dtype == dtype, name
        # each output rounded once from an fp32 (float64) accumulation
        torch.testing.assert_close(a.double(), b.to(dtype).double(), **TOL[dtype],
                                   msg=lambda m: f"{label} {name}: {m}")
    empty = (c == 0).nonzero().flatten()
    assert torch.all(got[2][empty] == 0)


@pytest.mark.parametrize("K,N", [(40, 24), (37, 13)], ids=["aligned", "unaligned"])
def test_cpu_path_uses_grouped_mm_and_keeps_inputs(K, N):
    """fp32 on CPU: torch._grouped_mm through the op cuboid::grouped_mm (aligned copies for K=37 / N=13 rows),
    equal to the padded-batch formulation; inputs untouched; the automatic backend is torch under
    use_backend('torch')."""
    x, w, c, dy = make([3, 0, 6], K, N, F32, seed=2)
    x0, w0 = x.detach().clone(), w.detach().clone()
    with use_backend("torch"):
        y = grouped_mm(x, w, c)
    assert "cuboid_grouped_mm" in type(y.grad_fn).__name__ and y.is_contiguous()
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    xb, wb = x.detach().requires_grad_(), w.detach().requires_grad_()
    yb = GG._padded_batch(xb, wb, c)
    for a, b in zip((y, dx, dw), (yb, *torch.autograd.grad(yb, (xb, wb), dy))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(x, x0) and torch.equal(w, w0)
    with torch.no_grad():
        assert torch.equal(grouped_mm_ref(x, w, c), y)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_errors(backend):
    if backend == "triton" and not _backend.interpreter_active():
        pytest.skip("needs TRITON_INTERPRET=1")
    x, w, c = torch.randn(5, 8), torch.randn(2, 3, 8), torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"x has 7 columns but w's groups take K=8"):
        grouped_mm(x[:, :7], w, c, backend=backend)
    with pytest.raises(ValueError, match=r"x must be \(M, K\) and w \(G, N, K\)"):
        grouped_mm(x, w[0], c, backend=backend)
    with pytest.raises(ValueError, match=r"one count per group \(G=2\), got int64 \(3,\)"):
        grouped_mm(x, w, torch.tensor([1, 1, 3]), backend=backend)
    with pytest.raises(ValueError, match=r"one count per group \(G=2\), got float32"):
        grouped_mm(x, w, c.float(), backend=backend)
    with pytest.raises(ValueError, match=r"sum to x's 5 rows, got sum 6"):
        grouped_mm(x, w, torch.tensor([3, 3]), backend=backend)
    with pytest.raises(ValueError, match=r"must be >= 0"):
        grouped_mm(x, w, torch.tensor([6, -1]), backend=backend)
    with pytest.raises(ValueError, match=r"w has no groups"):
        grouped_mm(x[:0], w[:0], c[:0], backend=backend)
    with pytest.raises(TypeError, match="share one dtype"):
        grouped_mm(x, w.half(), c, backend=backend)
    with pytest.raises(TypeError, match="counts must be a torch.Tensor"):
        grouped_mm(x, w, [2, 3], backend=backend)
    with pytest.raises(TypeError, match="x has dtype int64"):
        grouped_mm(x.long(), w.long(), c, backend=backend)
    if backend == "triton":
        with pytest.raises(TypeError, match="x has dtype float64"):
            grouped_mm(x.double(), w.double(), c, backend=backend)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_cuda_matches_reference(dtype):
    for label, counts, K, N in CASES + [("large", [0, 3000, 1, 700, 4000, 0, 1, 500], 2048, 768)]:
        x, w, c, dy = (t.detach().cuda() for t in make(counts, K, N, dtype))
        x, w = x.requires_grad_(), w.requires_grad_()
        tol = TOL[dtype] if dtype != F32 else dict(atol=1e-4, rtol=1e-4)  # a 4000-row dw sums in another order
        for pick in range(GG.AUTOTUNE["grouped_mm"]):
            with _backend.autotune_pick("grouped_mm", pick):
                got = run(grouped_mm, x, w, c, dy)
            for name, a, b in zip(("y", "dx", "dw"), got, loop64(x.cpu(), w.cpu(), c.cpu(), dy.cpu())):
                torch.testing.assert_close(a.cpu().double(), b.to(dtype).double(), **tol,
                                           msg=lambda m: f"{label} pick {pick} {name}: {m}")


def test_meta_device_gives_shapes():
    """A meta model's forward (preset parameter counts, fits): shapes and dtype through autograd, no values read."""
    x = torch.empty(10, 8, device="meta", dtype=BF16, requires_grad=True)
    w = torch.empty(3, 5, 8, device="meta", dtype=BF16, requires_grad=True)
    y = grouped_mm(x, w, torch.empty(3, dtype=torch.int64, device="meta"))
    assert (y.shape, y.dtype, y.device.type) == ((10, 5), BF16, "meta")
    dx, dw = torch.autograd.grad(y, (x, w), torch.empty_like(y))
    assert dx.shape == x.shape and dw.shape == w.shape


@pytest.mark.parametrize("K", [8, 7], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_compile_is_one_graph(K, backend):
    """A compiled caller traces the op cuboid::grouped_mm (either path) in one graph, no break, fp32 included
    (torch._grouped_mm's own fake kernel takes bf16 only); values and gradients as eager."""
    if backend == "triton" and not _backend.interpreter_active():
        pytest.skip("needs TRITON_INTERPRET=1")
    torch._dynamo.reset()

    def f(x, w, c):
        return torch.nn.functional.silu(grouped_mm(x * 2, w, c, backend=backend))

    x, w, c, dy = make([3, 0, 7], K, 5, F32, seed=5)
    explained = torch._dynamo.explain(f)(x, w, c)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    got = run(torch.compile(f, backend="aot_eager", fullgraph=True), x, w, c, dy)
    for a, b in zip(got, run(f, x, w, c, dy)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [F32, F64], ids=["fp32", "fp64"])
def test_op_passes_opcheck(dtype):
    """The op's schema, fake implementation and autograd registration (torch path; the Triton path under the
    interpreter), forward and backward op."""
    x, w, c, dy = make([3, 0, 7], 8, 5, dtype, seed=6)
    paths = [False] + ([True] if _backend.interpreter_active() and dtype != F64 else [])
    for use_triton in paths:
        torch.library.opcheck(torch.ops.cuboid.grouped_mm.default, (x, w, c, use_triton))
        torch.library.opcheck(torch.ops.cuboid.grouped_mm_backward.default,
                              (dy, x.detach(), w.detach(), c, use_triton, True, False))
