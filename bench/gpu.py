"""Check every cuboid kernel on CUDA against its torch reference, then time it against its peers.

    python bench/gpu.py [--out bench/gpu.json]     # one GPU, under ~4 minutes on an H200
    python bench/gpu.py --dry-run                  # the same code paths on CPU at tiny sizes

Part 1 (correctness) prints PASS/FAIL per check with the worst error as a
fraction of the tolerance (``max |got - ref| / (atol + rtol |ref|)``, PASS
when <= 1) and the absolute error; the script exits 1 if any check (or any
timing) failed, after running the timing part and printing the summary.
Part 2 (speed) times each kernel with ``triton.testing.do_bench`` (median of
runs, warmup=25 ms, rep=100 ms) against its peer, and against ceilings measured
in the same run (a ~1 GiB ``copy_`` and an 8192^3 bf16 matmul). Byte and FLOP
counts are stated in NOTES below and printed under the table.

``--dry-run`` sets TRITON_INTERPRET=1 before cuboid.kernels is imported, uses
CPU tensors, checks fp32/fp16 only (the interpreter's bf16 arithmetic is
wrong), times with time.perf_counter and skips the sdpa flash-backend context:
its timings are meaningless, it only proves every branch runs.
"""
from __future__ import annotations

import os
import sys

DRY = "--dry-run" in sys.argv[1:]
if DRY:  # Triton reads this when the kernels are decorated: before cuboid.kernels is imported
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.pop("TRITON_INTERPRET", "0") == "1":
    print("note: ignoring TRITON_INTERPRET=1 (compiled kernels are benchmarked; use --dry-run for the interpreter)")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# Sizes: GPU (realistic) and DRY (tiny, interpreter).
GPU = dict(
    attn_check=dict(b=2, h=3, s=777, dims=(64, 80, 128)),  # odd seq: masked tails in every block
    norm_check=dict(rows=512, hidden=(1000, 4096, 8192)),
    opt_check=[(1,), (1000,), (4097,), (33, 65), (1024, 1024), (3, 5, 7)],
    attn_seqs=(1024, 4096, 16384), attn_tokens=16384, attn_dims=(64, 128), attn_width=2048,
    norm_shapes=((16384, 4096), (16384, 8192)),
    opt_model=dict(d=2048, layers=20),  # 20 layers x 10 tensors = 200 tensors, 1.007B params
    copy_numel=1 << 28, mm=8192, goal_seq=4096,
)
DRY_CFG = dict(
    attn_check=dict(b=2, h=2, s=67, dims=(64, 80, 128)),
    norm_check=dict(rows=16, hidden=(256, 1000)),
    opt_check=[(1,), (1000,), (33, 65), (3, 5, 7)],
    attn_seqs=(32, 64), attn_tokens=128, attn_dims=(64, 128), attn_width=128,
    norm_shapes=((64, 256), (64, 512)),
    opt_model=dict(d=64, layers=2),
    copy_numel=1 << 22, mm=256, goal_seq=64,
)
# (atol, rtol) per dtype; the references run on fp32 copies of the same inputs
ATTN_OUT_TOL = {F32: (1e-4, 1e-4), F16: (3e-3, 3e-3), BF16: (3e-2, 2e-2)}
ATTN_GRAD_TOL = {F32: (2e-4, 1e-4), F16: (1e-2, 5e-3), BF16: (8e-2, 5e-2)}
ATTN_LSE_TOL = {F32: (1e-4, 1e-4), F16: (1e-3, 1e-3), BF16: (1e-3, 1e-3)}
NORM_TOL = {F32: (1e-4, 1e-5), F16: (4e-3, 4e-3), BF16: (3e-2, 2e-2)}
OPT_F32_TOL = (1e-5, 1e-5)  # fp32 params / masters / states vs the reference in fp32
GOALS = [  # (name, row kernel, row match, threshold, threshold is a fraction of the copy ceiling)
    ("attention fwd >= 450 TFLOP/s (bf16, seq 4k, d128, non-causal)", "attention fwd", dict(d=128, causal=False), 450.0, False),
    ("attention bwd >= 300 TFLOP/s (bf16, seq 4k, d128, non-causal)", "attention bwd", dict(d=128, causal=False), 300.0, False),
    ("layer_norm fwd >= 85% of copy bandwidth (all sizes)", "layer_norm fwd", {}, 0.85, True),
    ("layer_norm bwd >= 70% of copy bandwidth (all sizes)", "layer_norm bwd", {}, 0.70, True),
    ("AdamW >= 80% of copy bandwidth (1B params)", "AdamW step", dict(unit="GB/s"), 0.80, True),
]
NOTES = [
    "attention FLOPs: 4*b*h*sq*sk*d forward, x2.5 backward, /2 when causal; peer: "
    "F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION); backward is timed alone as "
    "out.backward(dout, retain_graph=True) with q/k/v grads reset to None each run (do_bench grad_to_none)",
    "norm bytes: 2 x tensor bytes forward (read x, write y), 3 x backward (read x, read dy, write dx), "
    "no residual; peers F.layer_norm / F.rms_norm; backward timed like attention",
    "optimizer bytes per fp32 param: AdamW and LAMB 28 (read p,g,m,v, write p,m,v), LARS 20 (read p,g,buf, "
    "write p,buf): the minimum a fused step moves (cuboid LAMB/LARS make two passes); peers: "
    "torch.optim.AdamW(fused=True), and cuboid's own torch._foreach reference (backend='torch') for LAMB/LARS",
    "cuboid/peer: peer time / cuboid time (> 1: cuboid faster); fraction of ceiling: vs the copy_ GB/s "
    "(read+write) or the bf16 matmul TFLOP/s measured in this run",
]


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    ratio: float  # worst |got - ref| / (atol + rtol |ref|)
    max_abs: float
    worst: str  # which output had the worst ratio, with its tolerance
    error: str = ""


