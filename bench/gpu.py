"""Check every cuboid kernel on CUDA against its torch reference, then time it against its anchors.

    python bench/gpu.py [--out bench/gpu.json]     # one GPU, under ~5 minutes on an H200
    python bench/gpu.py --dry-run                  # CPU: the comparison plan, then the code paths at tiny sizes
    python bench/gpu.py --part tune                # only the autotune sweep (every entry of every kernel's list)

Part 1 (correctness) prints PASS/FAIL per check with the worst error as a
fraction of the tolerance (``max |got - ref| / (atol + rtol |ref|)``, PASS
when <= 1) and the absolute error; the script exits 1 if any check (or any
timing) failed, after running the timing part and printing the summary.
Part 2 (speed) times each kernel with ``triton.testing.do_bench`` (median of
runs, warmup=25 ms, rep=100 ms) side by side with its anchors on the same
inputs: attention against torch SDPA (flash backend) and FlashAttention 2 (if
``flash_attn`` imports); layer norm, RMS norm, RoPE, SwiGLU and the fused
linear cross-entropy against Liger-Kernel (if ``liger_kernel`` imports:
``pip install liger-kernel``) and torch (the cross-entropy's peak memory too);
AdamW against torch's fused AdamW. Each row gives TFLOP/s or GB/s, the
fraction of a ceiling measured in the same run (a ~1 GiB ``copy_`` and an
8192^3 bf16 matmul) and of the device's datasheet peak (PEAKS, by device
name). An anchor that is missing is skipped with its reason, printed. Byte
and FLOP counts are stated in NOTES below and printed under the table.
Part 3 (tune) times every entry of every kernel's GPU autotune list (the
``AUTOTUNE`` of each kernels module, picked with
``cuboid.kernels._backend.autotune_pick``; the compile gate,
tests/kernels/test_compile_gate.py, has compiled each for sm_80 and sm_90)
and checks each entry's output against entry 0's.

``--dry-run`` first prints every comparison the GPU run would make (kernel,
size, dtype, each anchor and whether it is available), then sets
TRITON_INTERPRET=1 before cuboid.kernels is imported, uses CPU tensors, checks
fp32/fp16 only (the interpreter's bf16 arithmetic is wrong), times with
time.perf_counter and skips the anchors that need CUDA: its timings are
meaningless, it only proves every branch runs.
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
import importlib  # noqa: E402
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
    rope_check=dict(b=2, s=333, h=8, hkv=2, dims=(64, 128)),
    swiglu_check=dict(rows=512, widths=(1000, 11008)),
    lce_check=dict(rows=1000, hidden=256, vocabs=(50257, 1000), chunk=384),
    lce_shapes=((16384, 4096, 128256),),  # tokens x hidden x vocab: Llama 3 8B's head (Liger's figure)
    rope_shapes=((4, 4096, 32, 8, 128),),  # (b, s, h, hkv, d): Llama 3 8B
    swiglu_shapes=((16384, 14336),),  # tokens x intermediate: Llama 3 8B
    opt_model=dict(d=2048, layers=20),  # 20 layers x 10 tensors = 200 tensors, 1.007B params
    copy_numel=1 << 28, mm=8192, goal_seq=4096,
    tune=dict(attn=dict(b=4, h=16, s=4096, dims=(64, 128)), norm=(16384, 4096), rope=(4, 4096, 32, 8, 128),
              swiglu=(16384, 14336), optim=dict(d=2048, layers=20)),
)
DRY_CFG = dict(
    attn_check=dict(b=2, h=2, s=67, dims=(64, 80, 128)),
    norm_check=dict(rows=16, hidden=(256, 1000)),
    opt_check=[(1,), (1000,), (33, 65), (3, 5, 7)],
    attn_seqs=(32, 64), attn_tokens=128, attn_dims=(64, 128), attn_width=128,
    norm_shapes=((64, 256), (64, 512)),
    rope_check=dict(b=2, s=33, h=4, hkv=2, dims=(64,)),
    swiglu_check=dict(rows=16, widths=(100, 1000)),
    lce_check=dict(rows=20, hidden=32, vocabs=(300,), chunk=8),
    lce_shapes=((64, 32, 500),),
    rope_shapes=((1, 32, 4, 2, 64),),
    swiglu_shapes=((64, 256),),
    opt_model=dict(d=64, layers=2),
    copy_numel=1 << 22, mm=256, goal_seq=64,
    tune=dict(attn=dict(b=1, h=2, s=64, dims=(64,)), norm=(16, 256), rope=(1, 16, 4, 2, 64), swiglu=(16, 256),
              optim=dict(d=32, layers=1)),
)
# (atol, rtol) per dtype; the references run on fp32 copies of the same inputs
ATTN_OUT_TOL = {F32: (1e-4, 1e-4), F16: (3e-3, 3e-3), BF16: (3e-2, 2e-2)}
ATTN_GRAD_TOL = {F32: (2e-4, 1e-4), F16: (1e-2, 5e-3), BF16: (8e-2, 5e-2)}
ATTN_LSE_TOL = {F32: (1e-4, 1e-4), F16: (1e-3, 1e-3), BF16: (1e-3, 1e-3)}
NORM_TOL = {F32: (1e-4, 1e-5), F16: (4e-3, 4e-3), BF16: (3e-2, 2e-2)}
LOWER_IS_BETTER = ("ms", "GiB peak")
LCE_TOL = {F32: (1e-4, 1e-4), F16: (3e-3, 3e-3), BF16: (3e-2, 2e-2)}  # fused vs unfused on the same dtype inputs
ELEM_TOL = {F32: (1e-5, 1e-5), F16: (2e-3, 2e-3), BF16: (2e-2, 2e-2)}  # RoPE, SwiGLU: one rounding of the output
TUNE_TOL = {F32: (1e-5, 1e-5), F16: (4e-3, 4e-3), BF16: (3e-2, 2e-2)}  # an autotune entry vs entry 0
# Datasheet peaks (dense bf16 tensor TFLOP/s, HBM GB/s) by a substring of torch.cuda.get_device_name()
PEAKS = (("GH200", 989.4, 4000.0), ("H200", 989.4, 4800.0), ("H100 PCIe", 756.0, 2000.0), ("H100", 989.4, 3350.0),
         ("B200", 2250.0, 8000.0), ("A100-SXM4-80GB", 312.0, 2039.0), ("A100 80GB PCIe", 312.0, 1935.0),
         ("A100", 312.0, 1555.0), ("L40S", 362.0, 864.0), ("L4", 121.0, 300.0))
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
    "rope bytes: read q, k and write them (cos/sin tables not counted), the same backward; peers: Liger's "
    "LigerRopeFunction and the Hugging Face formula in torch (q * cos + rotate_half(q) * sin); inputs in "
    "Hugging Face's layout (B, T, H, D) storage viewed as (B, H, T, D), which both kernels read in place",
    "swiglu bytes: 3 x tensor bytes forward (read gate, up, write y), 5 x backward (read dy, gate, up, write two "
    "grads); peers: Liger's LigerSiLUMulFunction and F.silu(gate) * up",
    "linear_cross_entropy: forward + backward timed as one step (the fused op makes its gradients in forward), "
    "FLOPs 6*N*H*V (logits, dx, dW); GiB peak: the step's peak allocation above its inputs; peers: Liger's "
    "LigerFusedLinearCrossEntropyFunction and the unfused head (F.linear, logits upcast to fp32 as transformers "
    "does, F.cross_entropy)",
    "cuboid/peer: peer time / cuboid time (> 1: cuboid faster); of ceiling: vs the copy_ GB/s (read+write) or "
    "the bf16 matmul TFLOP/s measured in this run; of peak: vs the datasheet figure of the device (PEAKS)",
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
    peak: Optional[float] = None  # the device's datasheet peak in `unit`

    @property
    def of_peak(self) -> Optional[float]:
        return None if self.peak is None or not self.cuboid else self.cuboid / self.peak

    @property
    def speedup(self) -> float:
        return self.peer / self.cuboid if self.unit in LOWER_IS_BETTER else self.cuboid / self.peer

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


# ---------------------------------------------------------------------------- anchors (imported lazily)

@dataclasses.dataclass
class Anchor:
    name: str
    fn: Optional[Callable] = None  # None: skipped, for the reason in `why`
    why: str = ""
    version: str = ""


LIGER = {  # anchor -> (module, autograd Function) of liger-kernel
    "liger layer_norm": ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction"),
    "liger rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "liger rope": ("liger_kernel.ops.rope", "LigerRopeFunction"),
    "liger swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "liger fused linear CE": ("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction"),
}


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


def load_anchors(dry: bool) -> dict:
    """name -> Anchor. Optional packages are imported here, not at module import; what is missing is skipped
    with its reason. In a dry run the anchors that need CUDA are listed, not run."""
    out = {"sdpa flash": Anchor("sdpa flash", F.scaled_dot_product_attention,
                                "CPU: SDPA's default backend (no flash backend)" if dry else "", torch.__version__),
           "torch fused AdamW": Anchor("torch fused AdamW", True, "", torch.__version__)}
    try:
        from flash_attn import flash_attn_func
        out["flash-attn 2"] = Anchor("flash-attn 2", flash_attn_func, "", _version("flash-attn"))
    except Exception as e:  # noqa: BLE001 - any import failure means: skip it
        out["flash-attn 2"] = Anchor("flash-attn 2", None, f"not importable ({type(e).__name__}: {e}); "
                                     "pip install flash-attn (builds against CUDA)")
    for name, (module, cls) in LIGER.items():
        try:
            out[name] = Anchor(name, getattr(importlib.import_module(module), cls).apply, "", _version("liger-kernel"))
        except Exception as e:  # noqa: BLE001
            out[name] = Anchor(name, None, f"not importable ({type(e).__name__}: {e}); pip install liger-kernel")
    if dry:
        for name in ("flash-attn 2", *LIGER):
            a = out[name]
            if a.fn is not None:  # importable, but its kernels need CUDA (liger's do not run in Triton's interpreter)
                out[name] = Anchor(name, None, "importable; its kernels need CUDA: listed only in a dry run",
                                   a.version)
    return out


def device_peaks(dry: bool) -> tuple:
    """(bf16 dense TFLOP/s, HBM GB/s) of this GPU from PEAKS, or (None, None)."""
    if dry:
        return None, None
    name = torch.cuda.get_device_name()
    for key, tflops, gbps in PEAKS:
        if key in name:
            return tflops, gbps
    return None, None


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
    mod = _kernel_module("linear_cross_entropy")  # (the package attribute is the function)
    try:
        chunk = mod.default_chunk(x.shape[0], w.shape[0], x.device.type, x.dtype)
        fp32 = mod._fp32_addmm(w)
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


# ---------------------------------------------------------------------------- part 3: the autotune lists

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


def _kernel_module(name: str):
    return importlib.import_module(f"cuboid.kernels.{name}")


def tune_cases(K, cfg, dev) -> dict:
    """op -> (module, [(size label, fn over inputs, inputs, dout, describe(entry) -> str)]): the shapes at which
    bench times every entry of an op's autotune list (ops of kernels modules without a case here are listed as
    untimed)."""
    import cuboid.kernels._backend as B
    fa, norm, optim, swiglu_m = (_kernel_module(n) for n in ("flash_attention", "norm", "optim", "swiglu"))

    def under(op, i, f):
        with B.autotune_pick(op, i):
            return f()

    out = {}
    a = cfg["tune"]["attn"]
    cases = []
    for d in a["dims"]:
        q, k, v, do = (torch.randn(a["b"], a["h"], a["s"], d, device=dev, dtype=BF16) for _ in range(4))

        def describe(i, d=d):
            f = under("attention", i, lambda: fa._config(d, BF16, False))
            b = under("attention", i, lambda: fa._config(d, BF16, True))
            return (f"fwd {f['BLOCK_M']}x{f['BLOCK_N']} w{f['num_warps']} s{f['num_stages']}, "
                    f"bwd {b['BLOCK_M']}x{b['BLOCK_N']} w{b['num_warps']} s{b['num_stages']}")
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
    return out


def tune_sweep(tune_rows: list, errors: list, bench, K, cfg, dev) -> None:
    """Every entry of every op's autotune list, timed; each entry's outputs and gradients against entry 0's."""
    import pkgutil

    import cuboid.kernels as pkg
    import cuboid.kernels._backend as B
    listed = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        for op, n in getattr(_kernel_module(info.name), "AUTOTUNE", {}).items():
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


