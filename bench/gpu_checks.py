"""bench/gpu.py part 1: every kernel on the device against its torch reference (fp32 copies of the same inputs),
PASS when the worst error is within tolerance."""
from __future__ import annotations

import torch

from gpu_common import (ATTN_GRAD_TOL, ATTN_LSE_TOL, ATTN_OUT_TOL, ELEM_TOL, F32, LCE_TOL, NORM_TOL, OPT_F32_TOL,
                        dname, leaf, run_check)


def check_attention(results, K, cfg, dev, dtypes) -> None:
    b, h, s = cfg["b"], cfg["h"], cfg["s"]
    mask = torch.ones(b, s, dtype=torch.bool, device=dev)
    mask[1:, s - s // 3:] = False  # right padding: batch 0 full, the others lose their last third
    for i, dtype in enumerate(dtypes):
        # the first (most production-like) dtype gets every causal x mask combination, the rest two
        combos = [(False, False), (True, False), (False, True), (True, True)] if i == 0 else [(False, True), (True, False)]
        for d in cfg["dims"]:
            for causal, masked in combos:
                def case(d=d, causal=causal, masked=masked, dtype=dtype):
                    g = torch.Generator(device=dev).manual_seed(d + 2 * causal + masked)
                    q, k, v, do = (torch.randn(b, h, s, d, generator=g, device=dev).to(dtype) for _ in range(4))
                    dlse = torch.randn(b, h, s, generator=g, device=dev)
                    kpm = mask if masked else None
                    outs = []
                    for fn, inputs in ((K.attention, [leaf(t) for t in (q, k, v)]),
                                       (K.attention_ref, [leaf(t, F32) for t in (q, k, v)])):
                        out, lse = fn(*inputs, causal=causal, key_padding_mask=kpm, return_lse=True)
                        torch.autograd.backward([out, lse], [do.to(out.dtype), dlse])
                        outs.append([out, lse] + [t.grad for t in inputs])
                    (o, l, *gr), (ro, rl, *rgr) = outs
                    pairs = [("out", o, ro, *ATTN_OUT_TOL[dtype]), ("lse", l, rl, *ATTN_LSE_TOL[dtype])]
                    return pairs + [(n, a, r, *ATTN_GRAD_TOL[dtype]) for n, a, r in zip(("dq", "dk", "dv"), gr, rgr)]
                name = f"attention {dname(dtype)} d{d} s{s} {'causal' if causal else 'full'}{' +mask' if masked else ''}"
                run_check(results, name, case)


def check_norms(results, K, cfg, dev, dtypes) -> None:
    M = cfg["rows"]
    for kind in ("layer_norm", "rms_norm"):
        ours, ref = getattr(K, kind), getattr(K, kind + "_ref")
        for dtype in dtypes:
            for n in cfg["hidden"]:
                def case(n=n, dtype=dtype, kind=kind, ours=ours, ref=ref):
                    g = torch.Generator(device=dev).manual_seed(n)
                    x, r, dy, dh = (torch.randn(M, n, generator=g, device=dev).to(dtype) for _ in range(4))
                    w = (1 + 0.1 * torch.randn(n, generator=g, device=dev)).to(dtype)
                    bias = (0.1 * torch.randn(n, generator=g, device=dev)).to(dtype)
                    outs = []
                    for fn in (ours, ref):  # the reference rounds h = x + r to dtype too, as the kernel does
                        leaves = [leaf(t) for t in ((x, r, w, bias) if kind == "layer_norm" else (x, r, w))]
                        args = (leaves[0], leaves[2]) + ((leaves[3],) if kind == "layer_norm" else ())
                        y, hh = fn(*args, residual=leaves[1])
                        torch.autograd.backward([y, hh], [dy, dh])
                        outs.append([y, hh] + [t.grad for t in leaves])
                    names = ("y", "h", "dx", "dresidual", "dweight", "dbias")
                    return [(nm, a, e, *NORM_TOL[dtype]) for nm, a, e in zip(names, *outs)]
                run_check(results, f"{kind} {dname(dtype)} {M}x{n} +residual", case)


def check_optim(results, cfg_shapes, dev, dtypes) -> None:
    from cuboid.parallel.optim import LAMB, LARS, AdamW
    steps = 3
    kinds = {  # ours on dtype params (fp32 masters for halves) vs a reference on fp32 copies
        "adamw": (lambda ps: AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1),
                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)),
        "lamb": (lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01),
                 lambda ps: LAMB(ps, lr=1e-2, weight_decay=0.01, backend="torch")),
        "lars": (lambda ps: LARS(ps, lr=1.0, momentum=0.9, eta=0.01, weight_decay=1e-4),
                 lambda ps: LARS(ps, lr=1.0, momentum=0.9, eta=0.01, weight_decay=1e-4, backend="torch")),
    }
    for kind, (make_ours, make_ref) in kinds.items():
        for dtype in dtypes:
            def case(dtype=dtype, make_ours=make_ours, make_ref=make_ref):
                g = torch.Generator(device=dev).manual_seed(1)
                init = [torch.randn(s, generator=g, device=dev).to(dtype) for s in cfg_shapes]
                ps = [leaf(t) for t in init]
                rps = [leaf(t, F32) for t in init]
                opt, ropt = make_ours(ps), make_ref(rps)
                for _ in range(steps):
                    for p, rp in zip(ps, rps):
                        p.grad = torch.randn(p.shape, generator=g, device=dev).to(dtype)
                        rp.grad = p.grad.float()
                    opt.step()
                    ropt.step()
                pairs = []
                for i, (p, rp) in enumerate(zip(ps, rps)):
                    st, rst = opt.state[p], ropt.state[rp]
                    if dtype == F32:
                        pairs.append((f"param[{i}]", p, rp, *OPT_F32_TOL))
                    else:  # the half param is the rounded master: within one ulp of the rounded reference
                        pairs.append((f"param[{i}]", p, rp.to(dtype), 1e-6, torch.finfo(dtype).eps))
                        pairs.append((f"master[{i}]", st["master"], rp, *OPT_F32_TOL))
                    pairs += [(f"{key}[{i}]", st[key], rst[key], *OPT_F32_TOL) for key in type(opt)._state_keys]
                return pairs
            mode = "fp32 params" if dtype == F32 else f"{dname(dtype)} params + fp32 master"
            run_check(results, f"{kind} step x{steps} {mode}", case)