@dataclasses.dataclass
class Row:
    kernel: str
    size: str
    unit: str  # TFLOP/s, GB/s (higher is better) or ms (lower is better)
    cuboid: float
    peer: float
    peer_name: str
    ceiling: Optional[float] = None  # in `unit`; None where no ceiling applies
    meta: dict = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.peer / self.cuboid if self.unit == "ms" else self.cuboid / self.peer

    @property
    def fraction(self) -> Optional[float]:
        return None if self.ceiling is None else self.cuboid / self.ceiling


# ---------------------------------------------------------------------------- helpers

def compare(pairs) -> tuple:
    """pairs: [(label, got, ref, atol, rtol)] -> (worst ratio, max abs error, worst label with tol)."""
    worst = (0.0, 0.0, "-")
    for label, got, ref, atol, rtol in pairs:
        got, ref = got.detach().double(), ref.detach().double()
        fin = torch.isfinite(ref)
        if got.shape != ref.shape or not torch.equal(fin, torch.isfinite(got)):
            return math.inf, math.inf, f"{label} (shape or non-finite mismatch)"
        if not fin.any():
            continue
        diff = (got - ref).abs()[fin]
        ratio = (diff / (atol + rtol * ref.abs()[fin])).max().item()
        if ratio > worst[0]:
            worst = (ratio, diff.max().item(), f"{label} (atol={atol:g}, rtol={rtol:g})")
    return worst


def run_check(results: list, name: str, fn: Callable[[], list]) -> None:
    try:
        ratio, max_abs, worst = compare(fn())
        c = Check(name, ratio <= 1.0, ratio, max_abs, worst)
    except Exception as e:  # a crash is a FAIL, and the run goes on
        traceback.print_exc()
        c = Check(name, False, math.inf, math.inf, "-", f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    results.append(c)
    status = "PASS" if c.passed else "FAIL"
    detail = c.error or f"err/tol={c.ratio:.3f}  max_abs_err={c.max_abs:.2e}  worst={c.worst}"
    print(f"{status}  {name:<48} {detail}", flush=True)


def make_bench(dry: bool):
    """ms per call: do_bench (median) on GPU, a perf_counter median of a few calls on CPU."""
    if not dry:
        def bench(fn, grad_to_none=None):
            return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
        return bench

    def bench(fn, grad_to_none=None):
        times = []
        for i in range(3):  # the first call is the warm-up
            for t in grad_to_none or ():
                t.grad = None
            t0 = time.perf_counter()
            fn()
            if i:
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    return bench


def free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dname(dtype) -> str:
    return str(dtype).replace("torch.", "")


def leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype, copy=True).requires_grad_()


# ---------------------------------------------------------------------------- part 1: checks

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


# ---------------------------------------------------------------------------- part 2: timing

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


def fwd_bwd_ms(bench, fwd: Callable, inputs: list, dout: torch.Tensor, ctx) -> tuple:
    """(forward ms, backward ms): forward under no_grad, backward alone on a retained graph."""
    with ctx(), torch.no_grad():
        plain = [t.detach() for t in inputs]
        f_ms = bench(lambda: fwd(*plain))
    with ctx():
        out = fwd(*inputs)
        b_ms = bench(lambda: out.backward(dout, retain_graph=True), grad_to_none=inputs)
    del out
    return f_ms, b_ms