# ---------------------------------------------------------------------------- the plan (printed by --dry-run)

def print_plan(anchors: dict, peaks: tuple) -> list:
    """Every comparison a GPU run makes, at the GPU sizes, with each anchor's availability; returns the lines."""
    def avail(name):
        return f"{name} [{'runs' if anchors[name].fn is not None else 'skipped'}]"
    g = GPU
    lines = ["checks (bf16, fp16, fp32 vs the torch references): attention d" +
             "/".join(map(str, g["attn_check"]["dims"])) + f" s{g['attn_check']['s']} causal x mask; layer_norm and "
             f"rms_norm {g['norm_check']['rows']}x" + "/".join(map(str, g["norm_check"]["hidden"])) +
             " +residual; rope d" + "/".join(map(str, g["rope_check"]["dims"])) + f" s{g['rope_check']['s']} "
             f"h{g['rope_check']['h']}/{g['rope_check']['hkv']}; swiglu {g['swiglu_check']['rows']}x" +
             "/".join(map(str, g["swiglu_check"]["widths"])) + " chunked; linear_cross_entropy "
             f"{g['lce_check']['rows']}x{g['lce_check']['hidden']} vocab " +
             "/".join(map(str, g["lce_check"]["vocabs"])) + " vs the unfused head; AdamW, LAMB, LARS x3 steps"]
    for s in g["attn_seqs"]:
        for d in g["attn_dims"]:
            b, h = max(1, g["attn_tokens"] // s), max(1, g["attn_width"] // d)
            for causal in (False, True):
                lines.append(f"attention fwd+bwd b{b} h{h} s{s} d{d} {'causal' if causal else 'full'} bf16, TFLOP/s: "
                             f"cuboid vs {avail('sdpa flash')}, {avail('flash-attn 2')}")
    for M, n in g["norm_shapes"]:
        lines.append(f"layer_norm fwd+bwd {M}x{n} bf16, GB/s: cuboid vs F.layer_norm, {avail('liger layer_norm')}")
        lines.append(f"rms_norm fwd+bwd {M}x{n} bf16, GB/s: cuboid vs F.rms_norm, {avail('liger rms_norm')}")
    for b, s, h, hkv, d in g["rope_shapes"]:
        lines.append(f"rope fwd+bwd b{b} s{s} h{h}/{hkv} d{d} bf16, GB/s: cuboid vs {avail('liger rope')}, "
                     "torch (HF formula)")
    for M, n in g["swiglu_shapes"]:
        lines.append(f"swiglu fwd+bwd {M}x{n} bf16, GB/s: cuboid vs {avail('liger swiglu')}, F.silu(g) * u")
    for N, H, V in g["lce_shapes"]:
        lines.append(f"linear_cross_entropy fwd+bwd {N} tokens x {H} -> {V} bf16, TFLOP/s and GiB peak: cuboid vs "
                     f"{avail('liger fused linear CE')}, unfused (F.linear + fp32 F.cross_entropy)")
    lines.append(f"AdamW step 1.0B params fp32, GB/s and ms: cuboid vs {avail('torch fused AdamW')}; "
                 "LAMB, LARS vs cuboid's torch._foreach reference")
    t = g["tune"]
    lines.append(f"tune: every autotune entry of attention (b{t['attn']['b']} h{t['attn']['h']} s{t['attn']['s']} d" +
                 "/".join(map(str, t["attn"]["dims"])) + f" causal), norm (rms {t['norm'][0]}x{t['norm'][1]}), "
                 f"rope, swiglu ({t['swiglu'][0]}x{t['swiglu'][1]}), optim (AdamW): ms, and outputs vs entry 0")
    lines.append("ceilings: copy_ of 1 GiB (GB/s), bf16 matmul 8192^3 (TFLOP/s); datasheet peaks by device name: " +
                 ", ".join(f"{k} {tf:g} TFLOP/s {gb:g} GB/s" for k, tf, gb in PEAKS))
    lines += [f"{a.name}: {'available' if a.fn is not None else 'skipped'}"
              f"{' (' + a.version + ')' if a.version else ''}{': ' + a.why if a.why else ''}"
              for a in anchors.values()]
    print("\n== plan: the comparisons a GPU run makes (GPU sizes), then the anchors")
    for line in lines:
        print(f"  - {line}")
    return lines


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
    print("| kernel | size | unit | cuboid | peer | peer name | cuboid/peer | of ceiling | of peak |")
    print("| --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        d = 2 if r.unit == "ms" else 1
        print(f"| {r.kernel} | {r.size} | {r.unit} | {fmt(r.cuboid, d)} | {fmt(r.peer, d)} | {r.peer_name} | "
              f"{fmt(r.speedup, 2)} | {fmt(r.fraction, 2)} | {fmt(r.of_peak, 2)} |")
    print()
    for note in NOTES:
        print(f"- {note}")


def print_skipped(skipped: list) -> None:
    """One line per (anchor, reason), with the comparisons it missed counted."""
    if not skipped:
        return
    counts: dict = {}
    for line in skipped:
        what, _, why = line.partition(" vs ")
        counts.setdefault(why, []).append(what)
    print("\nanchors skipped:")
    for why, whats in counts.items():
        print(f"  {why} ({len(whats)} comparison{'s' if len(whats) > 1 else ''}, e.g. {whats[0]})")


def print_tune(tune_rows: list) -> None:
    if not tune_rows:
        return
    print("\nautotune lists (entry 0 is the launcher's choice; * marks the fastest fwd + bwd):\n")
    print("| op | size | entry | config | fwd ms | bwd ms | err/tol vs entry 0 |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: |")
    for r in tune_rows:
        print(f"| {r.op} | {r.size} | {r.entry}{' *' if r.best else ''} | {r.config} | {fmt(r.fwd_ms, 3)} | "
              f"{fmt(r.bwd_ms, 3)} | {fmt(r.ratio, 3)} |")


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
    ap.add_argument("--part", choices=("all", "checks", "timing", "tune"), default="all",
                    help="run only the checks, the timing or the autotune sweep (for a quick rerun)")
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
    anchors = load_anchors(dry)
    peaks = device_peaks(dry)
    plan = print_plan(anchors, peaks)
    if dry:
        print("\n(dry run: the same code paths follow on CPU at tiny sizes; anchors that need CUDA are skipped)")

    # part 1: correctness
    dtypes = (F16, F32) if dry else (BF16, F16, F32)
    if dry:
        print("note: bf16 checks skipped in --dry-run (the Triton interpreter's bf16 arithmetic is wrong)")
    checks: list = []
    check_sections = (("attention", lambda: check_attention(checks, K, cfg["attn_check"], dev, dtypes)),
                      ("norms", lambda: check_norms(checks, K, cfg["norm_check"], dev, dtypes)),
                      ("rope", lambda: check_rope(checks, K, cfg["rope_check"], dev, dtypes)),
                      ("swiglu", lambda: check_swiglu(checks, K, cfg["swiglu_check"], dev, dtypes)),
                      ("linear_cross_entropy", lambda: check_lce(checks, K, cfg["lce_check"], dev, dtypes)),
                      ("optimizers", lambda: check_optim(checks, cfg["opt_check"], dev, dtypes)))
    for name, fn in check_sections if args.part in ("all", "checks") else ():
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
    skipped: list = []
    tune_rows: list = []
    timing_errors = []
    ceil = dict(copy_GBps=math.nan, copy_bytes=4 * cfg["copy_numel"], matmul_bf16_TFLOPs=math.nan, matmul_n=cfg["mm"])
    time_sections = (("ceilings", lambda: ceil.update(ceilings(bench, cfg, dev))),
                     ("attention", lambda: time_attention(rows, bench, K, cfg, dev, ceil, flash_ctx, anchors, skipped,
                                                          peaks)),
                     ("norms", lambda: time_norms(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
                     ("rope", lambda: time_rope(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
                     ("swiglu", lambda: time_swiglu(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
                     ("linear_cross_entropy", lambda: time_lce(rows, bench, K, cfg, dev, ceil, anchors, skipped,
                                                               peaks)),
                     ("optimizers", lambda: time_optim(rows, bench, cfg, dev, ceil, peaks)),
                     ("tune", lambda: tune_sweep(tune_rows, timing_errors, bench, K, cfg, dev)))
    wanted = {"all": set(dict(time_sections)), "checks": set(), "timing": set(dict(time_sections)) - {"tune"},
              "tune": {"tune"}}[args.part]
    for name, fn in ((n, f) for n, f in time_sections if n in wanted):
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
    if rows or args.part in ("all", "timing"):
        print_table(header, rows, ceil, dry)
        print_skipped(skipped)
    print_tune(tune_rows)
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
                  rows=[dict(dataclasses.asdict(r), speedup=r.speedup, fraction_of_ceiling=r.fraction,
                             fraction_of_peak=r.of_peak) for r in rows],
                  peaks=dict(zip(("bf16_TFLOPs", "HBM_GBps"), peaks)), plan=plan, anchors_skipped=list(
                      dict.fromkeys(skipped)), anchors={n: dict(available=a.fn is not None, why=a.why,
                                                                version=a.version) for n, a in anchors.items()},
                  tune=[dataclasses.asdict(r) for r in tune_rows],
                  goals=goals, timing_errors=timing_errors, notes=NOTES, seconds=dict(section_s, total=total_s))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(finite(result), f, indent=1)
    print(f"wrote {out_path}")
    return 1 if failed or timing_errors else 0


if __name__ == "__main__":
    sys.exit(main())
