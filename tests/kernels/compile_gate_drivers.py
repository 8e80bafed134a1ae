"""The compile gate's drivers (tests/kernels/compile_gate.py): one per module of cuboid.kernels, calling the
module's public functions on ``meta`` tensors over every dtype, every row of its launchers' config tables and the
shapes and flags its launches take, while the gate records each launch instead of running it.

``DRIVERS`` maps the module a driver calls to the driver; ``DRIVEN_BY`` names the kernel-only modules whose
kernels another module's launchers launch (their kernels are checked as reached like any other).
"""
from __future__ import annotations

from typing import Callable, Dict

# config table. Tensors are on the meta device (no data, any size).

F32 = F16 = BF16 = None  # set by _torch_names()
DTYPES = ()


def _torch_names():
    global F32, F16, BF16, DTYPES
    import torch
    F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
    DTYPES = (F32, F16, BF16)


def _dn(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _meta(*shape, dtype, grad=True):
    import torch
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def _backward(outs):
    import torch
    outs = [o for o in outs if o is not None and o.requires_grad]
    torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])


def _pick(gate, full, subset):
    """The full list under ``--full`` (CUBOID_GATE_FULL=1), else the CI subset."""
    return full if gate.full else subset


# Attention flag sets: (causal, key padding mask, K/V heads of 4 query heads, document ids, window).
_FULLEST = (True, True, 2, False, None)  # causal + mask + grouped K/V heads
_CAUSAL = (True, False, 4, False, None)  # a training step's launch (MHA: GROUP specialised to 1)
_MASKED = (False, True, 2, False, None)  # not causal, padded keys (encoders)
_PLAIN = (False, False, 4, False, None)
_PACKED = (True, True, 2, True, None)  # document ids
_WINDOWED = (True, True, 2, False, 256)
_WINDOWED_DOCS = (True, True, 2, True, 256)  # every flag at once
# Sequence lengths: launches reach the kernels with lengths that are multiples of 16 (Triton specialises the
# length and its pointer offsets as 16-divisible) and lengths that are not (the specialisation the last
# partial block's masks run in, and the one that takes more registers).
_ODD, _EVEN = 1000, 1024


def drive_flash_attention(gate, mod) -> None:
    # Head dims select every row of _GPU_FWD / _GPU_DKDV / _GPU_DQ: 2-byte rows d <= 64, 128, 256; fp32 rows
    # d <= 32, 64, 128, 256 (d32 and d16 share the d64 row in half precision: compiled under --full). CI: every
    # half-precision dtype and row takes the fullest, causal, masked, packed and packed + window flag sets at an
    # odd length and the causal one (a training step's launch) at a multiple of 16; bf16 adds the plain and the
    # window-only sets; fp32 (whose spills are reported, not failed) the fullest and packed ones at the odd
    # length. --full: every set at both lengths for every dtype. Autotune passes: the half-precision rows only
    # (fp32 rows have one entry), bf16 in CI, the fullest, causal and packed sets at the odd length.
    dtypes = (BF16, F16) if gate.tuning else DTYPES
    for dtype in dtypes:
        dims = (64, 128, 256) if dtype != F32 else (32, 64, 128, 256)
        if gate.full and dtype != F32:
            dims = (32,) + dims
        for d in dims:
            if gate.full:
                sets = (_FULLEST, _CAUSAL, _MASKED, _PACKED, _WINDOWED_DOCS, _PLAIN, _WINDOWED)
                cases = [(f, s) for f in sets for s in (_ODD, _EVEN)]
            elif dtype == F32:
                cases = [(_FULLEST, _ODD), (_PACKED, _ODD)]
            else:
                cases = [(f, _ODD) for f in (_FULLEST, _CAUSAL, _MASKED, _PACKED, _WINDOWED_DOCS)]
                cases += [(_CAUSAL, _EVEN)] + ([(_PLAIN, _ODD), (_WINDOWED, _ODD)] if dtype == BF16 else [])
            if gate.tuning and not gate.full:
                cases = [(f, _ODD) for f in (_FULLEST, _CAUSAL, _PACKED)] if dtype == BF16 else []
            for (causal, masked, hkv, docs, window), s in cases:
                label = f"attention {_dn(dtype)} d{d} s{s}{' causal' if causal else ''}{' mask' if masked else ''}" \
                        f"{' gqa' if hkv != 4 else ''}{' docs' if docs else ''}{' window' if window else ''}"
                with gate.case(label):
                    _attention(mod, 2, 4, hkv, s, d, dtype, causal, masked, docs, window)
    if gate.tuning:
        return
    with gate.case("attention bf16 d64 q257 k1000 causal mask"):  # Sq != Sk, both odd: the odd variants again
        _attention(mod, 2, 4, 2, 257, 64, BF16, True, True, s_k=1000)
    _attention_sinks_and_latent(gate, mod)
    # grids: B * H = 2^17 (ViT inference at batch 8192 x 16 heads), one 4M-token sequence, many short ones
    for b, h, s in ((8192, 16, 256), (1, 1, 1 << 22), (1 << 16, 8, 16)):
        with gate.case(f"attention grid b{b} h{h} s{s}"):
            _attention(mod, b, h, h, s, 64, BF16, True, False)
    with gate.case("attention grid b1 h1 s4194304 docs"):  # the document spans of a 4M-token packed row
        _attention(mod, 1, 1, 1, 1 << 22, 64, BF16, True, False, True)
    with gate.case("attention grid b1 h1 s4194304 window"):  # a 4M-token row at a 4096-token window
        _attention(mod, 1, 1, 1, 1 << 22, 64, BF16, True, False, False, 4096)


