"""Fused multi-tensor optimizers: kernels/optim.py and parallel/optim.py.

Both backends (torch reference and Triton through the interpreter) against
torch.optim.AdamW and float64 implementations of the LAMB and LARS papers'
update rules, plus master weights, the norm_reducer hook, state_dict
round-trips, launch counts and input errors.
"""
import copy
import math

import pytest
import torch

from cuboid.kernels import optim as K
from cuboid.parallel.optim import AdamW, LAMB, LARS, clip_grad_norm_, exclude_bias_and_norm

BACKENDS = ["torch", "triton"]
SHAPES = [(7,), (33, 5), (1,), (128, 3)]


def _grads(shapes, steps, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]


def _params(shapes, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def _run(opt, params, grads_seq):
    for gs in grads_seq:
        for p, g in zip(params, gs):
            p.grad = g.to(p.dtype).clone()
        opt.step()


# --------------------------------------------------------------------------- AdamW vs torch

@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_matches_torch(backend, maximize):
    grads = _grads(SHAPES, 5)
    ours, ref = _params(SHAPES), _params(SHAPES)
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, maximize=maximize)
    _run(AdamW(ours, backend=backend, **kw), ours, grads)
    _run(torch.optim.AdamW(ref, **kw), ref, grads)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- float64 paper rules

def _lamb64(ws, grads_seq, lr, b1, b2, eps, wds, trusts):
    ws = [w.detach().double().clone() for w in ws]
    m = [torch.zeros_like(w) for w in ws]
    v = [torch.zeros_like(w) for w in ws]
    for t, gs in enumerate(grads_seq, 1):
        for i, g in enumerate(gs):
            g = g.double()
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            u = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + eps) + wds[i] * ws[i]
            wn, un = ws[i].norm().item(), u.norm().item()
            r = wn / un if trusts[i] and wn > 0 and un > 0 else 1.0
            ws[i] = ws[i] - lr * r * u
    return ws


def _lars64(ws, grads_seq, lr, momentum, eta, wds, trusts):
    ws = [w.detach().double().clone() for w in ws]
    buf = [torch.zeros_like(w) for w in ws]
    for gs in grads_seq:
        for i, g in enumerate(gs):
            g = g.double()
            wn, gn = ws[i].norm().item(), g.norm().item()
            r = eta * wn / (gn + wds[i] * wn) if trusts[i] and wn > 0 and gn > 0 else 1.0
            buf[i] = momentum * buf[i] + lr * r * (g + wds[i] * ws[i])
            ws[i] = ws[i] - buf[i]
    return ws


# group 0: decayed, trust ratio on, includes an all-zero tensor (||w|| = 0 -> r = 1);
# group 1: opted out (biases / norms): no decay, no trust ratio.
GROUP0 = [(7,), (33, 5), (128, 3), (4, 4)]
GROUP1 = [(1,), (5,)]


def _grouped_params():
    ps = _params(GROUP0 + GROUP1)
    with torch.no_grad():
        ps[3].zero_()
    return ps


