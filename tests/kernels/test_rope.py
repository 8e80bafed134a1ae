"""cuboid.kernels.rope: Triton (interpreter on CPU) vs the torch reference, the reference
vs a float64 ``apply_rotary_pos_emb``, and the tables vs transformers and Meta's llama3 formula.

Sizes are small: the interpreter runs programs one after another. bf16 runs only
in the float64 comparison of the reference (the interpreter's bf16 arithmetic is wrong).
"""
import math
import subprocess
import sys

import pytest
import torch

from cuboid.kernels import rope, rope_ref, rope_tables, use_backend
from cuboid.kernels.rope import rope_inv_freq

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TOL = {F32: dict(atol=1e-6, rtol=1e-6), F16: dict(atol=1e-3, rtol=1e-3), BF16: dict(atol=1e-2, rtol=1e-2)}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _rotate_half64(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def apply_rotary64(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb(unsqueeze_dim=1), in float64."""
    q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    cos, sin = (cos[None, None], sin[None, None]) if cos.dim() == 2 else (cos[:, None], sin[:, None])
    return q * cos + _rotate_half64(q) * sin, k * cos + _rotate_half64(k) * sin


def make(B, H, Hkv, T, D, dtype, table="T", seed=0, layout="bhtd", device="cpu"):
    """q (B, H, T, D), k (B, Hkv, T, D) leaves and (cos, sin) of shape (T, D), (1, T, D) or (B, T, D)."""
    g = torch.Generator().manual_seed(seed)

    def leaf(h):
        if layout == "bthd":  # the (B, T, H, D) projection output seen as (B, H, T, D): strided
            return torch.randn(B, T, h, D, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
        return torch.randn(B, h, T, D, generator=g).to(device, dtype).requires_grad_()

    q, k = leaf(H), leaf(Hkv)
    pos = {"T": torch.arange(T), "1T": torch.arange(3, 3 + T)[None],
           "BT": torch.randint(0, 1000, (B, T), generator=g)}[table]
    cos, sin = rope_tables(pos.to(device), D, 10000.0)
    return q, k, cos, sin


def grads(outs, ins, seed=1):
    g = torch.Generator().manual_seed(seed)
    ups = [torch.randn(o.shape, generator=g).to(o) for o in outs]
    return torch.autograd.grad(outs, ins, ups), ups


# (B, H, Hkv, T, D, table, layout)
CASES = [
    (2, 4, 2, 7, 16, "T", "bhtd"),
    (2, 3, 1, 5, 24, "BT", "bthd"),   # MQA, per-batch positions, strided heads
    (1, 2, 2, 9, 6, "1T", "bhtd"),    # D / 2 = 3: masked tail of the half tile
    (2, 1, 1, 4, 128, "T", "bthd"),
]


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}kv{}T{}D{}-{}-{}".format(*c))
def test_triton_matches_reference(case, dtype):
    B, H, Hkv, T, D, table, layout = case
    q, k, cos, sin = make(B, H, Hkv, T, D, dtype, table, layout=layout)
    got = rope(q, k, cos, sin, backend="triton")
    want = rope_ref(q, k, cos, sin)
    for a, b, x in zip(got, want, (q, k)):
        assert a.dtype == dtype and a.shape == x.shape
        torch.testing.assert_close(a, b, **TOL[dtype])
    (gq, gk), ups = grads(got, (q, k))
    wq, wk = torch.autograd.grad(want, (q, k), ups)
    torch.testing.assert_close(gq, wq, **TOL[dtype])
    torch.testing.assert_close(gk, wk, **TOL[dtype])


def test_triton_backward_is_rotation_by_minus_sin():
    q, k, cos, sin = make(2, 4, 2, 6, 16, F32)
    q_rot, k_rot = rope(q, k, cos, sin, backend="triton")
    (gq, gk), (uq, uk) = grads((q_rot, k_rot), (q, k))
    back = rope_ref(uq, uk, cos, -sin)
    torch.testing.assert_close(gq, back[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gk, back[1], atol=1e-6, rtol=1e-6)
    # and a rotation keeps norms per (head, token)
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("table", ["T", "BT"])
def test_table_gradients(table):
    # general tables (halves differ) that require grad: both backends agree with float64 autograd
    q, k, _, _ = make(2, 2, 1, 5, 8, F32, table)
    g = torch.Generator().manual_seed(4)
    shape = (5, 8) if table == "T" else (2, 5, 8)
    cos, sin = (torch.randn(shape, generator=g).requires_grad_() for _ in range(2))
    ins = (q, k, cos, sin)
    r64 = [t.detach().double().requires_grad_() for t in ins]
    want = apply_rotary64(*r64)
    ups = [torch.randn(o.shape, generator=g).double() for o in want]
    wgrads = torch.autograd.grad(want, r64, ups)
    for backend in ("triton", "torch"):
        got = rope(*ins, backend=backend)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-6)
        for a, b in zip(torch.autograd.grad(got, ins, [u.float() for u in ups]), wgrads):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_automatic_backend_and_forced_torch():
    q, k, cos, sin = make(1, 2, 1, 3, 8, F32)
    assert "cuboid_rope" in type(rope(q, k, cos, sin)[0].grad_fn).__name__  # CPU + interpreter: Triton's op
    with use_backend("torch"):
        got = rope(q, k, cos, sin)
    for a, b in zip(got, rope_ref(q, k, cos, sin)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("table", ["hf", "random"])
def test_torch_path_forward_and_backward_match_float64(table):
    """The CPU path (half by half, saving only the tables) against float64 autograd through the reference."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 9, 8, requires_grad=True), torch.randn(2, 2, 9, 8, requires_grad=True)
    if table == "hf":
        cos, sin = rope_tables(torch.arange(9), 8, 10000.0)
    else:  # halves that differ: the transposed rotation must pair the right halves
        cos, sin = torch.randn(9, 8), torch.randn(9, 8)
    with use_backend("torch"):
        got = rope(q, k, cos, sin)
    assert "RopeTorch" in type(got[0].grad_fn).__name__
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    want = rope_ref(q64, k64, cos.double(), sin.double())
    ups = [torch.randn_like(t) for t in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-6)
    for a, b in zip(torch.autograd.grad(got, (q, k), [u.float() for u in ups]),
                    torch.autograd.grad(want, (q64, k64), ups)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_package_attribute_is_the_function_whichever_import_comes_first():
    # kernels/rope.py defines rope (swiglu.py swiglu): importing the submodule first must not
    # leave the module where `from cuboid.kernels import rope` looks
    code = ("import importlib, types\n"
            "from cuboid.kernels.rope import rope_ref\n"
            "from cuboid.kernels.swiglu import swiglu_ref\n"
            "import cuboid.kernels as K\n"
            "from cuboid.kernels import rope, swiglu\n"
            "assert callable(rope) and rope is K.rope and rope.__name__ == 'rope', rope\n"
            "assert callable(swiglu) and swiglu is K.swiglu and swiglu.__name__ == 'swiglu', swiglu\n"
            "assert isinstance(importlib.import_module('cuboid.kernels.rope'), types.ModuleType)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# --------------------------------------------------------------------------
# reference vs float64
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("table", ["T", "BT"])
def test_reference_matches_float64(dtype, table):
    q, k, cos, sin = make(2, 4, 2, 7, 32, dtype, table)
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))  # the same rounded values
    got = rope_ref(q, k, cos, sin)
    want = apply_rotary64(q64, k64, cos, sin)
    (gq, gk), ups = grads(got, (q, k))
    wq, wk = torch.autograd.grad(want, (q64, k64), [u.double() for u in ups])
    for a, b in ((got[0], want[0]), (got[1], want[1]), (gq, wq), (gk, wk)):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, **TOL[dtype])


# --------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------


def _meta_llama3(freqs, factor, low, high, old_len):
    """Meta's reference apply_scaling (llama-models), one frequency at a time in float64."""
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            out.append(f)
        elif wavelen > old_len / low:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=F64)


