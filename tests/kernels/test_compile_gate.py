"""The compile gate: every Triton kernel, as its launcher picks it, compiled for sm_80 and sm_90 on CPU.

``tests/kernels/compile_gate.py`` (drivers in compile_gate_drivers.py) does the work in a subprocess (this process
runs the kernels in the interpreter, whose objects cannot be compiled): it
drives every module's launchers on meta tensors with the launch intercepted,
compiles each distinct launch for both targets and measures it. The tests
below turn its result into one assertion per property, each listing every
offender. The CI subset of shapes and flags is stated in each driver;
``CUBOID_GATE_FULL=1`` compiles the full matrix.

A run from an empty Triton cache takes minutes on 2 cores, a warm one
(``~/.triton/cache``) seconds; bench/RESULTS.md has the counts, times and table.

Also here, in the interpreter: the pieces the gate made the kernels change
(attention's flat grid, norm's wide-row path, the autotune picks).
"""
import importlib
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.kernels import compile_gate as G

GATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_gate.py")


def _toolchain_missing() -> str:
    try:
        from triton import knobs
        for tool in (knobs.nvidia.ptxas, knobs.nvidia.cuobjdump):
            if not tool.path or not os.path.exists(tool.path):
                return "Triton's CUDA toolchain (ptxas, cuobjdump) is not installed"
    except Exception as e:  # noqa: BLE001
        return f"Triton's CUDA backend is unavailable: {e}"
    return ""


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    why = _toolchain_missing()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("compile_gate") / "gate.json"
    env = dict(os.environ, TRITON_INTERPRET="0")
    # in a session of its own, so that a timeout stops the compile processes it forked too (killing the gate
    # alone leaves them asleep, holding its pipes)
    proc = subprocess.Popen([sys.executable, GATE, "--json", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the compile gate ran past 1800 s (its processes were stopped)")
    if not out.exists():
        pytest.fail(f"the compile gate did not run (exit {proc.returncode}):\n{stdout[-4000:]}\n{stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["violations"] = G.violations(result)
    return result


def _none(result, check):
    bad = result["violations"][check]
    if bad:
        pytest.fail(f"{len(bad)} {check} failure(s):\n  " + "\n  ".join(bad), pytrace=False)


def test_every_kernel_is_reached_by_a_driver(gate):
    """A module with kernels but no driver, or a kernel no driver launches, fails here (add a driver)."""
    assert gate["variants"], "the gate compiled nothing"
    _none(gate, "coverage")


def test_every_kernel_compiles_for_sm80_and_sm90(gate):
    _none(gate, "compile")


def test_shared_memory_within_the_target(gate):
    """sm_80: 163 KB, sm_90: 227 KB per block (dynamic + static)."""
    _none(gate, "shared_memory")


def test_registers_fit_one_block_on_an_sm(gate):
    _none(gate, "registers")


def test_half_precision_matmuls_use_tensor_cores(gate):
    """mma.sync (sm_80) or wgmma (sm_90) in the PTX of every fp16/bf16 kernel that calls tl.dot."""
    dots = [v for v in gate["variants"] if v["uses_dot"] and v["half"]]
    assert dots, "no half-precision tl.dot kernel was compiled"
    _none(gate, "tensor_cores")


def test_no_register_spills_in_half_precision(gate):
    """No stack (spill) bytes in any fp16/bf16 config a launcher picks, autotune entries included."""
    _none(gate, "spills")


def test_grids_within_cuda_limits(gate):
    """x < 2^31, y and z <= 65535, for every launch (the drivers include B*H = 2^17 and 4M-token sequences)."""
    _none(gate, "grid")


def test_attention_with_b_times_h_2_17_launches(gate):
    launches = [launch for launch in gate["launches"] if launch["case"] == "attention grid b8192 h16 s256"]
    kernels = {launch["kernel"] for launch in launches}
    assert kernels == {"attn_fwd_kernel", "attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel",
                       "attn_bwd_dq_kernel"}
    for launch in launches:
        x, y, z = launch["grid"]
        assert y == z == 1 and 8192 * 16 <= x < 2 ** 31, launch


def test_attention_with_document_ids_is_compiled(gate):
    """Packed rows' kernels (HAS_DOCS) for every dtype and head-dim row, forward and both backward passes."""
    attn = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
    seen = {(v["kernel"], v["signature"]["Q"][1:], v["shown"]["BLOCK_D"]) for v in gate["variants"]
            if v["kernel"] in attn and v["shown"].get("HAS_DOCS") and not all(c.startswith("[") for c in v["cases"])}
    want = {(k, dt, d) for k in attn for dt, dims in (("fp32", (32, 64, 128, 256)), ("fp16", (64, 128, 256)),
                                                       ("bf16", (64, 128, 256))) for d in dims}
    assert want <= seen, sorted(want - seen)
    plain = [v for v in gate["variants"] if v["kernel"] in attn and not v["shown"].get("HAS_DOCS")]
    assert plain, "the kernels without document ids were not compiled"


def test_attention_is_compiled_at_lengths_that_are_not_multiples_of_16(gate):
    """Launches reach the kernels with any length: for fp16 and bf16, head dims 64 and 128, the forward and both
    backward kernels are compiled at an odd length (1000), causal and not, with a key padding mask, and at a
    multiple of 16, and the two make different variants (the length's divisibility is specialised)."""
    attn = ("attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
    for kernel in attn:
        for dt in ("float16", "bfloat16"):
            for d in (64, 128):
                def ids(*words):
                    return {v["id"] for v in gate["variants"] if v["kernel"] == kernel and any(
                        c.startswith(f"attention {dt} d{d} ") and all(w in c.split() for w in words)
                        for c in v["cases"])}
                odd = ids("s1000")
                assert ids("s1000", "causal", "mask") and ids("s1000", "mask") - ids("s1000", "causal"), \
                    (kernel, dt, d)
                assert ids("s1024") and odd and not odd & ids("s1024"), (kernel, dt, d)


def test_attention_with_sinks_and_a_192_128_head_split_is_compiled(gate):
    """gpt-oss's sinks (HAS_SINKS: the forward and the backward's preprocess kernel) and DeepSeek-V3's q/k head
    dim 192 beside v's 128 (BLOCK_D 256, BLOCK_DV 128: v not padded) for fp16 and bf16, all four kernels; the
    checks above (compile, shared memory, registers, spills, tensor cores) cover these variants too."""
    for dt in ("fp16", "bf16"):
        half = [v for v in gate["variants"] if v["kernel"].startswith("attn_")
                and v["signature"].get("Q", v["signature"].get("O", ""))[1:] == dt]
        sinks = {v["kernel"] for v in half if v["shown"].get("HAS_SINKS")}
        assert sinks == {"attn_fwd_kernel", "attn_bwd_preprocess_kernel"}, (dt, sinks)
        split = {v["kernel"] for v in half if v["shown"].get("BLOCK_D") == 256 and v["shown"].get("BLOCK_DV") == 128}
        assert split == {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"}, (dt, split)
        pre = [v for v in gate["variants"] if v["kernel"] == "attn_bwd_preprocess_kernel"
               and any(" d192 dv128 " in c for c in v["cases"])]
        assert pre and all(v["shown"]["BLOCK_D"] == 128 for v in pre), "the preprocess kernel reads O, dO at Dv"


def test_every_autotune_entry_is_compiled(gate):
    """Each module's AUTOTUNE entries 1.. were driven through the launchers (entry 0 is the default run)."""
    for name, ops in gate["autotune"].items():
        for op, n in ops.items():
            for i in range(1, n):
                prefix = f"[{op} autotune #{i}] "
                assert any(c.startswith(prefix) for v in gate["variants"] for c in v["cases"]), \
                    f"cuboid.kernels.{name}: autotune entry {i} of {op!r} was never compiled"


# ----------------------------------------------------------------------------------- the checker itself


def _fake(half=True, uses_dot=True, grid=(1, 1, 1), num_warps=4, **res):
    r = dict(arch=90, ok=True, shared=1024, static_shared=0, regs=96, stack=0, local=0, mma_sync=True, wgmma=True)
    r.update(res)
    v = dict(id=0, module="m", kernel="k", cases=["c"], num_warps=num_warps, num_stages=2, half=half, uses_dot=uses_dot,
             results={"90": r})
    return dict(targets={"90": 227 * 1024}, grid_max=G.GRID_MAX, regs_per_sm=G.REGS_PER_SM, missing_drivers=[],
                unreached=[], driver_errors=[], variants=[v],
                launches=[dict(module="m", kernel="k", case="c", grid=list(grid), variant=0)])


@pytest.mark.parametrize("check,fake", [
    ("compile", _fake(ok=False, error="CompilationError: boom")),
    ("shared_memory", _fake(shared=300 * 1024)),
    ("registers", _fake(regs=255, num_warps=16)),  # 255 x 512 threads > 65536 (x 256 threads would fit)
    ("tensor_cores", _fake(mma_sync=False, wgmma=False)),
    ("spills", _fake(stack=16)),
    ("grid", _fake(grid=(1, 70000, 1))),
], ids=["compile", "smem", "regs", "tensor-cores", "spills", "grid"])
def test_checker_flags_each_kind_of_failure(check, fake):
    bad = G.violations(fake)
    assert bad[check] and all(not items for k, items in bad.items() if k != check), bad
    assert not any(G.violations(_fake()).values())
    assert not G.violations(_fake(half=False, stack=64))["spills"]  # fp32 spills are reported, not failed
    assert not G.violations(_fake(regs=255, num_warps=8))["registers"]


# ----------------------------------------------------------------------------------- interpreter checks

FA = importlib.import_module("cuboid.kernels.flash_attention")
NORM = importlib.import_module("cuboid.kernels.norm")
OPTIM = importlib.import_module("cuboid.kernels.optim")
from cuboid.kernels import _backend  # noqa: E402


def test_attention_grid_is_flat_on_x():
    assert FA._grid(256, 64, 2 ** 17) == (4 * 2 ** 17,)
    assert FA._grid(1, 32, 1) == (1,)
    assert FA._grid(1 << 22, 32, 1) == ((1 << 22) // 32,)
    with pytest.raises(ValueError, match="exceed CUDA's grid limit"):
        FA._grid(1 << 20, 32, 1 << 17)


@pytest.mark.skipif(not _backend.interpreter_active(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_flat_grid_matches_reference(causal):
    """Odd B * H with several query and key blocks per head: the flat program index decomposes right."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 70, 16, generator=g).requires_grad_()
    k, v = (torch.randn(3, 2, 90, 16, generator=g).requires_grad_() for _ in range(2))
    mask = torch.rand(3, 90, generator=g) > 0.2
    outs = []
    for fn in (FA.attention, FA.attention_ref):
        out, lse = fn(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True)
        grads = torch.autograd.grad((out * torch.cos(out)).sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
        outs.append((out, lse, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def _norm64(kind, x, w, b, r, eps):
    h = x.double() + (r.double() if r is not None else 0)
    h = h.to(x.dtype).double()  # the kernel normalises the rounded h it returns
    if kind == "layer":
        y = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        y = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y


@pytest.mark.skipif(not _backend.interpreter_active(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("kind,dtype,residual,affine", [
    ("layer", torch.float32, True, True), ("rms", torch.float32, True, True), ("layer", torch.float32, False, False),
    ("rms", torch.float16, True, True), ("layer", torch.float16, False, True),
])
def test_norm_wide_rows_match_float64(monkeypatch, kind, dtype, residual, affine):
    """Rows wider than MAX_ONE_PASS take the chunked kernels; dweight / dbias over several row groups."""
    monkeypatch.setattr(NORM, "_num_bwd_programs", lambda device, M, block_m: 100)  # 17 column blocks x 3 groups
    M, N = 20, NORM.MAX_ONE_PASS + 9
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, N, generator=g).to(dtype).requires_grad_()
    r = torch.randn(M, N, generator=g).to(dtype).requires_grad_() if residual else None
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).requires_grad_() if affine else None
    b = (0.1 * torch.randn(N, generator=g)).to(dtype).requires_grad_() if affine and kind == "layer" else None
    dy, dh = torch.randn(M, N, generator=g).to(dtype), torch.randn(M, N, generator=g).to(dtype)
    if kind == "layer":
        out = NORM.layer_norm(x, w, b, 1e-5, residual=r, backend="triton")
    else:
        out = NORM.rms_norm(x, w, 1e-5, residual=r, backend="triton")
    y, h = out if residual else (out, None)
    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad([y] + ([h] if residual else []), leaves, [dy] + ([dh] if residual else []))
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    x64 = next(it)
    r64 = next(it) if residual else None
    w64 = next(it) if w is not None else None
    b64 = next(it) if b is not None else None
    y64 = _norm64(kind, x64, w64, b64, r64, 1e-5)
    outs64 = [y64] + ([x64 + r64] if residual else [])
    grads64 = torch.autograd.grad(outs64, ref_leaves, [dy.double()] + ([dh.double()] if residual else []))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y.double(), y64, **tol)
    for a, e in zip(grads, grads64):
        torch.testing.assert_close(a.double(), e, **(tol if a.dim() == 2 else dict(atol=tol["atol"] * 20,
                                                                                   rtol=tol["rtol"] * 5)))


def test_autotune_pick_scopes_and_falls_back():
    assert _backend.picked("x", ("a", "b")) == "a"
    with _backend.autotune_pick("x", 1):
        assert _backend.picked("x", ("a", "b")) == "b"
        assert _backend.picked("x", ("a",)) == "a"  # past a row's list: the launcher's own choice
        with _backend.autotune_pick("x", 0):
            assert _backend.picked("x", ("a", "b")) == "a"
        assert _backend.picked("x", ("a", "b")) == "b"
    assert _backend.picked("x", ("a", "b")) == "a"
    with pytest.raises(ValueError, match="index must be an int >= 0"):
        with _backend.autotune_pick("x", -1):
            pass


@pytest.mark.skipif(not _backend.interpreter_active(), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("pick", range(OPTIM.AUTOTUNE["optim"]))
def test_optim_autotune_entries_match_torch(pick):
    """Every (BLOCK, num_warps) entry of the optimizer's autotune list takes torch's AdamW step."""
    g = torch.Generator().manual_seed(2)
    shapes = [(3000,), (33, 65), (5,)]
    ps = [torch.randn(s, generator=g) for s in shapes]
    gs = [torch.randn(s, generator=g) for s in shapes]
    states = {b: ([p.clone() for p in ps], [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes])
              for b in ("torch", "triton")}
    for backend, (p, m, v) in states.items():
        with _backend.autotune_pick("optim", pick):
            OPTIM.adamw_step(p, gs, m, v, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=1,
                             backend=backend)
    for a, b in zip(states["torch"], states["triton"]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)