@pytest.mark.parametrize("backend", BACKENDS)
def test_lamb_matches_float64_rule(backend):
    ps = _grouped_params()
    init = [p.detach().clone() for p in ps]
    grads = _grads(GROUP0 + GROUP1, 5)
    n0 = len(GROUP0)
    opt = LAMB([{"params": ps[:n0]}, {"params": ps[n0:], "weight_decay": 0.0, "trust_ratio": False}],
               lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1, exclude_1d=False, backend=backend)
    _run(opt, ps, grads)  # group 0 adapts and decays its 1-D tensor too (exclude_1d=False): the rule as written
    wds, trusts = [0.1] * n0 + [0.0] * len(GROUP1), [True] * n0 + [False] * len(GROUP1)
    want = _lamb64(init, grads, 1e-2, 0.9, 0.99, 1e-6, wds, trusts)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-6)
    assert opt.last_norms[0][1].shape == (2, n0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lars_matches_float64_rule(backend):
    ps = _grouped_params()
    init = [p.detach().clone() for p in ps]
    grads = _grads(GROUP0 + GROUP1, 5)
    opt = LARS(exclude_bias_and_norm([(str(i), p) for i, p in enumerate(ps)], weight_decay=1e-2),
               lr=0.5, momentum=0.9, eta=0.02, backend=backend)
    _run(opt, ps, grads)
    wds = [1e-2 if p.ndim >= 2 else 0.0 for p in ps]
    trusts = [p.ndim >= 2 for p in ps]
    want = _lars64(init, grads, 0.5, 0.9, 0.02, wds, trusts)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-6)
    assert opt.last_norms[0][1].shape == (2, sum(trusts))  # the decayed, trust-ratio group


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_tensor_flags_in_one_call(backend):
    """Mixed per-tensor weight decay / trust flags in a single kernel call."""
    shapes = GROUP0 + GROUP1
    wds, trusts = [0.1, 0.0, 0.05, 0.1, 0.0, 0.2], [True, False, True, True, False, True]
    grads = _grads(shapes, 3)
    ps = [p.detach() for p in _grouped_params()]
    init = [p.clone() for p in ps]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for t, gs in enumerate(grads, 1):
        norms = K.lamb_step(ps, gs, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=wds,
                            step=t, trust_ratio=trusts, backend=backend)
        assert norms.shape == (2, len(ps)) and norms.dtype == torch.float32
    want = _lamb64(init, grads, 1e-2, 0.9, 0.99, 1e-6, wds, trusts)
    for p, w in zip(ps, want):
        torch.testing.assert_close(p.double(), w, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- master weights

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [AdamW, LAMB, LARS])
def test_master_weights_fp16(cls, backend):
    kw = dict(lr=0.5, eta=0.02) if cls is LARS else dict(lr=1e-2)
    init = [p.detach().half() for p in _params(SHAPES)]  # fp16-representable start
    grads = _grads(SHAPES, 5, dtype=torch.float16)  # fp16-representable grads
    full = [p.float().requires_grad_() for p in init]
    half = [p.clone().requires_grad_() for p in init]
    _run(cls(full, weight_decay=0.05, backend=backend, **kw), full, [[g.float() for g in gs] for gs in grads])
    opt = cls(half, weight_decay=0.05, backend=backend, **kw)
    _run(opt, half, grads)
    for p, f in zip(half, full):
        master = opt.state[p]["master"]
        assert p.dtype == torch.float16 and master.dtype == torch.float32
        assert torch.equal(p.detach(), master.half())
        torch.testing.assert_close(master, f.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.float(), f.detach(), rtol=1e-3, atol=1e-3)


def test_no_master_weights_updates_half_in_place():
    p = _params([(9, 4)], dtype=torch.float16)[0]
    opt = AdamW([p], lr=1e-2, master_weights=False)
    before = p.detach().clone()
    _run(opt, [p], _grads([(9, 4)], 2, dtype=torch.float16))
    assert "master" not in opt.state[p] and opt.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.float16 and not torch.equal(p.detach(), before)


# --------------------------------------------------------------------------- norm_reducer

@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_reducer_result_is_used(backend):
    shapes = [(7,), (33, 5), (128, 3)]
    gs = _grads(shapes, 1)[0]
    seen = []

    def quadruple_w(sq):  # ||w|| doubles -> LAMB ratio doubles -> step doubles
        seen.append(tuple(sq.shape))
        return sq * torch.tensor([[4.0], [1.0]])

    def lamb(reducer):
        ps = [p.detach() for p in _params(shapes)]
        before = [p.clone() for p in ps]
        norms = K.lamb_step(ps, gs, [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                            lr=1e-2, weight_decay=0.1, step=1, norm_reducer=reducer, backend=backend)
        return [b - p for p, b in zip(ps, before)], norms

    d0, n0 = lamb(None)
    d1, n1 = lamb(quadruple_w)
    assert seen == [(2, 3)]
    torch.testing.assert_close(n1[0], 2 * n0[0])
    torch.testing.assert_close(n1[1], n0[1])
    for a, b in zip(d0, d1):
        torch.testing.assert_close(b, 2 * a, rtol=1e-5, atol=1e-6)  # deltas ~1e-2, fp32 cancellation

    def in_place(sq):  # an all_reduce-style reducer returns None
        sq[0].mul_(4.0)

    def lars(reducer):
        ps = [p.detach() for p in _params(shapes)]
        before = [p.clone() for p in ps]
        K.lars_step(ps, gs, [torch.zeros_like(p) for p in ps], lr=0.5, eta=0.02, weight_decay=0.0,
                    norm_reducer=reducer, backend=backend)
        return [b - p for p, b in zip(ps, before)]

    for a, b in zip(lars(None), lars(in_place)):
        torch.testing.assert_close(b, 2 * a, rtol=1e-5, atol=1e-6)  # deltas ~1e-2, fp32 cancellation


# --------------------------------------------------------------------------- state_dict

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [AdamW, LAMB, LARS])
def test_state_dict_round_trip_continues_exactly(cls, backend):
    shapes = [(7,), (33, 5), (5,)]
    grads = _grads(shapes, 5)

    def fresh():  # mixed: an fp16 param (with master) beside fp32 ones
        ps = _params(shapes)
        ps[1] = ps[1].detach().half().requires_grad_()
        return ps, cls(exclude_bias_and_norm([(str(i), p) for i, p in enumerate(ps)], 0.05,
                                             lr=1e-2), backend=backend)

    straight, opt = fresh()
    _run(opt, straight, grads)

    first, opt_a = fresh()
    _run(opt_a, first, grads[:2])
    saved = copy.deepcopy(opt_a.state_dict())
    second, opt_b = fresh()
    with torch.no_grad():
        for dst, src in zip(second, first):
            dst.copy_(src)
    opt_b.load_state_dict(saved)
    assert opt_b.state[second[1]]["master"].dtype == torch.float32
    assert opt_b.state[second[1]]["step"] == 2
    _run(opt_b, second, grads[2:])
    for a, b in zip(straight, second):
        assert torch.equal(a, b)
    for a, b in zip(straight, second):
        for k, v in opt.state[a].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_b.state[b][k])), k


