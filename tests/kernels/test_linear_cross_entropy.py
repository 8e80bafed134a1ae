"""cuboid.kernels.linear_cross_entropy: the chunked torch path and the Triton path (interpreter on CPU) against
the unfused head (``F.linear`` then ``F.cross_entropy``), and that against float64; forward and backward (x,
weight, bias), with ignored rows and chunks that do not divide the rows; the vocab-parallel form (slices of a
padded vocabulary, the statistics reduced by a callable) with one thread per slice. ``reduction="none"`` (per-row
log-probabilities, any upstream gradient per row) and the per-row entropy against ``log_softmax`` in float64, on
one device and vocab-parallel.
"""
import importlib
import threading

import pytest
import torch

from cuboid.kernels import linear_cross_entropy, linear_cross_entropy_ref, use_backend
from cuboid.kernels.linear_cross_entropy import default_chunk

F32, F16, F64 = torch.float32, torch.float16, torch.float64


def make(n, h, v, dtype=F32, bias=True, ignore_every=4, seed=0, scale=1.0):
    """(x, weight, bias, labels) with every ``ignore_every``-th label ignored (-100); leaves require grad."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    return x, w, b, y


def leaves(x, w, b):
    return [t for t in (x, w, b) if t is not None]


def value_and_grads(fn, x, w, b, y, upstream=1.7, **kw):
    loss = fn(x, w, y, b, **kw)
    return loss.detach(), torch.autograd.grad(loss * upstream, leaves(x, w, b))


def float64_reference(x, w, b, y, upstream=1.7, reduction="mean"):
    d = [t.detach().double().requires_grad_() for t in leaves(x, w, b)]
    x64, w64, b64 = d[0], d[1], (d[2] if b is not None else None)
    return value_and_grads(linear_cross_entropy_ref, x64, w64, b64, y, upstream, reduction=reduction)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


CASES = [  # (rows, hidden, vocab, chunk): chunks that do not divide the rows, one chunk, a chunk per row
    (37, 16, 53, 8),
    (64, 32, 300, 64),
    (9, 8, 17, 1),
    (50, 24, 1000, 13),
]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("n,h,v,chunk", CASES, ids=[f"{n}x{h}x{v}-c{c}" for n, h, v, c in CASES])
def test_torch_path_matches_unfused_and_float64(n, h, v, chunk, bias):
    x, w, b, y = make(n, h, v, bias=bias)
    got, got_g = value_and_grads(linear_cross_entropy, x, w, b, y, chunk=chunk, backend="torch")
    want, want_g = value_and_grads(linear_cross_entropy_ref, x, w, b, y)
    ref, ref_g = float64_reference(x, w, b, y)
    assert got.dtype == F32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for a, u, r in zip(got_g, want_g, ref_g):
        assert a.dtype == F32
        torch.testing.assert_close(a, u, atol=1e-6, rtol=1e-5)
        assert rel(a, r) < 1e-5 and rel(u, r) < 1e-5  # both against float64
    assert abs(got.double() - ref).item() / ref.abs().item() < 1e-6


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,h,v,chunk", CASES[:3], ids=[f"{n}x{h}x{v}-c{c}" for n, h, v, c in CASES[:3]])
def test_triton_path_matches_unfused(n, h, v, chunk, dtype):
    x, w, b, y = make(n, h, v, dtype=dtype)
    got, got_g = value_and_grads(linear_cross_entropy, x, w, b, y, chunk=chunk, backend="triton")
    want, want_g = value_and_grads(linear_cross_entropy_ref, x, w, b, y)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == F32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, want, **tol)
    for a, u in zip(got_g, want_g):
        assert a.dtype == dtype
        torch.testing.assert_close(a, u, **tol)
    if dtype == F32:
        ref, ref_g = float64_reference(x, w, b, y)
        assert abs(got.double() - ref).item() / ref.abs().item() < 1e-6
        assert all(rel(a, r) < 1e-5 for a, r in zip(got_g, ref_g))


def test_triton_long_rows_and_extreme_logits():
    # a vocabulary over two column blocks of the row programs (4096 wide) and logits around +-80
    x, w, b, y = make(5, 8, 4100, scale=40.0, ignore_every=2)
    got, got_g = value_and_grads(linear_cross_entropy, x, w, b, y, chunk=3, backend="triton")
    ref, ref_g = float64_reference(x, w, b, y)
    assert torch.isfinite(got) and abs(got.double() - ref).item() / ref.abs().item() < 1e-6
    assert all(rel(a, r) < 1e-5 for a, r in zip(got_g, ref_g))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sum_reduction_batched_rows_and_half_precision_against_float64(backend):
    x, w, b, y = make(24, 16, 70, dtype=F16)
    x3, y3 = x.detach().view(2, 12, 16).requires_grad_(), y.view(2, 12)  # (B, T, H) rows
    got, got_g = value_and_grads(linear_cross_entropy, x3, w, b, y3, chunk=5, backend=backend, reduction="sum")
    ref, ref_g = float64_reference(x3, w, b, y3, reduction="sum")
    assert got.dtype == F32 and got_g[0].shape == (2, 12, 16)
    assert abs(got.double() - ref).item() / ref.abs().item() < 2e-3  # the logits are fp16, as the unfused head's
    assert all(rel(a, r) < 5e-3 for a, r in zip(got_g, ref_g))


def test_every_label_ignored_gives_nan_and_zero_gradients():
    x, w, b, y = make(10, 8, 20)
    y[:] = -100
    for backend in ("torch", "triton"):
        loss = linear_cross_entropy(x, w, y, b, backend=backend, chunk=4)
        assert torch.isnan(loss)  # as F.cross_entropy
        grads = torch.autograd.grad(loss * 0.0, leaves(x, w, b))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)  # not NaN: a rank without labels adds 0


def test_backward_twice_through_a_retained_graph():
    # torch's zero-bubble (ZBV) pipeline schedule runs a node once for the inputs and once for the weights
    x, w, b, y = make(20, 8, 30)
    loss = linear_cross_entropy(x, w, y, b, chunk=6) * 0.5
    first = torch.autograd.grad(loss, leaves(x, w, b), retain_graph=True)
    second = torch.autograd.grad(loss, leaves(x, w, b))
    assert all(torch.equal(a, c) for a, c in zip(first, second))


def test_no_grad_and_frozen_weight():
    x, w, b, y = make(20, 8, 30)
    want = linear_cross_entropy_ref(x, w, y, b)
    with torch.no_grad():
        got = linear_cross_entropy(x, w, y, b, chunk=7)
    assert got.grad_fn is None
    torch.testing.assert_close(got, want.detach())
    w.requires_grad_(False)
    loss = linear_cross_entropy(x, w, y, None, chunk=7)
    loss.backward()
    assert x.grad is not None and w.grad is None


def test_autocast_makes_bf16_logits_like_the_unfused_head():
    x, w, b, y = make(16, 8, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(x, w, y, b, chunk=5, backend="torch")
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w, b).float(), y)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_errors():
    x, w, b, y = make(6, 8, 10)
    with pytest.raises(IndexError, match="label 10 outside"):
        linear_cross_entropy(x, w, torch.tensor([0, 1, 2, 3, 4, 10]))
    with pytest.raises(ValueError, match="one label per row"):
        linear_cross_entropy(x, w, y[:5])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, y, reduction="max")
    with pytest.raises(ValueError, match="return_entropy needs reduction='none'"):
        linear_cross_entropy(x, w, y, return_entropy=True)
    with pytest.raises(TypeError, match="one dtype"):
        linear_cross_entropy(x, w.double(), y, backend="torch")
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(x, w, y, chunk=0)


def test_default_chunk_depends_on_shapes_only():
    assert default_chunk(16384, 50257) == (1 << 24) // 50257
    assert default_chunk(10, 50257) == 10 and default_chunk(0, 7) == 1
    assert default_chunk(16384, 50257, "cpu", torch.bfloat16) == (1 << 24) // 50257  # CPU: the dtype is not read


def test_default_chunk_on_cuda_is_wide():
    # 512 MiB of logits in their dtype, whole 128-row tiles: the matmuls of a chunk are wide (with the CPU rule's
    # 130-row chunks at vocab 128256 the bf16 step ran 3.7x slower than the unfused head on an H200)
    bf16 = torch.bfloat16
    assert default_chunk(16384, 128256, "cuda", bf16) == 2048
    assert default_chunk(16384, 128256, "cuda", F32) == 1024
    assert default_chunk(16384, 128256 // 8, "cuda", bf16) == 16384  # a tp8 slice: every row in one chunk
    assert default_chunk(100, 10 ** 9, "cuda", bf16) == 1 and default_chunk(0, 7, "cuda", bf16) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 384], ids=["default-chunk", "c384"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, F16], ids=["bf16", "fp16"])
def test_cuda_half_precision_against_float64(dtype, chunk):
    # compiled on CUDA: the Triton row kernels, and dW summed in fp32 over chunks (by torch.addmm with
    # out_dtype=float32 where torch has it, else a half product per chunk added in fp32). Against float64: fp16
    # within the CPU half-precision test's bounds, bf16 (3 fewer mantissa bits) within twice them; and dW no
    # further off than twice the unfused head's in the same dtype (on CPU's torch path: bf16 dW 2.4e-3 off,
    # the unfused head's 1.8e-3; fp16 3.4e-4 and 3.3e-3)
    g = torch.Generator().manual_seed(0)
    n, h, v = 3000, 128, 5000
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (0.05 * torch.randn(v, h, generator=g)).to(dtype)
    b = (0.05 * torch.randn(v, generator=g)).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    ref, ref_g = float64_reference(x, w, b, y)
    xc, wc, bc = (t.cuda().requires_grad_() for t in (x, w, b))
    got, got_g = value_and_grads(linear_cross_entropy, xc, wc, bc, y.cuda(), chunk=chunk)
    _, unfused_g = value_and_grads(linear_cross_entropy_ref, xc, wc, bc, y.cuda())
    assert got.dtype == F32 and all(t.dtype == dtype and t.is_cuda for t in got_g)
    assert abs(got.double().cpu() - ref).item() / ref.abs().item() < 2e-3  # the logits are half, as the unfused head's
    bound = 5e-3 if dtype == F16 else 1e-2
    assert all(rel(a.cpu(), r) < bound for a, r in zip(got_g, ref_g))
    assert rel(got_g[1].cpu(), ref_g[1]) <= 2 * rel(unfused_g[1].cpu(), ref_g[1]) + 1e-4


# ---------------------------------------------------------------- vocab-parallel


class ThreadGroup:
    """An in-process stand-in for a process group: ``reduce(t, op)`` all-reduces in place over threads."""

    def __init__(self, p):
        self.p, self.barrier, self.slots = p, threading.Barrier(p), [None] * p
        self.calls = 0

    def reducer(self, rank):
        def reduce(t, op):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()
            if rank == 0:
                self.calls += 1
            t.copy_(out)
            return t
        return reduce


def run_threads(rank, p):
    """``rank(r)`` for r in range(p), one thread each, the backend chosen by the automatic rule."""
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(p)]
    with use_backend(None):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)


def vocab_parallel(x, w, b, y, p, chunk, backend):
    """Each of ``p`` threads holds a slice of the vocabulary padded to a multiple of p: (loss per rank, summed
    dx, whole dW, whole db) and the number of reduces per rank."""
    v = w.shape[0]
    vp = -(-v // p) * p
    n = vp // p
    wpad = torch.cat([w.detach(), torch.zeros(vp - v, w.shape[1], dtype=w.dtype)])
    bpad = torch.cat([b.detach(), torch.zeros(vp - v, dtype=b.dtype)])
    group, results = ThreadGroup(p), [None] * p

    def rank(r):
        xs = x.detach().clone().requires_grad_()
        ws = wpad[r * n:(r + 1) * n].clone().requires_grad_()
        bs = bpad[r * n:(r + 1) * n].clone().requires_grad_()
        loss = linear_cross_entropy(xs, ws, y, bs, chunk=chunk, vocab_start=r * n, vocab_size=v,
                                    reduce=group.reducer(r), backend=backend)
        results[r] = (loss.detach(), *torch.autograd.grad(loss * 1.7, (xs, ws, bs)))

    run_threads(rank, p)
    assert all(r is not None for r in results), "a rank failed"
    losses = [r[0] for r in results]
    dx = sum(r[1] for r in results)
    dw, db = torch.cat([r[2] for r in results])[:v], torch.cat([r[3] for r in results])[:v]
    pads = (torch.cat([r[2] for r in results])[v:], torch.cat([r[3] for r in results])[v:])
    return losses, (dx, dw, db), pads, group.calls


@pytest.fixture
def serial_interpreter(monkeypatch):
    """The Triton interpreter is not thread-safe: one launch at a time (the threads still meet at every reduce)."""
    mod = importlib.import_module("cuboid.kernels.linear_cross_entropy")  # (the package attribute is the function)

    lock = threading.Lock()
    for name in ("_stats_triton", "_grad_triton"):
        fn = getattr(mod, name)

        def locked(*args, _fn=fn):
            with lock:
                return _fn(*args)
        monkeypatch.setattr(mod, name, locked)


@pytest.mark.usefixtures("serial_interpreter")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("v,p", [(53, 4), (5, 4), (64, 2)], ids=["53-over-4", "5-over-4-pad-only-slice", "64-over-2"])
def test_vocab_parallel_slices_equal_the_whole_head(v, p, backend):
    x, w, b, y = make(23, 8, v)
    losses, grads, pads, calls = vocab_parallel(x, w, b, y, p, chunk=6, backend=backend)
    ref, ref_g = float64_reference(x, w, b, y)
    assert all(torch.equal(loss, losses[0]) for loss in losses)  # every rank the same loss
    assert abs(losses[0].double() - ref).item() / ref.abs().item() < 1e-6
    assert all(rel(a, r) < 1e-5 for a, r in zip(grads, ref_g))
    assert all(torch.equal(t, torch.zeros_like(t)) for t in pads)  # padding rows: exactly zero gradient
    assert calls == 2 * -(-23 // 6)  # per chunk: the max, then (sum of exponentials, target)


# ---------------------------------------------------------------- reduction="none": per-row log-probabilities


def float64_rows(x, w, b, y):
    """(-log p(label) per row, 0 where ignored; entropy per row; grads of sum(rows * up)) from float64 logits,
    as ``log_softmax(logits.double()).gather``; ``up`` the rows' upstream gradient, seeded."""
    d = [t.detach().double().requires_grad_() for t in leaves(x, w, b)]
    x64, w64, b64 = d[0], d[1], (d[2] if b is not None else None)
    logp = torch.log_softmax(torch.nn.functional.linear(x64, w64, b64), -1)
    valid = y != -100
    rows = torch.where(valid, -logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    up = upstream_rows(y)
    return rows.detach(), entropy.detach(), torch.autograd.grad((rows * up.double()).sum(), d)


def upstream_rows(y):
    return (torch.randn(y.shape, generator=torch.Generator().manual_seed(7)) * 2).to(y.device)


def rows_and_grads(x, w, b, y, **kw):
    rows, entropy = linear_cross_entropy(x, w, y, b, reduction="none", return_entropy=True, **kw)
    assert not entropy.requires_grad
    return rows.detach(), entropy, torch.autograd.grad((rows * upstream_rows(y)).sum(), leaves(x, w, b))


NONE_TOL = {F32: (1e-6, 1e-5), F16: (2e-3, 5e-3)}  # (rows and entropy: relative; gradients: relative norm)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n,h,v,chunk", CASES[:3], ids=[f"{n}x{h}x{v}-c{c}" for n, h, v, c in CASES[:3]])
def test_none_equals_float64_log_softmax(n, h, v, chunk, dtype, backend):
    x, w, b, y = make(n, h, v, dtype=dtype, ignore_every=3)
    rows, entropy, grads = rows_and_grads(x, w, b, y, chunk=chunk, backend=backend)
    ref, ref_entropy, ref_grads = float64_rows(x, w, b, y)
    value_tol, grad_tol = NONE_TOL[dtype]
    assert rows.dtype == F32 and rows.shape == (n,) and torch.all(rows[y == -100] == 0)
    assert rel(rows, ref) < value_tol and rel(entropy, ref_entropy) < value_tol
    assert all(g.dtype == dtype and rel(g, r) < grad_tol for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_none_keeps_the_labels_shape_and_sums_to_the_sum_reduction(backend):
    x, w, b, y = make(24, 16, 70)
    x3, y3 = x.detach().view(2, 12, 16).requires_grad_(), y.view(2, 12)  # (B, T, H) rows
    rows = linear_cross_entropy(x3, w, y3, b, reduction="none", chunk=5, backend=backend)
    total = linear_cross_entropy(x3, w, y3, b, reduction="sum", chunk=5, backend=backend)
    assert rows.shape == (2, 12)
    torch.testing.assert_close(rows.sum(), total, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        again = linear_cross_entropy(x3, w, y3, b, reduction="none", chunk=5, backend=backend)
    assert again.grad_fn is None and torch.equal(again, rows.detach())


def test_none_extreme_logits_and_long_rows_in_triton():
    # two column blocks of the row programs (4096 wide), logits around +-80: the entropy's sum moves with the max
    x, w, b, y = make(5, 8, 4100, scale=40.0, ignore_every=2)
    rows, entropy, grads = rows_and_grads(x, w, b, y, chunk=3, backend="triton")
    ref, ref_entropy, ref_grads = float64_rows(x, w, b, y)
    assert rel(rows, ref) < 1e-6 and (entropy.double() - ref_entropy).abs().max() < 1e-4
    assert all(rel(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


def test_none_backward_twice_through_a_retained_graph():
    x, w, b, y = make(20, 8, 30)
    loss = (linear_cross_entropy(x, w, y, b, reduction="none", chunk=6) * upstream_rows(y)).sum()
    first = torch.autograd.grad(loss, leaves(x, w, b), retain_graph=True)
    second = torch.autograd.grad(loss, leaves(x, w, b))
    assert all(torch.equal(a, c) for a, c in zip(first, second))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, F16], ids=["bf16", "fp16"])
def test_none_on_cuda_against_float64(dtype):
    # compiled on CUDA: the statistics kernel's ENTROPY form and the gradient kernel's per-row scale; bounds as
    # the summed loss's CUDA test (fp16 5e-3, bf16 twice it)
    g = torch.Generator().manual_seed(0)
    n, h, v = 1500, 128, 5000
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (0.05 * torch.randn(v, h, generator=g)).to(dtype)
    b = (0.05 * torch.randn(v, generator=g)).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    y[::7] = -100
    ref, ref_entropy, ref_grads = float64_rows(x, w, b, y)
    xc, wc, bc = (t.cuda().requires_grad_() for t in (x, w, b))
    rows, entropy, grads = rows_and_grads(xc, wc, bc, y.cuda(), chunk=384)
    bound = 5e-3 if dtype == F16 else 1e-2
    assert rel(rows.cpu(), ref) < bound and rel(entropy.cpu(), ref_entropy) < bound
    assert all(t.dtype == dtype and rel(t.cpu(), r) < bound for t, r in zip(grads, ref_grads))


def vocab_parallel_rows(x, w, b, y, p, chunk, backend):
    """``p`` threads each holding a slice of the vocabulary padded to a multiple of p, reduction "none": (rows
    and entropy per rank, (summed dx, whole dW, whole db) of sum(rows * up), reduces per rank)."""
    v = w.shape[0]
    n = -(-v // p)
    wpad = torch.cat([w.detach(), torch.zeros(n * p - v, w.shape[1], dtype=w.dtype)])
    bpad = torch.cat([b.detach(), torch.zeros(n * p - v, dtype=b.dtype)])
    group, results = ThreadGroup(p), [None] * p

    def rank(r):
        xs = x.detach().clone().requires_grad_()
        ws, bs = (t[r * n:(r + 1) * n].clone().requires_grad_() for t in (wpad, bpad))
        rows, ent = linear_cross_entropy(xs, ws, y, bs, reduction="none", return_entropy=True, chunk=chunk,
                                         vocab_start=r * n, vocab_size=v, reduce=group.reducer(r), backend=backend)
        results[r] = (rows.detach(), ent, torch.autograd.grad((rows * upstream_rows(y)).sum(), (xs, ws, bs)))

    run_threads(rank, p)
    assert all(r is not None for r in results), "a rank failed"
    grads = (sum(r[2][0] for r in results), torch.cat([r[2][1] for r in results])[:v],
             torch.cat([r[2][2] for r in results])[:v])
    return [r[0] for r in results], [r[1] for r in results], grads, group.calls


@pytest.mark.usefixtures("serial_interpreter")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("v,p", [(53, 2), (5, 4)], ids=["53-over-2", "5-over-4-pad-only-slice"])
def test_none_vocab_parallel_slices_equal_float64(v, p, backend):
    x, w, b, y = make(23, 8, v, ignore_every=3)
    rows, entropies, grads, calls = vocab_parallel_rows(x, w, b, y, p, chunk=6, backend=backend)
    ref, ref_entropy, ref_grads = float64_rows(x, w, b, y)
    assert all(torch.equal(r, rows[0]) and torch.equal(e, entropies[0]) for r, e in zip(rows, entropies))
    assert rel(rows[0], ref) < 1e-6 and rel(entropies[0], ref_entropy) < 1e-6
    assert all(rel(g, r) < 1e-5 for g, r in zip(grads, ref_grads))
    assert calls == 2 * -(-23 // 6)  # per chunk in forward: the max, then the sums; none in backward
