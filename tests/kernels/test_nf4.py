"""cuboid.kernels.nf4: NF4 with double quantization, bit-equal to bitsandbytes 0.50 on CPU (codes, absmax,
quant_map, nested_absmax, nested_quant_map, the packed quant-state JSON, and dequantized values), and the
dequantize against a float64 computation."""
import json

import bitsandbytes.functional as bnbf  # a test dependency (pyproject's [test]): the reference
import pytest
import torch

from cuboid.kernels import nf4
from tests import bnb_cpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True, scope="module")
def bitsandbytes_reference_kernels():
    """bitsandbytes' pure-torch dequantize as its CPU kernel where the native one is wrong on this CPU."""
    bnb_cpu.use_reference_kernels()


def weight(shape, dtype, seed):
    """Rows of different scales (so block absmaxes spread), one all-zero row when there are several."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], *([1] * (len(shape) - 1)), generator=g) * 0.1
    if len(shape) > 1 and shape[0] > 2:
        w[1] = 0.0
    return w.to(dtype)


def test_dynamic_map_equals_bitsandbytes():
    assert torch.equal(nf4.dynamic_map(), bnbf.create_dynamic_map())
    assert torch.equal(nf4.nf4_code(), bnbf.get_4bit_type("nf4", device="cpu"))


def test_8bit_quantizer_equals_bitsandbytes_on_a_dense_grid():
    # every value of a fine grid of [-1, 1] (each block led by 1.0 so its absmax is 1), plus a zero block and a
    # short last block: the grid rule decides values near the map's midpoints exactly as bitsandbytes does
    xs = torch.linspace(-1, 1, 255 * 1024)
    a = torch.cat([torch.ones(1024, 1), xs.view(1024, 255)], 1).reshape(-1)
    a = torch.cat([a, torch.zeros(256), torch.randn(100)])
    want, want_absmax = torch.ops.bitsandbytes.quantize_blockwise(a, bnbf.create_dynamic_map(), 256)
    got, got_absmax = nf4.quantize_8bit(a, 256)
    assert torch.equal(got_absmax, want_absmax)
    assert torch.equal(got, want), f"{(got != want).sum().item()} of {a.numel()} indices differ"


CASES = [((64, 300), F32), ((33, 17), BF16), ((128, 4096), F16), ((7,), F32), ((300, 2000), BF16), ((96, 64), F16)]


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{'x'.join(map(str, s))}-{str(d)[6:]}" for s, d in CASES])
def test_quantize_is_bit_equal_to_bitsandbytes(shape, dtype):
    w = weight(shape, dtype, seed=sum(shape))
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    qw = nf4.quantize_nf4(w)
    ours = qw.state_dict("weight")
    theirs = state.as_dict(packed=True)
    assert torch.equal(ours["weight"], packed) and ours["weight"].dtype == torch.uint8
    assert set(ours) == {"weight"} | {f"weight.{k}" for k in theirs}
    for k, v in theirs.items():
        assert ours[f"weight.{k}"].dtype == v.dtype and torch.equal(ours[f"weight.{k}"], v), k
    meta = json.loads(bytes(ours["weight.quant_state.bitsandbytes__nf4"].tolist()))
    assert meta["shape"] == list(shape) and meta["nested_offset"] == state.offset.item()
    # dequantized values (bitsandbytes' CPU dequantize of an odd last dim goes through torch.compile: seconds of
    # compiling for one case, so those compare with one device's reference only), and a round trip through the
    # serialized layout
    want = bnbf.dequantize_4bit(packed, state) if shape[-1] % 2 == 0 else nf4.dequantize_nf4_ref(qw)
    assert torch.equal(nf4.dequantize_nf4_ref(qw), want)
    back = nf4.NF4Weight.from_state_dict({k: v.clone() for k, v in ours.items()}, "weight")
    assert torch.equal(nf4.dequantize_nf4_ref(back), want)


def test_without_double_quant_equals_bitsandbytes():
    w = weight((40, 48), F32, seed=3)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
    qw = nf4.quantize_nf4(w, double_quant=False)
    assert torch.equal(qw.weight, packed) and torch.equal(qw.absmax, state.absmax)
    assert set(qw.state_dict()) == {"weight"} | {f"weight.{k}" for k in state.as_dict(packed=True)}
    assert torch.equal(nf4.dequantize_nf4_ref(qw), bnbf.dequantize_4bit(packed, state))


def test_the_cpu_kernels_used_are_bitsandbytes_pure_torch_dequantize():
    """tests/bnb_cpu.py's reference is bitsandbytes' own "default" dequantize kernel (its pure-torch computation,
    compiled as bitsandbytes runs it), and with the helper run bitsandbytes' CPU dequantize equals cuboid's where
    blocks straddle rows (rows of 160: the shape the AVX-512 kernel gets wrong), on any CPU."""
    assert set(bnb_cpu.use_reference_kernels()) == {"dequantize_4bit", "dequantize_blockwise", "gemv_4bit"}
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    for dtype, double_quant in ((F32, True), (BF16, True), (F32, False), (BF16, False)):
        w = weight((24, 160), dtype, seed=13)
        packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
        absmax = state.absmax
        if double_quant:
            absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
        ref = bnb_cpu.reference_dequantize_4bit(packed, absmax, 64, "nf4", state.shape, dtype)
        if dtype == BF16 and double_quant:  # one compile of bitsandbytes' computation (seconds) for one case
            theirs = torch.ops.bitsandbytes.dequantize_4bit.default.redispatch(
                default, packed, absmax, 64, "nf4", list(state.shape), dtype)
            assert torch.equal(ref, theirs)
        qw = nf4.quantize_nf4(w, double_quant=double_quant)
        assert torch.equal(qw.weight, packed)
        assert torch.equal(bnbf.dequantize_4bit(packed, state), ref)
        assert torch.equal(nf4.dequantize_nf4_ref(qw), ref), (dtype, double_quant)


def test_dequantize_matches_float64():
    """codes and block scales read back in float64: the fp32 dequantize is within its three roundings of it."""
    w = weight((70, 128), F32, seed=5)
    qw = nf4.quantize_nf4(w)
    codes = nf4.unpack(qw.weight, w.numel())
    scale64 = (nf4.dynamic_map().double()[qw.absmax.long()]
               * qw.nested_absmax.double().repeat_interleave(256)[:qw.absmax.numel()] + qw.offset.double())
    want = (torch.tensor(nf4.NF4_CODE, dtype=torch.float64)[codes]
            * scale64.repeat_interleave(64)[:w.numel()]).view(w.shape)
    got = nf4.dequantize_nf4_ref(qw, torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-12)
    # and the error is what 4 bits give: half the widest NF4 gap of the block's absmax, plus the scale's own error
    true = w.reshape(-1, 64).abs().amax(1).double() if w.numel() % 64 == 0 else None
    assert true is not None
    bound = (0.5 * 0.3039 * true + (scale64 - true).abs()).repeat_interleave(64) + 1e-7
    assert bool(((got - w).abs().reshape(-1).double() <= bound).all())


def test_bad_input_is_a_clear_error():
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        nf4.quantize_nf4(torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match="blocksize"):
        nf4.quantize_nf4(torch.zeros(64), blocksize=48)
    with pytest.raises(ValueError, match="NF4 quant state"):
        nf4.NF4Weight.from_state_dict({"weight": torch.zeros(4, 1, dtype=torch.uint8)})


def test_chunked_quantization_is_the_same(monkeypatch):
    """A large tensor is quantized a few blocks at a time: chunk edges (and an odd tail) change nothing."""
    for shape in ((33, 17), (64, 300)):
        w = weight(shape, BF16, seed=11)
        want = nf4.quantize_nf4(w).state_dict()
        monkeypatch.setattr(nf4, "_CHUNK_BLOCKS", 3)
        got = nf4.quantize_nf4(w).state_dict()
        monkeypatch.undo()
        assert all(torch.equal(got[k], v) for k, v in want.items()), shape
        packed, _ = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        assert torch.equal(got["weight"], packed)
