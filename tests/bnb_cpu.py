"""bitsandbytes 0.50's native CPU kernels that the tests' references run through, checked once per process
against bitsandbytes' own pure-torch computation, and replaced by it where they disagree.

Two native paths are wrong on some CPUs, and the tests compare with what bitsandbytes means, not with them:

- ``dequantize_4bit``: the AVX-512 kernel gets rows whose width is not a multiple of the blocksize wrong (its
  blocks indexed per row, not over the flattened tensor as the scalar path and the AVX2 one of bitsandbytes PR
  #2072 do): 535,122 of the 600,000 values of a 300x2000 bf16 weight, with 2.2x the error of the right values.
  Replaced by bitsandbytes' pure-torch computation (its "default" kernel) as the "cpu" kernel.
- ``gemv_4bit``: on CPUs with AVX-512 BF16, ``Linear4bit`` repacks its weight at inference (eval, no grad) and
  runs this native kernel, which computes in bf16 (input, block scales, output) whatever
  ``bnb_4bit_compute_dtype`` says: 4e-3 of the largest output off an fp32 linear. The repack is turned off
  (bitsandbytes' ``nn.modules.has_avx512bf16`` answers False, as on CPUs without AVX-512 BF16) so the forward
  is ``gemm_4bit``: dequantize, then a linear in the compute dtype.

:func:`use_reference_kernels` does the probes and replacements once per process, is a no-op where the native
kernels agree, and prints one line saying what it replaced and why. Call it before building a transformers +
bitsandbytes model (``Linear4bit`` reads ``has_avx512bf16`` when it is built).
"""
import functools
import itertools
import sys
import warnings

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _eager(fn):
    """bitsandbytes wraps its pure-torch computations in torch.compile (a compile per new shape); the function
    underneath computes the same values eagerly."""
    return getattr(fn, "__wrapped__", fn)


def reference_dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype):
    """bitsandbytes' "default" ``dequantize_4bit`` kernel: its pure-torch computation over the flat tensor."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    if A.dtype != torch.uint8:
        A = A.view(torch.uint8)
    code = _get_4bit_code(quant_type, A.device)
    return _eager(_dequantize_4bit_compute)(A.reshape(-1), absmax, code, blocksize, shape, dtype)


def reference_dequantize_blockwise(A, absmax, code, blocksize, dtype):
    """bitsandbytes' "default" ``dequantize_blockwise`` kernel (the 8-bit one double quantization's scales use)."""
    from bitsandbytes.backends.default.ops import _dequantize_blockwise_compute

    return _eager(_dequantize_blockwise_compute)(A.reshape(-1), absmax, code, blocksize, dtype).reshape(A.shape)


def _weight(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.1).to(dtype)


def _dequantize_4bit_agrees() -> bool:
    """Native against reference where blocks straddle rows: rows of 160 and 2000 values (2.5 and 31.25 blocks of
    64; measured wrong on an AVX-512 CPU, as rows of 96, while rows of 100, 136, 200 and 1000 came out right), NF4
    with and without double quantization, fp32, bf16 and fp16."""
    import bitsandbytes.functional as bnbf

    for shape, dtype, nested in itertools.product(((12, 160), (3, 2000)), DTYPES, (False, True)):
        w = _weight(shape, dtype, seed=7)
        packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")
        absmax = state.absmax
        if nested:
            absmax = (bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
        want = reference_dequantize_4bit(packed, absmax, 64, "nf4", state.shape, dtype)
        if not torch.equal(bnbf.dequantize_4bit(packed, state), want):
            return False
    return True


def _dequantize_blockwise_agrees() -> bool:
    """Native against reference on 1000 values (blocks of 256 and a partial one), into fp32, bf16 and fp16."""
    import bitsandbytes.functional as bnbf

    code = bnbf.create_dynamic_map().float()
    for dtype in DTYPES:
        a, absmax = torch.ops.bitsandbytes.quantize_blockwise(_weight((1, 1000), torch.float32, 5)[0], code, 256)
        native = torch.ops.bitsandbytes.dequantize_blockwise(a, absmax, code, 256, dtype)
        if not torch.equal(native, reference_dequantize_blockwise(a, absmax, code, 256, dtype)):
            return False
    return True


def _linear4bit_forward_agrees() -> bool:
    """``Linear4bit``'s forward in eval without grad (the repacked native ``gemv_4bit`` where the CPU has AVX-512
    BF16) against dequantize + linear, fp32 compute: within fp32 summation-order rounding (1e-5 of the largest
    output); bf16 compute is about 4e-3 off."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    w = _weight((64, 256), torch.float32, seed=9)
    layer = bnb.nn.Linear4bit(256, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True)
    layer = layer.to("cpu").eval()  # quantizes the weight
    x = _weight((3, 256), torch.float32, seed=10)
    want = x @ bnbf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).t()
    with torch.no_grad():
        got = layer(x)
    return float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def _register_cpu_kernel(op, fn):
    """``fn`` as the "cpu" kernel of ``op`` in place of bitsandbytes' native one (torch's warning that a kernel
    is overridden is the point here: use_reference_kernels prints why)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        torch.library.register_kernel(op, "cpu", fn)


def _use_dequantize_4bit_reference():
    _register_cpu_kernel("bitsandbytes::dequantize_4bit", reference_dequantize_4bit)


def _use_dequantize_blockwise_reference():
    _register_cpu_kernel("bitsandbytes::dequantize_blockwise", reference_dequantize_blockwise)


def _use_dequantize_then_linear():
    import bitsandbytes.nn.modules as modules

    modules.has_avx512bf16 = lambda: False


# op: (probe, replacement, what the replacement is and why), in this order: the 4-bit probe's double-quantized
# scales go through dequantize_blockwise, and the forward probe's reference through dequantize_4bit
FIXES = {
    "dequantize_blockwise": (_dequantize_blockwise_agrees, _use_dequantize_blockwise_reference,
                             "its pure-torch computation (the native kernel differs from it)"),
    "dequantize_4bit": (_dequantize_4bit_agrees, _use_dequantize_4bit_reference,
                        "its pure-torch computation (the AVX-512 kernel indexes blocks per row, so rows whose width "
                        "is not a multiple of the blocksize come out wrong; see bitsandbytes PR #2072)"),
    "gemv_4bit": (_linear4bit_forward_agrees, _use_dequantize_then_linear,
                  "dequantize + linear in Linear4bit's forward (the AVX-512 BF16 repack's gemv computes in bf16 "
                  "whatever the compute dtype)"),
}


@functools.cache
def use_reference_kernels() -> dict:
    """Probe each native CPU kernel once per process; where one disagrees with bitsandbytes' pure-torch
    computation, replace it (see the module's text) and check the probe then agrees. Returns {op: whether the
    native kernel agreed}."""
    agrees = {}
    with torch.random.fork_rng(devices=[]):  # the probe's Linear4bit initializes from the global generator
        for op, (probe, replace, _) in FIXES.items():
            agrees[op] = probe()
            if not agrees[op]:
                replace()
                if not probe():
                    raise RuntimeError(f"tests/bnb_cpu.py: bitsandbytes' {op} still disagrees after its replacement")
    bad = [op for op in FIXES if not agrees[op]]
    if bad:
        print("tests/bnb_cpu.py: bitsandbytes' native CPU kernels disagree with its pure-torch computation here, so "
              + "; ".join(f"{op} is replaced by {FIXES[op][2]}" for op in bad), file=sys.stderr, flush=True)
    return agrees
