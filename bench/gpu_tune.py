"""bench/gpu.py part 3: every entry of every kernel's GPU autotune list timed, and checked against entry 0."""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from gpu_common import BF16, TUNE_TOL, compare, free, kernel_module, leaf
from gpu_kernels import fwd_bwd_ms, model_params


@dataclasses.dataclass
class TuneRow:
    op: str
    size: str
    entry: int
    config: str
    fwd_ms: float
    bwd_ms: float
    ratio: float  # worst |out - out of entry 0| / tol over the outputs and gradients
    best: bool = False


def tune_cases(K, cfg, dev) -> dict:
    """op -> (module, [(size label, fn over inputs, inputs, dout, describe(entry) -> str)]): the shapes at which
    bench times every entry of an op's autotune list (ops of kernels modules without a case here are listed as
    untimed)."""
    import cuboid.kernels._backend as B
    fa, norm, optim, swiglu_m = (kernel_module(n) for n in ("flash_attention", "norm", "optim", "swiglu"))

    def under(op, i, f):
        with B.autotune_pick(op, i):
            return f()

    out = {}
    a = cfg["tune"]["attn"]
    cases = []
    for d in a["dims"]:
        q, k, v, do = (torch.randn(a["b"], a["h"], a["s"], d, device=dev, dtype=BF16) for _ in range(4))

        def describe(i, d=d):
            return under("attention", i, lambda: fa.tile_summary(d, BF16))
        cases.append((f"b{a['b']} h{a['h']} s{a['s']} d{d} causal bf16",
                      lambda q, k, v: K.attention(q, k, v, causal=True), [q, k, v], do, describe))
    out["attention"] = ("flash_attention", cases)
    M, n = cfg["tune"]["norm"]
    x, dy = (torch.randn(M, n, device=dev, dtype=BF16) for _ in range(2))
    w = torch.ones(n, device=dev, dtype=BF16)
    out["norm"] = ("norm", [(f"rms_norm {M}x{n} bf16", lambda x, w: K.rms_norm(x, w), [x, w], dy,
                             lambda i: "BLOCK_M %d, BLOCK_N %d, %d warps" % under("norm", i,
                                                                                 lambda: norm._block_sizes(M, n)))])
    b, s_, h, hkv, d = cfg["tune"]["rope"]
    q = torch.randn(b, s_, h, d, device=dev, dtype=BF16).transpose(1, 2)
    kk = torch.randn(b, s_, hkv, d, device=dev, dtype=BF16).transpose(1, 2)
    cos, sin = (t.to(BF16) for t in K.rope_tables(torch.arange(s_, device=dev), d, 500000.0))
    dq, dk = torch.randn(q.shape, device=dev, dtype=BF16), torch.randn(kk.shape, device=dev, dtype=BF16)
    out["rope"] = ("rope", [(f"b{b} s{s_} h{h}/{hkv} d{d} bf16", lambda q, k: K.rope(q, k, cos, sin), [q, kk],
                             (dq, dk), lambda i: "the launcher's warps" if i == 0 else f"{2 ** i}x its warps")])
    M, n = cfg["tune"]["swiglu"]
    g, u, dy2 = (torch.randn(M, n, device=dev, dtype=BF16) for _ in range(3))
    out["swiglu"] = ("swiglu", [(f"{M}x{n} bf16", K.swiglu, [g, u], dy2,
                                 lambda i: "BLOCK_N %d, %d column programs, %d warps" % under(
                                     "swiglu", i, lambda: swiglu_m._launch_cfg(n)))])
    out["optim"] = ("optim", [("AdamW", None, None, None, lambda i: "BLOCK %d, %d warps" % under(
        "optim", i, optim._tile))])
    out["grouped_mm"] = grouped_mm_case(K, cfg, dev)
    return out