def _attention_sinks_and_latent(gate, mod) -> None:
    # gpt-oss's attention (sinks, d64, GQA; its full layers and its 128-token sliding ones, packed or not) and
    # DeepSeek-V3's latent split (q/k head dim 192 on the d256 row, v's 128 unpadded; MHA). Sinks change only the
    # forward and the backward's preprocess kernel; the split changes all four. CI: bf16 with the fullest, causal
    # (a multiple of 16), window and packed + window sets (sinks) and the fullest, causal (odd and a multiple of
    # 16) and packed sets (the split); fp16 and fp32 the fullest set of each. --full: every set at both lengths.
    every = [(f, s) for f in (_FULLEST, _CAUSAL, _MASKED, _PACKED, _WINDOWED_DOCS, _PLAIN, _WINDOWED)
             for s in (_ODD, _EVEN)]
    for dtype in DTYPES:
        sinks = [(_FULLEST, _ODD)] + ([(_CAUSAL, _EVEN), (_WINDOWED, _ODD), (_WINDOWED_DOCS, _ODD)]
                                      if dtype == BF16 else [])
        latent = [(_FULLEST, _ODD)] + ([(_CAUSAL, _ODD), (_CAUSAL, _EVEN), (_PACKED, _ODD)] if dtype == BF16 else [])
        if gate.full:
            sinks, latent = every, [c for c in every if c[0][4] is None]
        for (causal, masked, hkv, docs, window), s in sinks:
            flags = f"{' causal' if causal else ''}{' mask' if masked else ''}{' docs' if docs else ''}"
            with gate.case(f"attention {_dn(dtype)} d64 s{s}{flags} gqa{' window' if window else ''} sinks"):
                _attention(mod, 2, 4, 2, s, 64, dtype, causal, masked, docs, window and 128, sinks=True)
        for (causal, masked, hkv, docs, window), s in latent:
            flags = f"{' causal' if causal else ''}{' mask' if masked else ''}{' docs' if docs else ''}"
            with gate.case(f"attention {_dn(dtype)} d192 dv128 s{s}{flags}"):
                _attention(mod, 2, 4, 4, s, 192, dtype, causal, masked, docs, d_v=128)