def time_attention(rows, bench, K, cfg, dev, ceil, flash_ctx) -> None:
    for s in cfg["attn_seqs"]:
        b = max(1, cfg["attn_tokens"] // s)
        for d in cfg["attn_dims"]:
            h = max(1, cfg["attn_width"] // d)
            q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=BF16) for _ in range(4))
            inputs = [leaf(t) for t in (q, k, v)]
            for causal in (False, True):
                ours = fwd_bwd_ms(bench, lambda q, k, v: K.attention(q, k, v, causal=causal), inputs, do,
                                  contextlib.nullcontext)
                peer = fwd_bwd_ms(bench, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                  inputs, do, flash_ctx)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                size = f"b{b} h{h} s{s} d{d} {'causal' if causal else 'full'}"
                for i, (what, mult) in enumerate((("fwd", 1.0), ("bwd", 2.5))):
                    rows.append(Row(f"attention {what}", size, "TFLOP/s", flops * mult / ours[i] / 1e9,
                                    flops * mult / peer[i] / 1e9, "sdpa flash", ceil["matmul_bf16_TFLOPs"],
                                    dict(seq=s, d=d, causal=causal)))
                print(f"  timed attention {size}", flush=True)
            del q, k, v, do, inputs
            free()


def time_norms(rows, bench, K, cfg, dev, ceil) -> None:
    for M, n in cfg["norm_shapes"]:
        x, dy = (torch.randn(M, n, device=dev, dtype=BF16) for _ in range(2))
        w, bias = torch.ones(n, device=dev, dtype=BF16), torch.zeros(n, device=dev, dtype=BF16)
        cases = {
            "layer_norm": (lambda x, w, b: K.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (n,), w, b), [x, w, bias]),
            "rms_norm": (lambda x, w: K.rms_norm(x, w), lambda x, w: F.rms_norm(x, (n,), w, eps=1e-6), [x, w]),
        }
        for kind, (ours_fn, peer_fn, tensors) in cases.items():
            inputs = [leaf(t) for t in tensors]
            ours = fwd_bwd_ms(bench, ours_fn, inputs, dy, contextlib.nullcontext)
            peer = fwd_bwd_ms(bench, peer_fn, inputs, dy, contextlib.nullcontext)
            for i, (what, passes) in enumerate((("fwd", 2), ("bwd", 3))):
                nbytes = passes * x.nbytes
                rows.append(Row(f"{kind} {what}", f"{M}x{n} bf16", "GB/s", nbytes / ours[i] / 1e6,
                                nbytes / peer[i] / 1e6, f"F.{kind}", ceil["copy_GBps"], dict(M=M, n=n)))
            del inputs
        print(f"  timed norms {M}x{n}", flush=True)
        del x, dy, w, bias
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


def time_optim(rows, bench, cfg, dev, ceil) -> None:
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
                        ceil["copy_GBps"], dict(params=n, bytes_per_param=bpp)))
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


# ---------------------------------------------------------------------------- report

def fmt(x: Optional[float], digits=1) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits else f"{x:.2g}"  # tiny (dry-run) values stay visible


def print_table(header: str, rows: list, ceil: dict, dry: bool) -> None:
    print(f"\n{header}\n")
    if dry:
        print("**DRY RUN: CPU, Triton interpreter, perf_counter timer: every figure below is meaningless.**\n")
    print(f"Ceilings: copy_ {ceil['copy_GBps']:.0f} GB/s (read+write, {ceil['copy_bytes'] / 2**30:.3g} GiB); "
          f"bf16 matmul {ceil['matmul_n']}^3 {ceil['matmul_bf16_TFLOPs']:.1f} TFLOP/s\n")
    print("| kernel | size | unit | cuboid | peer | peer name | cuboid/peer | fraction of ceiling |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: | ---: |")
    for r in rows:
        d = 2 if r.unit == "ms" else 1
        print(f"| {r.kernel} | {r.size} | {r.unit} | {fmt(r.cuboid, d)} | {fmt(r.peer, d)} | {r.peer_name} | "
              f"{fmt(r.speedup, 2)} | {fmt(r.fraction, 2)} |")
    print()
    for note in NOTES:
        print(f"- {note}")


