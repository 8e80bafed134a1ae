"""The large-batch recipe's exclusion in LAMB and LARS built the plain way (``Opt(model.parameters())``).

Parameters with ``ndim <= 1`` (biases, norm weights) take no weight decay and
no trust ratio: checked on one device against float64 momentum SGD / Adam
for those tensors (and against the trust-ratio rule for the others), and
under tp=2 and dp=2 with ZeRO-2 (whose flat 1-D pieces must not count as
1-D parameters) against one device, on 2 gloo ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from cuboid.parallel.optim import LAMB, LARS, exclude_bias_and_norm

from .launch import run_world


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _steps(model, opt, n=3, zero_grads_of_1d=False):
    gen = torch.Generator().manual_seed(1)
    for _ in range(n):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(model(x), y).backward()
        if zero_grads_of_1d:
            for p in model.parameters():
                if p.ndim <= 1:
                    p.grad.zero_()
        opt.step()
        opt.zero_grad()


def test_plain_lars_takes_momentum_sgd_steps_for_1d_params():
    lr, momentum, wd = 0.5, 0.9, 0.1
    model = _model()
    init = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    opt = LARS(model.parameters(), lr=lr, momentum=momentum, eta=0.02, weight_decay=wd)
    # float64 replay: the same gradients (recomputed on a float64 twin stepped by the rule)
    twin = _model().double()
    bufs = {n: torch.zeros_like(p) for n, p in twin.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    _steps(model, opt)
    for _ in range(3):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        nn.functional.cross_entropy(twin(x.double()), y).backward()
        with torch.no_grad():
            for n, w in twin.named_parameters():
                g = w.grad
                if w.ndim >= 2:  # adapted and decayed: r = eta ||w|| / (||g|| + wd ||w||)
                    r = 0.02 * w.norm() / (g.norm() + wd * w.norm())
                    bufs[n] = momentum * bufs[n] + lr * r * (g + wd * w)
                else:  # excluded: plain momentum SGD, no decay
                    bufs[n] = momentum * bufs[n] + lr * g
                w -= bufs[n]
                w.grad = None
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), dict(twin.named_parameters())[n].detach(),
                                   rtol=1e-5, atol=1e-6, msg=n)
        assert not torch.equal(p.detach().double(), init[n]), n  # every tensor moved


def test_plain_lamb_and_lars_leave_1d_params_undecayed_and_match_explicit_groups():
    from cuboid.kernels import use_backend

    with use_backend("torch"):  # the torch reference, not the Triton interpreter (tests/conftest.py)
        _undecayed_and_explicit_groups()


def _undecayed_and_explicit_groups():
    for cls, kw in ((LAMB, dict(lr=1e-2, weight_decay=0.5)), (LARS, dict(lr=0.5, eta=0.02, weight_decay=0.5))):
        plain, grouped, adapted = _model(), _model(), _model()
        init = {n: p.detach().clone() for n, p in plain.named_parameters()}
        # zero gradients for the 1-D tensors: only weight decay (or a trust ratio's lr) could move them
        _steps(plain, cls(plain.parameters(), **kw), zero_grads_of_1d=True)
        for n, p in plain.named_parameters():
            if p.ndim <= 1:
                assert torch.equal(p.detach(), init[n]), (cls.__name__, n, "a 1-D parameter was decayed")
            else:
                assert not torch.equal(p.detach(), init[n]), (cls.__name__, n)
        # with gradients: the plain optimizer equals the explicit two-group recipe, and differs from
        # adapting everything (exclude_1d=False), so the exclusion is what makes the difference
        grouped_kw = {k: v for k, v in kw.items() if k != "weight_decay"}
        plain = _model()
        _steps(plain, cls(plain.parameters(), **kw))
        _steps(grouped, cls(exclude_bias_and_norm(grouped, kw["weight_decay"]), exclude_1d=False, **grouped_kw))
        _steps(adapted, cls(adapted.parameters(), exclude_1d=False, **kw))
        for (n, a), b, c in zip(plain.named_parameters(), grouped.parameters(), adapted.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{cls.__name__} {n}")
            if a.ndim <= 1:
                assert (a - c).abs().max() > 1e-4, (cls.__name__, n, "exclude_1d=False took the same steps")


# --------------------------------------------------------------------------- under plans, 2 ranks

PLANS = (("tp=2", "lars"), ("dp=2,zero=2", "lamb"), ("dp=2,zero=2", "lars"))


def _run(plan, kind, exclude_1d):
    import cuboid
    from cuboid.parallel.optim import LAMB, LARS

    from .test_data_parallel import global_batch

    model = cuboid.load("gpt-debug", plan, seed=0, vocab_size=510).train()
    opt = (LARS(model.parameters(), lr=0.5, eta=0.02, weight_decay=1e-2, exclude_1d=exclude_1d) if kind == "lars"
           else LAMB(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.1, exclude_1d=exclude_1d))
    for _ in range(3):
        cuboid.train_step(model, opt, global_batch("gpt-debug", model), max_grad_norm=1.0)
    return model


def exclusion_worker():
    import torch.distributed as dist

    from .test_plans import gathered, rel_norm

    report, refs = {}, {}
    for plan, kind in PLANS:
        if kind not in refs:
            refs[kind] = {excl: dict(_run(None, kind, excl).named_parameters()) for excl in (True, False)}
        ref = refs[kind]
        pairs = gathered(_run(plan, kind, True))
        flat = torch.cat([t.flatten() for _, t in pairs])
        report[f"{plan}/{kind}"] = {
            "err": rel_norm(flat, torch.cat([ref[True][n].detach().flatten() for n, _ in pairs])),
            # the same run adapting every tensor: far off, so the parity above is the exclusion's
            "vs_adapted": rel_norm(flat, torch.cat([ref[False][n].detach().flatten() for n, _ in pairs])),
            "n_1d": sum(t.ndim <= 1 for _, t in pairs)}
    dist.barrier()
    return report


def test_exclusion_is_exact_under_tp2_and_zero2():
    for rank, report in enumerate(run_world(exclusion_worker, 2, timeout=240)):
        assert len(report) == len(PLANS)
        for key, r in report.items():
            assert r["n_1d"] > 0, (rank, key)
            assert r["err"] < 1e-6, (rank, key, r)
            assert r["vs_adapted"] > 1e-4, (rank, key, r)