def _attention(mod, b, h, hkv, s, d, dtype, causal, masked, docs=False, window=None, s_k=None, sinks=False,
               d_v=None):
    import torch
    s_k = s if s_k is None else s_k
    q = _meta(b, h, s, d, dtype=dtype)
    k, v = _meta(b, hkv, s_k, d, dtype=dtype), _meta(b, hkv, s_k, d if d_v is None else d_v, dtype=dtype)
    mask = torch.empty(b, s_k, dtype=torch.bool, device="meta") if masked else None
    ids = torch.empty(b, s, dtype=torch.int32, device="meta") if docs else None
    sink = _meta(h, dtype=torch.float32) if sinks else None
    out, lse = mod.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True, doc_ids=ids,
                             window=window, sinks=sink)
    _backward([out, lse])


def drive_norm(gate, mod) -> None:
    # Hidden sizes that select every row of _block_sizes (tile -> 4, 8, 16 warps; many rows packed: 4096 x 1000;
    # one row: 1 x 1000) and the wide path (N > MAX_ONE_PASS: 16384, 65536). Flags: layer norm with residual and
    # affine in x's dtype (every dtype), RMS norm with residual and an fp32 weight, layer norm without residual
    # or affine (one dtype each in CI, every dtype under --full).
    shapes = _pick(gate, ((4096, 64), (4096, 1000), (4096, 4096), (4096, 8192), (1024, 16384), (512, 32768),
                          (256, 65536), (1, 64), (1, 1000)),
                   ((4096, 1000), (4096, 8192), (1, 1000), (1024, 16384), (256, 65536)))
    for dtype in (BF16,) if gate.tuning and not gate.full else DTYPES:
        for rows, n in shapes:
            with gate.case(f"layer_norm {_dn(dtype)} {rows}x{n} residual affine"):
                x, r = _meta(rows, n, dtype=dtype), _meta(rows, n, dtype=dtype)
                _backward(mod.layer_norm(x, _meta(n, dtype=dtype), _meta(n, dtype=dtype), residual=r))
            if gate.full or dtype == BF16:
                with gate.case(f"rms_norm {_dn(dtype)} {rows}x{n} residual fp32 weight"):
                    x, r = _meta(rows, n, dtype=dtype), _meta(rows, n, dtype=dtype)
                    _backward(mod.rms_norm(x, _meta(n, dtype=F32), residual=r))
            if gate.full or dtype == F32:
                with gate.case(f"layer_norm {_dn(dtype)} {rows}x{n} plain"):
                    _backward([mod.layer_norm(_meta(rows, n, dtype=dtype), None, None)])
    if not gate.tuning:
        with gate.case("rms_norm grid 2^26 rows"):
            _backward([mod.rms_norm(_meta(1 << 26, 64, dtype=BF16), _meta(64, dtype=BF16))])


def drive_rope(gate, mod) -> None:
    # head dims 64..256 and head counts that select each num_warps row (tile = heads x D/2, capped at TILE_ELEMS)
    cases = _pick(gate, [(d, h, hkv) for d in (64, 128, 256) for h, hkv in ((32, 8), (4, 4), (128, 8))],
                  [(128, 32, 8), (64, 4, 4), (256, 128, 8), (64, 1, 1)])
    for dtype in (BF16,) if gate.tuning and not gate.full else DTYPES:
        for d, h, hkv in cases:
            with gate.case(f"rope {_dn(dtype)} d{d} h{h}/{hkv}"):
                q, k = _meta(2, h, 512, d, dtype=dtype), _meta(2, hkv, 512, d, dtype=dtype)
                cos, sin = _meta(512, d, dtype=F32, grad=False), _meta(512, d, dtype=F32, grad=False)
                _backward(mod.rope(q, k, cos, sin))
    if not gate.tuning:
        with gate.case("rope grid 2^24 tokens"):
            q, k = _meta(1 << 12, 32, 1 << 12, 128, dtype=BF16), _meta(1 << 12, 8, 1 << 12, 128, dtype=BF16)
            cos, sin = _meta(1 << 12, 128, dtype=F32, grad=False), _meta(1 << 12, 128, dtype=F32, grad=False)
            _backward(mod.rope(q, k, cos, sin))