def test_tables_match_float64_formulas():
    D, theta = 64, 500000.0
    plain64 = torch.tensor([1.0 / theta ** (i / D) for i in range(0, D, 2)], dtype=F64)
    torch.testing.assert_close(rope_inv_freq(D, theta).double(), plain64, atol=0, rtol=1e-6)
    scaled = rope_inv_freq(D, theta, LLAMA3).double()
    want = _meta_llama3(plain64.tolist(), 8.0, 1.0, 4.0, 64)
    torch.testing.assert_close(scaled, want, atol=0, rtol=1e-6)
    # all three bands occur at this size: kept, divided by 8, interpolated
    ratio = plain64 / want
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()
    pos = torch.tensor([[0, 5, 63, 1000], [7, 7, 2, 1]])
    cos, sin = rope_tables(pos, D, theta, LLAMA3)
    assert cos.shape == sin.shape == (2, 4, D) and cos.dtype == F32
    ang = pos[..., None].double() * torch.cat([want, want])
    # fp32 angles: error ~ |angle| * 2^-24
    torch.testing.assert_close(cos.double(), ang.cos(), atol=2e-4, rtol=0)
    torch.testing.assert_close(sin.double(), ang.sin(), atol=2e-4, rtol=0)
    c16, _ = rope_tables(pos[0], D, theta, dtype=BF16)
    assert c16.dtype == BF16 and c16.shape == (4, D)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_tables_bit_identical_to_transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, rope_theta=500000.0,
                                      rope_scaling=scaling, max_position_embeddings=1024)
    pos = torch.tensor([[0, 1, 2, 50, 63, 64, 100, 999]])
    want = LlamaRotaryEmbedding(config)(torch.zeros(1), pos)
    got = rope_tables(pos, 32, 500000.0, scaling)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------
