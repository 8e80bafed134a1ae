"""bench/gpu.py's shared parts: sizes, tolerances, datasheet peaks, the check and row records, the comparison
of outputs, the timer, the anchors (imported lazily) and number formatting."""
from __future__ import annotations

import dataclasses
import importlib
import math
import statistics
import time
import traceback
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton

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
              swiglu=(16384, 14336), optim=dict(d=2048, layers=20),
              grouped_mm=(16384, 16, 1536, 2048)),  # rows (tokens x top-k), experts, out, in: Qwen3-30B-A3B-like
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
              optim=dict(d=32, layers=1), grouped_mm=(64, 4, 32, 32)),
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




def kernel_module(name: str):
    """The module ``cuboid.kernels.<name>`` (the package attribute of the same name is often the function)."""
    return importlib.import_module(f"cuboid.kernels.{name}")


def fmt(x: Optional[float], digits=1) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits else f"{x:.2g}"  # tiny (dry-run) values stay visible


def markdown(columns: str, rows) -> None:
    """Print a markdown table: ``columns`` as "name | name:" (a trailing ``:`` right-aligns the column),
    ``rows`` as lists of cells."""
    names = [c.strip() for c in columns.split("|")]
    print("| " + " | ".join(n.rstrip(":") for n in names) + " |")
    print("| " + " | ".join("---:" if n.endswith(":") else "---" for n in names) + " |")
    for cells in rows:
        print("| " + " | ".join(str(c) for c in cells) + " |")


def finite(x):
    """JSON-safe copy: nan/inf become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


class Budget:
    """The call's time budget: an item whose estimate would pass what is left is skipped, and said so."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.t0 = time.perf_counter()
        self.skipped: list = []  # one line per skipped item

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def allows(self, what: str, need_s: float) -> bool:
        if self.left() >= need_s:
            return True
        self.skipped.append(f"{what}: skipped by the {self.seconds:.0f} s budget (needs ~{need_s:.0f} s, "
                            f"{max(0.0, self.left()):.0f} s left)")
        return False