# --------------------------------------------------------------------------- launches

def _count_launches(monkeypatch):
    calls = []
    real = K._launch

    def counting(kernel, n_programs, *args, **meta):
        calls.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        real(kernel, n_programs, *args, **meta)

    monkeypatch.setattr(K, "_launch", counting)
    return calls


def test_triton_launches_once_per_dtype_group(monkeypatch):
    calls = _count_launches(monkeypatch)
    shapes = [(7,), (33, 5), (1,), (128, 3), (3, 3), (10,)]
    ps = [p.detach() for p in _params(shapes)]
    for i in (1, 3, 5):
        ps[i] = ps[i].half()
    masters = [p.float() if p.dtype == torch.float16 else None for p in ps]
    gs = [g.to(p.dtype) for g, p in zip(_grads(shapes, 1)[0], ps)]
    zeros = lambda: [torch.zeros(p.shape) for p in ps]  # noqa: E731
    K.adamw_step(ps, gs, zeros(), zeros(), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 step=1, master_params=masters, backend="triton")
    assert calls == ["_adamw_kernel"] * 2  # two dtype groups, six tensors
    calls.clear()
    K.lamb_step(ps, gs, zeros(), zeros(), lr=1e-3, step=1, master_params=masters, backend="triton")
    assert sorted(calls) == sorted(["_lamb_phase1_kernel"] * 2 + ["_segment_sum_kernel"] + ["_lamb_phase2_kernel"] * 2)
    calls.clear()
    K.lars_step(ps, gs, zeros(), lr=1e-3, master_params=masters, backend="triton")
    assert sorted(calls) == sorted(["_sumsq_kernel"] * 2 + ["_segment_sum_kernel"] + ["_lars_phase2_kernel"] * 2)


def test_launch_tables_are_cached(monkeypatch):
    monkeypatch.setattr(K, "_PLANS", type(K._PLANS)())
    ps = [p.detach() for p in _params(SHAPES)]
    m, v = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    gs = [torch.empty_like(p) for p in ps]
    for step, new in enumerate(_grads(SHAPES, 3), 1):
        torch._foreach_copy_(gs, new)  # same grad tensors every step, as with zero_grad(set_to_none=False)
        K.adamw_step(ps, gs, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=step,
                     backend="triton")
    assert len(K._PLANS) == 1
    K.adamw_step(ps[:2], gs[:2], m[:2], v[:2], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                 step=4, backend="triton")
    assert len(K._PLANS) == 2  # a different tensor list gets its own tables