# GPU (bf16 only runs there)
# --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=str)
def test_cuda_matches_reference(dtype):
    for B, H, Hkv, T, D, table, layout in CASES + [(2, 32, 8, 300, 128, "BT", "bthd")]:
        q, k, cos, sin = make(B, H, Hkv, T, D, dtype, table, layout=layout, device="cuda")
        got, want = rope(q, k, cos, sin), rope_ref(q, k, cos, sin)
        (gq, gk), ups = grads(got, (q, k))
        wq, wk = torch.autograd.grad(want, (q, k), ups)
        for a, b in ((got[0], want[0]), (got[1], want[1]), (gq, wq), (gk, wk)):
            torch.testing.assert_close(a, b, **TOL[dtype])


# --------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_errors(backend):
    q, k, cos, sin = (t.detach() for t in make(2, 4, 2, 5, 8, F32))
    cases = [
        (dict(q=q[..., :7], k=k[..., :7], cos=cos[:, :7], sin=sin[:, :7]), ValueError, "head_dim must be even"),
        (dict(k=k[:, :, :4]), ValueError, "k must share batch, seq and head_dim"),
        (dict(cos=cos[:4], sin=sin[:4]), ValueError, r"cos and sin must be \(T, D\) = \(5, 8\)"),
        (dict(cos=cos.expand(3, 5, 8)), ValueError, "cos and sin must have one shape"),
        (dict(k=k.half()), TypeError, "share one dtype"),
        (dict(q=q[0]), ValueError, "q must be 4-D"),
        (dict(sin=sin.long()), TypeError, "sin has dtype int64"),
    ]
    for over, exc, match in cases:
        args = dict(q=q, k=k, cos=cos, sin=sin)
        args.update(over)
        with pytest.raises(exc, match=match):
            rope(**args, backend=backend)


def test_table_errors():
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_tables(torch.arange(4), 8, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="llama3 rope scaling needs low_freq_factor"):
        rope_tables(torch.arange(4), 8, 1e4, {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        rope_tables(torch.arange(4.0), 8, 1e4)
    with pytest.raises(ValueError, match="head_dim must be an even int"):
        rope_tables(torch.arange(4), 7, 1e4)
    with pytest.raises(ValueError, match="theta must be a positive number"):
        rope_tables(torch.arange(4), 8, 0.0)