def check_rope(results, K, cfg, dev, dtypes) -> None:
    b, s_, h, hkv = cfg["b"], cfg["s"], cfg["h"], cfg["hkv"]
    for dtype in dtypes:
        for d in cfg["dims"]:
            def case(d=d, dtype=dtype):
                g = torch.Generator(device=dev).manual_seed(d)
                # Hugging Face's layout: (B, T, H, D) storage viewed as (B, H, T, D)
                q = torch.randn(b, s_, h, d, generator=g, device=dev).to(dtype).transpose(1, 2)
                k = torch.randn(b, s_, hkv, d, generator=g, device=dev).to(dtype).transpose(1, 2)
                dq, dk = torch.randn(q.shape, generator=g, device=dev).to(dtype), \
                    torch.randn(k.shape, generator=g, device=dev).to(dtype)
                cos, sin = K.rope_tables(torch.arange(s_, device=dev), d, 500000.0)
                outs = []
                for fn, cast in ((K.rope, None), (K.rope_ref, F32)):
                    qi, ki = leaf(q, cast), leaf(k, cast)
                    qo, ko = fn(qi, ki, cos, sin)
                    torch.autograd.backward([qo, ko], [dq.to(qo.dtype), dk.to(ko.dtype)])
                    outs.append([qo, ko, qi.grad, ki.grad])
                return [(n, a, e, *ELEM_TOL[dtype]) for n, a, e in zip(("q", "k", "dq", "dk"), *outs)]
            run_check(results, f"rope {dname(dtype)} b{b} s{s_} h{h}/{hkv} d{d}", case)


def check_swiglu(results, K, cfg, dev, dtypes) -> None:
    M = cfg["rows"]
    for dtype in dtypes:
        for n in cfg["widths"]:
            def case(n=n, dtype=dtype):
                g = torch.Generator(device=dev).manual_seed(n)
                both = torch.randn(M, 2 * n, generator=g, device=dev).to(dtype)  # a fused projection's output
                dy = torch.randn(M, n, generator=g, device=dev).to(dtype)
                outs = []
                for fn, cast in ((K.swiglu, None), (K.swiglu_ref, F32)):
                    x = leaf(both, cast)
                    gate, up = x.chunk(2, dim=-1)  # strided halves, read in place
                    y = fn(gate, up)
                    y.backward(dy.to(y.dtype))
                    outs.append([y, x.grad])
                return [(nm, a, e, *ELEM_TOL[dtype]) for nm, a, e in zip(("y", "d[gate, up]"), *outs)]
            run_check(results, f"swiglu {dname(dtype)} {M}x{n} chunked", case)


def check_lce(results, K, cfg, dev, dtypes) -> None:
    """Fused linear cross-entropy against the unfused head (F.linear + F.cross_entropy) on the same dtype inputs,
    with a few ignored rows and a chunk that does not divide the rows."""
    if "linear_cross_entropy" not in getattr(K, "_EXPORTS", {}):
        print("  (no cuboid.kernels.linear_cross_entropy: skipped)")
        return
    N, H = cfg["rows"], cfg["hidden"]
    for dtype in dtypes:
        for V in cfg["vocabs"]:
            def case(V=V, dtype=dtype):
                g = torch.Generator(device=dev).manual_seed(V)
                x = torch.randn(N, H, generator=g, device=dev).to(dtype)
                w = (0.05 * torch.randn(V, H, generator=g, device=dev)).to(dtype)
                b = (0.05 * torch.randn(V, generator=g, device=dev)).to(dtype)
                labels = torch.randint(0, V, (N,), generator=g, device=dev)
                labels[::7] = -100
                outs = []
                for fn, kw in ((K.linear_cross_entropy, dict(chunk=cfg["chunk"])), (K.linear_cross_entropy_ref, {})):
                    xi, wi, bi = leaf(x), leaf(w), leaf(b)
                    loss = fn(xi, wi, labels, bi, **kw)
                    loss.backward()
                    outs.append([loss, xi.grad, wi.grad, bi.grad])
                return [(n, a, e, *LCE_TOL[dtype]) for n, a, e in zip(("loss", "dx", "dW", "db"), *outs)]
            run_check(results, f"linear_cross_entropy {dname(dtype)} {N}x{H} vocab {V} +bias", case)