def drive_swiglu(gate, mod) -> None:
    # widths below, at and above MAX_BLOCK_N: every num_warps row of _launch_cfg; one strided (chunked) pair
    for dtype in (BF16,) if gate.tuning and not gate.full else DTYPES:
        for n in (256, 1000, 4096, 14336):
            with gate.case(f"swiglu {_dn(dtype)} 4096x{n}"):
                _backward([mod.swiglu(_meta(4096, n, dtype=dtype), _meta(4096, n, dtype=dtype))])
        with gate.case(f"swiglu {_dn(dtype)} 4096x11008 chunked"):
            gate_, up = _meta(4096, 2 * 11008, dtype=dtype).chunk(2, dim=-1)
            _backward([mod.swiglu(gate_, up)])
    if not gate.tuning:
        with gate.case("swiglu grid 2^24 rows"):
            _backward([mod.swiglu(_meta(1 << 24, 256, dtype=BF16), _meta(1 << 24, 256, dtype=BF16))])


def drive_optim(gate, mod) -> None:
    # every (param dtype, grad dtype, master) launch group and every step kind; the segment sum with 1 and 2 rows
    import torch
    shapes = [(4096, 1024), (1000,), (7,)]
    combos = _pick(gate, [(F32, F32, False), (F32, BF16, False), (BF16, BF16, True), (F16, F16, True),
                          (BF16, BF16, False), (F16, F32, True)],
                   [(F32, F32, False), (BF16, BF16, True), (F16, F32, True), (BF16, BF16, False)])
    if gate.tuning and not gate.full:
        combos = [(F32, F32, False), (BF16, BF16, True)]
    for p_dt, g_dt, master in combos:
        label = f"{_dn(p_dt)} params, {_dn(g_dt)} grads{', fp32 master' if master else ''}"

        def lists(n_states):
            ps = [torch.empty(s, dtype=p_dt, device="meta") for s in shapes]
            gs = [torch.empty(s, dtype=g_dt, device="meta") for s in shapes]
            states = [[torch.empty(s, dtype=F32, device="meta") for s in shapes] for _ in range(n_states)]
            ms = [torch.empty(s, dtype=F32, device="meta") for s in shapes] if master else None
            return ps, gs, states, ms

        for maximize in (False, True) if gate.full else (False,):
            tag = label + (" maximize" if maximize else "")
            with gate.case(f"adamw {tag}"):
                ps, gs, (m, v), ms = lists(2)
                mod.adamw_step(ps, gs, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1,
                               master_params=ms, maximize=maximize)
            with gate.case(f"lamb {tag}"):
                ps, gs, (m, v), ms = lists(2)
                mod.lamb_step(ps, gs, m, v, lr=1e-3, step=1, master_params=ms, maximize=maximize)
            with gate.case(f"lars {tag}"):
                ps, gs, (b,), ms = lists(1)
                mod.lars_step(ps, gs, b, lr=1e-3, master_params=ms, maximize=maximize)
        with gate.case(f"grad_norm_sq {_dn(g_dt)}"):
            mod.grad_norm_sq([torch.empty(s, dtype=g_dt, device="meta") for s in shapes], per_tensor=True)
    if not gate.tuning:
        with gate.case("adamw grid one 2^33-element tensor"):
            big = [torch.empty(1 << 33, dtype=BF16, device="meta")]
            st = [torch.empty(1 << 33, dtype=F32, device="meta") for _ in range(3)]
            mod.adamw_step(big, big, st[:1], st[1:2], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                           step=1, master_params=st[2:])