def finite(x):
    """JSON-safe copy: nan/inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def header_line(dry: bool) -> str:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    gpu = "CPU (dry run, TRITON_INTERPRET=1)" if dry else torch.cuda.get_device_name()
    cuda = "" if dry else f" | CUDA {torch.version.cuda}"
    return f"cuboid bench/gpu.py | {date} | {gpu} | torch {torch.__version__} | triton {triton.__version__}{cuda}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU through the Triton interpreter")
    ap.add_argument("--part", choices=("all", "checks", "timing"), default="all",
                    help="run only the checks or only the timing (for a quick rerun)")
    ap.add_argument("--out", default=None, help="JSON output (default bench/gpu.json; a temp file with --dry-run)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device found. This benchmark needs a GPU; pass --dry-run to run the same "
              "code paths on CPU at tiny sizes.", file=sys.stderr)
        return 2
    dry = args.dry_run
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "cuboid_gpu_dry_run.json") if dry else "bench/gpu.json")
    from cuboid import kernels as K  # after TRITON_INTERPRET was decided

    cfg, dev = (DRY_CFG, torch.device("cpu")) if dry else (GPU, torch.device("cuda"))
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
        torch.backends.cudnn.allow_tf32 = False
    header = header_line(dry)
    print(header, flush=True)
    t_start = time.perf_counter()
    section_s = {}

    # part 1: correctness
    dtypes = (F16, F32) if dry else (BF16, F16, F32)
    if dry:
        print("note: bf16 checks skipped in --dry-run (the Triton interpreter's bf16 arithmetic is wrong)")
    checks: list = []
    check_sections = (("attention", lambda: check_attention(checks, K, cfg["attn_check"], dev, dtypes)),
                      ("norms", lambda: check_norms(checks, K, cfg["norm_check"], dev, dtypes)),
                      ("optimizers", lambda: check_optim(checks, cfg["opt_check"], dev, dtypes)))
    for name, fn in check_sections if args.part != "timing" else ():
        t0 = time.perf_counter()
        print(f"\n== check {name}", flush=True)
        try:
            fn()
        except Exception as e:  # a section that cannot even start is one FAIL
            traceback.print_exc()
            checks.append(Check(f"check {name}", False, math.inf, math.inf, "-", f"{type(e).__name__}: {e}"))
        free()
        section_s[f"check {name}"] = time.perf_counter() - t0

    # part 2: timing
    bench = make_bench(dry)
    if dry:
        flash_ctx = contextlib.nullcontext  # no sdpa flash backend on CPU
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        flash_ctx = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    rows: list = []
    timing_errors = []
    ceil = dict(copy_GBps=math.nan, copy_bytes=4 * cfg["copy_numel"], matmul_bf16_TFLOPs=math.nan, matmul_n=cfg["mm"])
    time_sections = (("ceilings", lambda: ceil.update(ceilings(bench, cfg, dev))),
                     ("attention", lambda: time_attention(rows, bench, K, cfg, dev, ceil, flash_ctx)),
                     ("norms", lambda: time_norms(rows, bench, K, cfg, dev, ceil)),
                     ("optimizers", lambda: time_optim(rows, bench, cfg, dev, ceil)))
    for name, fn in time_sections if args.part != "checks" else ():
        t0 = time.perf_counter()
        print(f"\n== time {name}", flush=True)
        try:
            fn()
        except Exception as e:  # report, keep going with the other sections
            traceback.print_exc()
            timing_errors.append(f"time {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        free()
        section_s[f"time {name}"] = time.perf_counter() - t0
    goals = evaluate_goals(rows, ceil, cfg["goal_seq"])
    total_s = time.perf_counter() - t_start

    # report
    if rows or args.part != "checks":
        print_table(header, rows, ceil, dry)
    failed = [c for c in checks if not c.passed]
    print(f"\n## Summary\n\nchecks: {len(checks) - len(failed)}/{len(checks)} PASS"
          + (f", {len(failed)} FAIL" if failed else ""))
    for c in failed:
        print(f"  FAIL {c.name}: {c.error or c.worst} (err/tol={c.ratio:.3g})")
    for e in timing_errors:
        print(f"  ERROR {e}")
    print("\ngoals (H200, bf16)" + (" -- dry run: meaningless" if dry else "") + ":")
    for g in goals:
        target = "" if g["target"] is None else f" (value {fmt(g['value'], 2)}, target {g['target']:g})"
        print(f"  {'MET' if g['met'] else 'NOT MET':<8} {g['goal']}{target}: {g['note']}")
    print("\nseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in section_s.items()) + f"; total {total_s:.1f}")

    result = dict(header=header, dry_run=dry, date=datetime.datetime.now().astimezone().isoformat(),
                  device=header.split(" | ")[2], torch=torch.__version__, triton=triton.__version__,
                  ceilings=ceil, checks=[dataclasses.asdict(c) for c in checks],
                  rows=[dict(dataclasses.asdict(r), speedup=r.speedup, fraction_of_ceiling=r.fraction) for r in rows],
                  goals=goals, timing_errors=timing_errors, notes=NOTES, seconds=dict(section_s, total=total_s))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(finite(result), f, indent=1)
    print(f"wrote {out_path}")
    return 1 if failed or timing_errors else 0


if __name__ == "__main__":
    sys.exit(main())
