"""bench/gpu.py part 2: each kernel timed against its anchors on the same inputs, rows of TFLOP/s or GB/s beside
the ceilings measured in the same run, and the goals."""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from gpu_common import BF16, F32, GOALS, Row, fmt, free, kernel_module, leaf


def ceilings(bench, cfg, dev) -> dict:
    src = torch.ones(cfg["copy_numel"], dtype=F32, device=dev)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.nbytes / bench(lambda: dst.copy_(src)) / 1e6
    del src, dst
    n = cfg["mm"]
    a, b = (torch.randn(n, n, device=dev).to(BF16) for _ in range(2))
    c = torch.empty(n, n, dtype=BF16, device=dev)
    mm_tflops = 2 * n ** 3 / bench(lambda: torch.mm(a, b, out=c)) / 1e9
    del a, b, c
    free()
    return {"copy_GBps": copy_gbs, "copy_bytes": 4 * cfg["copy_numel"], "matmul_bf16_TFLOPs": mm_tflops, "matmul_n": n}


def fwd_bwd_ms(bench, fwd: Callable, inputs: list, dout, ctx) -> tuple:
    """(forward ms, backward ms): forward under no_grad, backward alone on a retained graph.

    ``fwd`` may return a tuple, with ``dout`` a tuple of the same length. The inputs are copied first (Liger's
    RoPE rotates its inputs in place), so every kernel of a comparison reads the same values.
    """
    inputs = [leaf(t) for t in inputs]
    douts = tuple(t.clone() for t in dout) if isinstance(dout, tuple) else (dout.clone(),)
    with ctx(), torch.no_grad():
        plain = [t.detach() for t in inputs]
        f_ms = bench(lambda: fwd(*plain))
    with ctx():
        out = fwd(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        b_ms = bench(lambda: torch.autograd.backward(outs, douts, retain_graph=True), grad_to_none=inputs)
    del out, outs
    return f_ms, b_ms


def add_rows(rows, kernel: str, size: str, unit: str, amounts: tuple, ours: tuple, peer: str, peer_ms: tuple,
             ceiling: Optional[float], peak: Optional[float], meta: dict, directions=("fwd", "bwd")) -> None:
    """One row per direction: ``amounts`` (FLOPs or bytes per direction) over the measured ms."""
    scale = 1e9 if unit == "TFLOP/s" else 1e6
    for i, what in enumerate(directions):
        rows.append(Row(f"{kernel} {what}", size, unit, amounts[i] / ours[i] / scale,
                        amounts[i] / peer_ms[i] / scale if peer_ms is not None else math.nan, peer,
                        ceiling, dict(meta), peak))


def versus(rows, skipped: list, bench, kernel: str, size: str, unit: str, amounts: tuple, ours: tuple,
           peers: list, ceiling, peak, meta: dict) -> None:
    """Rows of ``ours`` (fwd ms, bwd ms) against each peer (name, Anchor, fwd callable, inputs, dout, ctx).

    A missing anchor or one that fails is noted in ``skipped`` (with the reason), never a bench failure.
    """
    ran = False
    for name, anchor, fwd, inputs, dout, ctx in peers:
        if anchor is not None and anchor.fn is None:
            skipped.append(f"{kernel} {size} vs {name}: {anchor.why}")
            continue
        try:
            peer_ms = fwd_bwd_ms(bench, fwd, inputs, dout, ctx)
        except Exception as e:  # noqa: BLE001 - a peer's failure is reported, not ours
            skipped.append(f"{kernel} {size} vs {name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            continue
        add_rows(rows, kernel, size, unit, amounts, ours, name, peer_ms, ceiling, peak, meta)
        ran = True
    if not ran:  # cuboid's figures still belong in the table
        add_rows(rows, kernel, size, unit, amounts, ours, "-", None, ceiling, peak, meta)


def time_attention(rows, bench, K, cfg, dev, ceil, flash_ctx, anchors, skipped, peaks) -> None:
    fa = anchors["flash-attn 2"]
    for s in cfg["attn_seqs"]:
        b = max(1, cfg["attn_tokens"] // s)
        for d in cfg["attn_dims"]:
            h = max(1, cfg["attn_width"] // d)
            q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=BF16) for _ in range(4))
            # FlashAttention 2 takes (B, S, H, D): the same values, transposed once outside the timing
            q2, k2, v2, do2 = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
            for causal in (False, True):
                ours = fwd_bwd_ms(bench, lambda q, k, v: K.attention(q, k, v, causal=causal), [q, k, v], do,
                                  contextlib.nullcontext)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                size = f"b{b} h{h} s{s} d{d} {'causal' if causal else 'full'}"
                peers = [("sdpa flash", anchors["sdpa flash"],
                          lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                          [q, k, v], do, flash_ctx),
                         ("flash-attn 2", fa, lambda q, k, v: fa.fn(q, k, v, causal=causal), [q2, k2, v2], do2,
                          contextlib.nullcontext)]
                versus(rows, skipped, bench, "attention", size, "TFLOP/s", (flops, 2.5 * flops), ours, peers,
                       ceil["matmul_bf16_TFLOPs"], peaks[0], dict(seq=s, d=d, causal=causal))
                print(f"  timed attention {size}", flush=True)
            del q, k, v, do, q2, k2, v2, do2
            free()


def time_norms(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks) -> None:
    ln, rms = anchors["liger layer_norm"], anchors["liger rms_norm"]
    for M, n in cfg["norm_shapes"]:
        x, dy = (torch.randn(M, n, device=dev, dtype=BF16) for _ in range(2))
        w, bias = torch.ones(n, device=dev, dtype=BF16), torch.zeros(n, device=dev, dtype=BF16)
        cases = {
            "layer_norm": (lambda x, w, b: K.layer_norm(x, w, b), [x, w, bias], [
                ("F.layer_norm", None, lambda x, w, b: F.layer_norm(x, (n,), w, b)),
                ("liger layer_norm", ln, lambda x, w, b: ln.fn(x, w, b, 1e-5))]),
            "rms_norm": (lambda x, w: K.rms_norm(x, w), [x, w], [
                ("F.rms_norm", None, lambda x, w: F.rms_norm(x, (n,), w, eps=1e-6)),
                ("liger rms_norm", rms, lambda x, w: rms.fn(x, w, 1e-6, 0.0, "llama", False))]),
        }
        for kind, (ours_fn, tensors, peer_fns) in cases.items():
            ours = fwd_bwd_ms(bench, ours_fn, tensors, dy, contextlib.nullcontext)
            peers = [(name, anchor, fn, tensors, dy, contextlib.nullcontext) for name, anchor, fn in peer_fns]
            versus(rows, skipped, bench, kind, f"{M}x{n} bf16", "GB/s", (2 * x.nbytes, 3 * x.nbytes), ours, peers,
                   ceil["copy_GBps"], peaks[1], dict(M=M, n=n))
        print(f"  timed norms {M}x{n}", flush=True)
        del x, dy, w, bias
        free()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def time_rope(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks) -> None:
    lr = anchors["liger rope"]
    for b, s, h, hkv, d in cfg["rope_shapes"]:
        # Hugging Face's layout: (B, T, H, D) storage viewed as (B, H, T, D), as Llama's attention makes it
        q = torch.randn(b, s, h, d, device=dev, dtype=BF16).transpose(1, 2)
        k = torch.randn(b, s, hkv, d, device=dev, dtype=BF16).transpose(1, 2)
        dq, dk = torch.randn(q.shape, device=dev, dtype=BF16), torch.randn(k.shape, device=dev, dtype=BF16)
        cos, sin = (t.to(BF16) for t in K.rope_tables(torch.arange(s, device=dev), d, 500000.0))
        ours = fwd_bwd_ms(bench, lambda q, k: K.rope(q, k, cos, sin), [q, k], (dq, dk), contextlib.nullcontext)
        peers = [("liger rope", lr, lambda q, k: lr.fn(q, k, cos, sin), [q, k], (dq, dk), contextlib.nullcontext),
                 ("torch (HF formula)", None,
                  lambda q, k: (q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin),
                  [q, k], (dq, dk), contextlib.nullcontext)]
        nbytes = 2 * (q.nbytes + k.nbytes)
        size = f"b{b} s{s} h{h}/{hkv} d{d} bf16"
        versus(rows, skipped, bench, "rope", size, "GB/s", (nbytes, nbytes), ours, peers, ceil["copy_GBps"],
               peaks[1], dict(s=s, d=d))
        print(f"  timed rope {size}", flush=True)
        del q, k, dq, dk
        free()


def time_swiglu(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks) -> None:
    ls = anchors["liger swiglu"]
    for M, n in cfg["swiglu_shapes"]:
        g, u, dy = (torch.randn(M, n, device=dev, dtype=BF16) for _ in range(3))
        ours = fwd_bwd_ms(bench, K.swiglu, [g, u], dy, contextlib.nullcontext)
        peers = [("liger swiglu", ls, lambda g, u: ls.fn(g, u), [g, u], dy, contextlib.nullcontext),
                 ("F.silu(g) * u", None, lambda g, u: F.silu(g) * u, [g, u], dy, contextlib.nullcontext)]
        versus(rows, skipped, bench, "swiglu", f"{M}x{n} bf16", "GB/s", (3 * g.nbytes, 5 * g.nbytes), ours, peers,
               ceil["copy_GBps"], peaks[1], dict(M=M, n=n))
        print(f"  timed swiglu {M}x{n}", flush=True)
        del g, u, dy
        free()


def lce_route(x, w) -> str:
    """How cuboid's fused linear cross-entropy ran on (x, w): its default chunk and how it summed dW (a
    cuboid without these helpers: "-")."""
    mod = kernel_module("linear_cross_entropy")  # (the package attribute is the function)
    try:
        chunk = mod.default_chunk(x.shape[0], w.shape[0], x.device.type, x.dtype)
        fp32 = mod.fp32_addmm(w)
    except (AttributeError, TypeError):
        return "-"
    how = "fp32 addmm (out_dtype)" if fp32 else "a half product per chunk added in fp32"
    return f"default chunk {chunk} rows, dW summed by {how}"


def time_lce(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks) -> None:
    """Fused linear cross-entropy: forward + backward as one step (the fused op makes its gradients in forward),
    TFLOP/s of the head's three matmuls, and the step's peak memory."""
    if "linear_cross_entropy" not in getattr(K, "_EXPORTS", {}):
        skipped.append("linear_cross_entropy vs -: no cuboid.kernels.linear_cross_entropy")
        return
    lce = anchors["liger fused linear CE"]
    for N, H, V in cfg["lce_shapes"]:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(N, H, generator=g, device=dev).to(BF16)
        w = (0.02 * torch.randn(V, H, generator=g, device=dev)).to(BF16)
        labels = torch.randint(0, V, (N,), generator=g, device=dev)
        size = f"{N} tokens x {H} -> {V} bf16"
        impls = [("cuboid", None, lambda x, w: K.linear_cross_entropy(x, w, labels)),
                 ("liger fused linear CE", lce, lambda x, w: lce.fn(x, w, labels)[0]),
                 ("unfused (F.linear + fp32 F.cross_entropy)", None,
                  lambda x, w: F.cross_entropy(F.linear(x, w).float(), labels))]
        measured = {}
        for name, anchor, fn in impls:
            if anchor is not None and anchor.fn is None:
                skipped.append(f"linear_cross_entropy {size} vs {name}: {anchor.why}")
                continue
            try:
                xi, wi = leaf(x), leaf(w)
                step = lambda: fn(xi, wi).backward()  # noqa: E731
                step()
                free()
                base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                step()
                peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if dev.type == "cuda" else math.nan
                measured[name] = (bench(step, grad_to_none=[xi, wi]), peak)
                del xi, wi
                free()
            except Exception as e:  # noqa: BLE001
                if name == "cuboid":
                    raise
                skipped.append(f"linear_cross_entropy {size} vs {name}: failed ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160]})")
        ours_ms, ours_peak = measured.pop("cuboid")
        flops = 6 * N * H * V
        for name, (ms, peak) in measured.items() or {"-": (math.nan, math.nan)}.items():
            rows.append(Row("linear_cross_entropy fwd+bwd", size, "TFLOP/s", flops / ours_ms / 1e9, flops / ms / 1e9,
                            name, ceil["matmul_bf16_TFLOPs"], dict(N=N, H=H, V=V), peaks[0]))
            rows.append(Row("linear_cross_entropy fwd+bwd", size, "GiB peak", ours_peak, peak, name, None,
                            dict(N=N, H=H, V=V)))
        print(f"  timed linear_cross_entropy {size} ({lce_route(x, w)})", flush=True)
        del x, w, labels
        free()


def model_params(d: int, layers: int, dev) -> list:
    """fp32 tensors shaped like a GPT's: per layer qkv, proj, fc1, fc2 (weight + bias) and two norm weights."""
    shapes = []
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    ps = []
    for s in shapes:
        p = torch.empty(s, device=dev).normal_(0, 0.02).requires_grad_()
        p.grad = torch.empty(s, device=dev).normal_(0, 1e-3)
        ps.append(p)
    return ps


def time_optim(rows, bench, cfg, dev, ceil, peaks) -> None:
    from cuboid.parallel.optim import LAMB, LARS, AdamW
    ps = model_params(cfg["opt_model"]["d"], cfg["opt_model"]["layers"], dev)
    n = sum(p.numel() for p in ps)
    size = f"{n / 1e9:.3g}B params" if n >= 1e8 else f"{n / 1e6:.3g}M params"
    size += f", {len(ps)} tensors, fp32"
    cases = [  # name, ours, peer, peer name, bytes per param
        ("AdamW step", lambda: AdamW(ps, lr=1e-4), lambda: torch.optim.AdamW(ps, lr=1e-4, fused=True),
         "torch AdamW fused", 28),
        ("LAMB step", lambda: LAMB(ps, lr=1e-4), lambda: LAMB(ps, lr=1e-4, backend="torch"), "foreach ref", 28),
        ("LARS step", lambda: LARS(ps, lr=1e-4), lambda: LARS(ps, lr=1e-4, backend="torch"), "foreach ref", 20),
    ]
    for name, make_ours, make_peer, peer_name, bpp in cases:
        ms = []
        for make in (make_ours, make_peer):
            opt = make()
            opt.step()  # creates the state outside the timed runs
            ms.append(bench(opt.step))
            del opt
            free()
        rows.append(Row(name, size, "GB/s", bpp * n / ms[0] / 1e6, bpp * n / ms[1] / 1e6, peer_name,
                        ceil["copy_GBps"], dict(params=n, bytes_per_param=bpp), peaks[1]))
        if name == "AdamW step":
            rows.append(Row(name, size, "ms", ms[0], ms[1], peer_name, None, dict(params=n)))
        print(f"  timed {name}", flush=True)
    del ps
    free()


def evaluate_goals(rows: list, ceil: dict, goal_seq: int) -> list:
    out = []
    for name, kernel, match, threshold, of_copy in GOALS:
        match = dict(match, seq=goal_seq) if kernel.startswith("attention") else dict(match)
        unit = match.pop("unit", None)
        cand = [r for r in rows if r.kernel == kernel and (unit is None or r.unit == unit)
                and all(r.meta.get(k) == v for k, v in match.items())]
        if not cand:
            out.append(dict(goal=name, value=None, target=None, met=False, note="no measurement"))
            continue
        worst = min(cand, key=lambda r: r.cuboid)  # the goal must hold at every listed size
        value = worst.fraction if of_copy else worst.cuboid
        out.append(dict(goal=name, value=value, target=threshold, met=bool(value >= threshold),
                        note=f"{worst.size}: {fmt(worst.cuboid)} {worst.unit}"))
    return out