def drive_linear_cross_entropy(gate, mod) -> None:
    # local vocab widths that select each row of _launch_cfg (BLOCK_V 4096 / 1024 / 128: 8, 4, 2 warps), the
    # GPT-2 vocab with a bias, the vocab-parallel form (a slice with padding, a reduce callable), and the per-row
    # form with its entropy (whole vocabulary and a slice)
    import torch
    for dtype in (BF16,) if gate.tuning and not gate.full else DTYPES:
        for vocab, bias in ((50257, True), (1000, False), (100, False)):
            with gate.case(f"linear_cross_entropy {_dn(dtype)} 1024x256 vocab {vocab}{' bias' if bias else ''}"):
                x, w = _meta(1024, 256, dtype=dtype), _meta(vocab, 256, dtype=dtype)
                b = _meta(vocab, dtype=dtype) if bias else None
                labels = torch.empty(1024, dtype=torch.int64, device="meta")
                _backward([mod.linear_cross_entropy(x, w, labels, b)])
        with gate.case(f"linear_cross_entropy {_dn(dtype)} vocab-parallel slice"):
            x, w = _meta(1024, 256, dtype=dtype), _meta(12568, 256, dtype=dtype)
            labels = torch.empty(1024, dtype=torch.int64, device="meta")
            _backward([mod.linear_cross_entropy(x, w, labels, vocab_start=37704, vocab_size=50257,
                                                reduce=lambda t, op: t)])
        # reduction="none": the statistics kernel's ENTROPY form, the gradient kernel's per-row scale
        for vocab, start in ((50257, 0), (12568, 37704)):
            with gate.case(f"linear_cross_entropy {_dn(dtype)} per row, entropy, vocab {vocab}"):
                x, w = _meta(1024, 256, dtype=dtype), _meta(vocab, 256, dtype=dtype)
                labels = torch.empty(1024, dtype=torch.int64, device="meta")
                rows, _ = mod.linear_cross_entropy(x, w, labels, reduction="none", return_entropy=True,
                                                   vocab_start=start, vocab_size=50257, reduce=lambda t, op: t)
                _backward([rows])


def drive_grouped_gemm(gate, mod) -> None:
    # the driver lives beside the grouped GEMM's own gate test (tests/kernels/test_grouped_gemm_gate.py)
    try:  # run as a script, tests/kernels is on sys.path
        from test_grouped_gemm_gate import drive_grouped_gemm as drive
    except ImportError:
        from tests.kernels.test_grouped_gemm_gate import drive_grouped_gemm as drive
    drive(gate, mod)


def drive_nf4_linear(gate, mod) -> None:
    # the dequantize (double-quantized and fp32 scales) into each dtype, and the fused linear's one tile config
    # over the three activation dtypes, forward and its dx backward, at a Llama-8B MLP shape
    import torch
    from cuboid.kernels.nf4 import NF4Weight

    def qweight(n, k, nested):
        blocks = n * k // 64
        u8 = lambda *s: torch.empty(s, dtype=torch.uint8, device="meta")  # noqa: E731
        f32 = lambda *s: torch.empty(s, dtype=F32, device="meta")  # noqa: E731
        if nested:
            return NF4Weight(u8(n * k // 2, 1), u8(blocks), f32(16), (n, k), BF16, 64, f32(-(-blocks // 256)),
                             f32(256), f32())
        return NF4Weight(u8(n * k // 2, 1), f32(blocks), f32(16), (n, k), BF16)

    for nested in (True, False):
        for dtype in DTYPES if nested or gate.full else (BF16,):
            with gate.case(f"nf4_dequantize {_dn(dtype)}{' nested' if nested else ''} 14336x4096"):
                mod.dequantize_nf4(qweight(14336, 4096, nested), dtype)
    for dtype in DTYPES:
        with gate.case(f"nf4_linear {_dn(dtype)} 4096x4096 @ 14336x4096"):
            _backward([mod.nf4_linear(_meta(4096, 4096, dtype=dtype), qweight(14336, 4096, True))])


# module (under cuboid.kernels) -> driver. A module with Triton kernels and no entry here fails the gate.
DRIVERS: Dict[str, Callable[[object, object], None]] = {
    "flash_attention": drive_flash_attention,
    "grouped_gemm": drive_grouped_gemm,
    "linear_cross_entropy": drive_linear_cross_entropy,
    "nf4_linear": drive_nf4_linear,
    "norm": drive_norm,
    "optim": drive_optim,
    "rope": drive_rope,
    "swiglu": drive_swiglu,
}
# kernel-only module -> the module whose driver launches its kernels
DRIVEN_BY: Dict[str, str] = {
    "flash_attention_bwd": "flash_attention",
    "flash_attention_fwd": "flash_attention",
    "norm_wide": "norm",
}