def grouped_mm_case(K, cfg, dev) -> tuple:
    """The experts' grouped GEMM: rows split unevenly over the groups (one empty), aligned bf16 operands."""
    gg = kernel_module("grouped_gemm")
    M, G, N, Kd = cfg["tune"]["grouped_mm"]
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(G - 1), M, replacement=True, generator=gen).bincount(minlength=G - 1)
    counts = torch.cat([counts, torch.zeros(1, dtype=counts.dtype)]).to(dev)  # the last expert gets no token
    x, dy = torch.randn(M, Kd, device=dev, dtype=BF16), torch.randn(M, N, device=dev, dtype=BF16)
    w = (0.02 * torch.randn(G, N, Kd, device=dev)).to(BF16)

    def describe(i):
        mm, dw = (gg._MM_CFG["half"][i], gg._DW_CFG["half"][i])
        return "mm %dx%dx%d w%d s%d, dw %dx%dx%d w%d s%d" % (*mm, *dw)
    return ("grouped_gemm", [(f"{M} rows x {Kd} -> {N}, {G} groups bf16", lambda x, w: K.grouped_mm(x, w, counts),
                              [x, w], dy, describe)])


def tune_sweep(tune_rows: list, errors: list, bench, K, cfg, dev) -> None:
    """Every entry of every op's autotune list, timed; each entry's outputs and gradients against entry 0's."""
    import pkgutil

    import cuboid.kernels as pkg
    import cuboid.kernels._backend as B
    listed = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        for op, n in getattr(kernel_module(info.name), "AUTOTUNE", {}).items():
            listed[op] = (info.name, n)
    cases = tune_cases(K, cfg, dev)
    for op, (module, n) in sorted(listed.items()):
        if op not in cases:
            errors.append(f"tune {op} (cuboid.kernels.{module}): {n} entries but no tune case in bench/gpu.py")
            continue
        for size, fn, inputs, dout, describe in cases[op][1]:
            rows = []
            ref = None
            for i in range(n):
                with B.autotune_pick(op, i):
                    if fn is None:  # the optimizer: one fused step over a GPT-shaped parameter list
                        f_ms, b_ms, outs = _tune_adamw(bench, cfg, dev), math.nan, []
                    else:
                        f_ms, b_ms = fwd_bwd_ms(bench, fn, inputs, dout, contextlib.nullcontext)
                        outs = _outputs_and_grads(fn, inputs, dout)
                if ref is None:
                    ref = outs
                pairs = [(f"out[{j}]", o, r, *TUNE_TOL[BF16]) for j, (o, r) in enumerate(zip(outs, ref))]
                ratio = compare(pairs)[0] if pairs else 0.0
                rows.append(TuneRow(op, size, i, describe(i), f_ms, b_ms, ratio))
                if ratio > 1.0:
                    errors.append(f"tune {op} {size} entry {i}: outputs differ from entry 0's (err/tol={ratio:.3g})")
            total = [r.fwd_ms + (0.0 if math.isnan(r.bwd_ms) else r.bwd_ms) for r in rows]
            rows[total.index(min(total))].best = True
            tune_rows.extend(rows)
            print(f"  tuned {op} {size}: " + ", ".join(f"#{r.entry} {r.fwd_ms:.3g}/{r.bwd_ms:.3g} ms" for r in rows),
                  flush=True)
            free()


def _outputs_and_grads(fn, inputs, dout) -> list:
    inputs = [leaf(t) for t in inputs]
    out = fn(*inputs)
    outs = list(out) if isinstance(out, tuple) else [out]
    torch.autograd.backward(outs, list(dout) if isinstance(dout, tuple) else [dout])
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def _tune_adamw(bench, cfg, dev) -> float:
    from cuboid.parallel.optim import AdamW
    ps = model_params(cfg["tune"]["optim"]["d"], cfg["tune"]["optim"]["layers"], dev)
    opt = AdamW(ps, lr=1e-4)
    opt.step()
    ms = bench(opt.step)
    del opt, ps
    free()
    return ms