@pytest.mark.parametrize("op", ["lamb", "lars", "norm"])
def test_multi_block_tensors_match_reference(monkeypatch, op):
    """Small blocks: tensors span many programs and the segment sum loops."""
    monkeypatch.setattr(K, "BLOCK", 16)
    monkeypatch.setattr(K, "_SEGMENT_BLOCK", 2)
    shapes = [(33, 5), (7,), (128, 3), (0, 4)]
    gs = _grads(shapes, 1)[0]
    outs = {}
    for backend in BACKENDS:
        ps = [p.detach() for p in _params(shapes)]
        states = [[torch.zeros_like(p) for p in ps] for _ in range(2)]
        if op == "lamb":
            norms = K.lamb_step(ps, gs, *states, lr=1e-2, step=1, backend=backend)
        elif op == "lars":
            norms = K.lars_step(ps, gs, states[0], lr=0.5, eta=0.02, weight_decay=1e-2, backend=backend)
        else:
            norms = K.grad_norm_sq(gs, per_tensor=True, backend=backend)
            ps = []
        outs[backend] = (norms, ps)
    torch.testing.assert_close(outs["triton"][0], outs["torch"][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs["triton"][1], outs["torch"][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- clipping

@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_grad_norm_matches_torch(backend):
    ours, ref = _params(SHAPES), _params(SHAPES)
    for p, q, g in zip(ours, ref, _grads(SHAPES, 1)[0]):
        p.grad, q.grad = g.clone(), g.clone()
    total = clip_grad_norm_(ours, 1.0, backend=backend)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(total, want)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad)
    sq = K.grad_norm_sq([p.grad for p in ours], backend=backend)
    assert sq.shape == () and math.isclose(sq.item(), 1.0, rel_tol=1e-5)


# --------------------------------------------------------------------------- errors

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise_clear_errors(backend):
    ps = [torch.zeros(3), torch.zeros(2, 2)]
    st = lambda: [torch.zeros(3), torch.zeros(2, 2)]  # noqa: E731
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, backend=backend)
    with pytest.raises(ValueError, match=r"adamw_step: got 2 params but 1 grads"):
        K.adamw_step(ps, st()[:1], st(), st(), **kw)
    with pytest.raises(ValueError, match=r"grads\[1\] has shape \(4,\) but params\[1\] has shape \(2, 2\)"):
        K.adamw_step(ps, [torch.zeros(3), torch.zeros(4)], st(), st(), **kw)
    with pytest.raises(TypeError, match=r"exp_avg_sqs\[0\] has dtype float16, expected float32"):
        K.adamw_step(ps, st(), st(), [torch.zeros(3).half(), torch.zeros(2, 2)], **kw)
    with pytest.raises(TypeError, match=r"master_params\[1\] has dtype float16"):
        K.adamw_step(ps, st(), st(), st(), master_params=[None, torch.zeros(2, 2).half()], **kw)
    with pytest.raises(ValueError, match=r"step must be an int >= 1"):
        K.adamw_step(ps, st(), st(), st(), **{**kw, "step": 0})
    with pytest.raises(ValueError, match=r"lamb_step: got 2 params but 3 weight_decay values"):
        K.lamb_step(ps, st(), st(), st(), lr=1e-3, step=1, weight_decay=[0.0, 0.1, 0.2], backend=backend)
    with pytest.raises(ValueError, match=r"lars_step: momentum_buffers\[0\] has shape \(2,\)"):
        K.lars_step(ps, st(), [torch.zeros(2), torch.zeros(2, 2)], lr=1e-3, backend=backend)


def test_triton_contiguity():
    p = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match=r"params\[0\] is not contiguous"):
        K.lars_step([p], [torch.ones(6, 4)], [torch.zeros(6, 4)], lr=1e-3, backend="triton")
    # non-contiguous grads are read through a contiguous copy
    g = torch.randn(4, 6).t()
    outs = []
    for backend in BACKENDS:
        p = torch.ones(6, 4)
        K.lars_step([p], [g], [torch.zeros(6, 4)], lr=0.5, eta=0.02, backend=backend)
        outs.append(p)
    torch.testing.assert_close(outs[0], outs[1])


# --------------------------------------------------------------------------- GPU: bf16

@pytest.mark.gpu
@pytest.mark.parametrize("cls", [AdamW, LAMB, LARS])
def test_bf16_master_weights_on_gpu(cls):
    kw = dict(lr=0.5, eta=0.02) if cls is LARS else dict(lr=1e-2)
    init = [p.detach().bfloat16().cuda() for p in _params(SHAPES + [(1000, 37)])]
    grads = [[g.cuda() for g in gs] for gs in _grads(SHAPES + [(1000, 37)], 5, dtype=torch.bfloat16)]
    results = {}
    for backend in BACKENDS:
        ps = [p.clone().requires_grad_() for p in init]
        opt = cls(ps, weight_decay=0.05, backend=backend, **kw)
        _run(opt, ps, grads)
        results[backend] = [(p.detach(), opt.state[p]["master"]) for p in ps]
    for (p, m), (q, n) in zip(results["triton"], results["torch"]):
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.bfloat16())
        torch.testing.assert_close(m, n, rtol=1e-5, atol=1e-6)
