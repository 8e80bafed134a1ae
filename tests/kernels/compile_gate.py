"""The compile gate: every Triton kernel of cuboid.kernels, as its launcher picks it, compiled for sm_80 and sm_90.

Run by ``tests/kernels/test_compile_gate.py`` in a subprocess (the test process
has ``TRITON_INTERPRET=1``, under which ``@triton.jit`` makes interpreter
objects that cannot be compiled), or by hand::

    python tests/kernels/compile_gate.py [--json out.json] [--table | --summary] [--full] [--jobs N]

How it works:

1. ``JITFunction.run`` (what ``kernel[grid](...)`` calls) and
   ``Autotuner.run`` are replaced by a recorder: a launch binds its arguments
   with Triton's own binder (the same specialization a real launch makes:
   pointer dtypes, ints equal to 1 made constexpr, 16-divisibility
   attributes) and records (kernel, signature, constexprs, attributes,
   num_warps, num_stages, grid) instead of running. An autotuned kernel
   records one launch per config in its list.
2. A *driver* per kernel module calls the module's public functions (forward
   and backward through autograd) on ``meta`` tensors, with the Triton
   backend forced, over the dtypes and shapes that select every row of the
   launcher's config table, every entry of the module's GPU autotune list
   (``AUTOTUNE`` in the module: op -> number of candidates, picked with
   :func:`cuboid.kernels._backend.autotune_pick`), and shapes large enough to
   stress the grid. Nothing runs: meta tensors have no data.
3. Every distinct launch variant is compiled with ``triton.compile`` for
   ``GPUTarget("cuda", 80, 32)`` and ``("cuda", 90, 32)`` (Triton's cache on
   disk makes a second run fast), and measured: dynamic shared memory
   (``metadata.shared``) plus static, registers and stack (spill) bytes from
   the ``cuobjdump --dump-resource-usage`` that ships inside Triton, and
   whether the PTX holds ``mma.sync`` / ``wgmma``.
4. Every module of the package is walked for JIT functions; a kernel that no
   driver launched (and no launched kernel calls) is reported, so a new kernel
   fails the gate until its module has a driver here.

The pytest side (test_compile_gate.py) turns the JSON this writes into
assertions: no compile failure, shared memory and registers within the
target, tensor cores in half-precision matmul kernels, no spills in half
precision, grids within CUDA's limits, every kernel reached.

CI compiles a subset (every config-table row and autotune entry, fewer flag x
dtype combinations; each driver says which); ``--full`` (or
CUBOID_GATE_FULL=1) compiles every combination the drivers know. Triton's
cache on disk makes a second run a matter of seconds; the counts and times
are in bench/RESULTS.md ("Compile gate").
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Dict, List, Optional

TARGETS = {80: 163 * 1024, 90: 227 * 1024}  # arch -> max shared memory per block (bytes, opt-in)
GRID_MAX = (2 ** 31 - 1, 65535, 65535)  # CUDA grid limits: x, y, z
REGS_PER_SM = 65536  # a block's registers (regs/thread x threads) must fit one SM's file

# ----------------------------------------------------------------------------------------------- recording


class Gate:
    """Records launches instead of running them; ``case`` labels the launches its body makes."""

    def __init__(self, full: bool = False):
        self.launches: List[dict] = []
        self.variants: Dict[tuple, dict] = {}
        self.label = "?"
        self.prefix = ""  # e.g. "[attention autotune #1] " while the drivers run under an autotune pick
        self.tuning = False  # True while the drivers run under an autotune pick (they may drive fewer cases)
        self.full = full  # every dtype x flag x shape (--full); else the CI subset each driver states
        self.errors: List[str] = []  # driver failures (a launcher raising is a gate failure)

    @contextlib.contextmanager
    def case(self, label: str):
        previous, self.label = self.label, self.prefix + label
        try:
            yield
        except Exception as e:  # noqa: BLE001 - reported, the walk goes on
            self.errors.append(f"{label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            self.label = previous

    def record(self, jit, args, kwargs, grid):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, opts = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, opts)
        options = {k: v for k, v in kwargs.items() if k not in signature}
        if callable(grid):
            grid = grid(bound)
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        names = list(signature)
        key = (jit.module, jit.__name__, repr(signature), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), repr(sorted(options.items())))
        variant = self.variants.get(key)
        if variant is None:
            variant = self.variants[key] = dict(
                id=len(self.variants), module=jit.module, kernel=jit.__name__, signature=signature,
                constexprs=constexprs, attrs=attrs, options=options, cases=[],
                num_warps=options.get("num_warps", 4), num_stages=options.get("num_stages", 3),
                half=any(t in ("*fp16", "*bf16") for t in signature.values()),
                shown={names[p[0]]: _show(v) for p, v in constexprs.items()
                       if not names[p[0]].startswith("stride")})
        if self.label not in variant["cases"]:
            variant["cases"].append(self.label)
        self.launches.append(dict(module=jit.module, kernel=jit.__name__, case=self.label, grid=grid,
                                  variant=variant["id"]))


def _show(v):
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


@contextlib.contextmanager
def intercept(gate: Gate):
    """Make every ``kernel[grid](...)`` (and every autotuned launch) record into ``gate``."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def jit_run(self, *args, grid, warmup, **kwargs):
        gate.record(self, args, kwargs, grid)

    def autotuner_run(self, *args, **kwargs):
        for config in self.configs:  # every entry of an autotune list is a launch the GPU may make
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, autotuner_run
    try:
        yield gate
    finally:
        JITFunction.run, Autotuner.run = saved


# ----------------------------------------------------------------------------------------------- drivers
# One per module of cuboid.kernels: call the public functions over every dtype and every row of the launcher's
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


def _pick(gate: Gate, full, subset):
    """The full list under ``--full`` (CUBOID_GATE_FULL=1), else the CI subset."""
    return full if gate.full else subset


def drive_flash_attention(gate: Gate, mod) -> None:
    # Head dims select every row of _GPU_FWD / _GPU_BWD: 2-byte rows d <= 64, 128, 256; fp32 rows d <= 32, 64,
    # 128, 256 (d32 and d16 share the d64 row in half precision: compiled under --full). Seq 1024 (a multiple of
    # 16, as training lengths are). Flags: the fullest kernel (causal + key padding mask + grouped K/V heads),
    # the same with packed rows' document ids, and the same with a sliding window on packed rows (every flag
    # at once), for every dtype and row; the window without documents and the plain one (MHA: GROUP
    # specialised to 1) for bf16 (CI) or every dtype (--full). Autotune passes: the half-precision rows only
    # (fp32 rows have one entry), bf16 in CI.
    fullest, packed, plain = (True, True, 2, False, None), (True, True, 2, True, None), (False, False, 4, False, None)
    windowed, windowed_docs = (True, True, 2, False, 256), (True, True, 2, True, 256)
    dtypes = (BF16, F16) if gate.tuning else DTYPES
    for dtype in dtypes:
        dims = (64, 128, 256) if dtype != F32 else (32, 64, 128, 256)
        if gate.full and dtype != F32:
            dims = (32,) + dims
        for d in dims:
            every = gate.full or dtype == BF16
            flags = [fullest, packed, windowed_docs] + ([plain, windowed] if every else [])
            if gate.tuning and not gate.full:
                flags = [fullest, packed, windowed_docs] if dtype == BF16 else []
            for causal, masked, hkv, docs, window in flags:
                label = f"attention {_dn(dtype)} d{d}{' causal' if causal else ''}{' mask' if masked else ''}" \
                        f"{' gqa' if hkv != 4 else ''}{' docs' if docs else ''}{' window' if window else ''}"
                with gate.case(label):
                    _attention(mod, 2, 4, hkv, 1024, d, dtype, causal, masked, docs, window)
    if gate.tuning:
        return
    # grids: B * H = 2^17 (ViT inference at batch 8192 x 16 heads), one 4M-token sequence, many short ones
    for b, h, s in ((8192, 16, 256), (1, 1, 1 << 22), (1 << 16, 8, 16)):
        with gate.case(f"attention grid b{b} h{h} s{s}"):
            _attention(mod, b, h, h, s, 64, BF16, True, False)
    with gate.case("attention grid b1 h1 s4194304 docs"):  # the document spans of a 4M-token packed row
        _attention(mod, 1, 1, 1, 1 << 22, 64, BF16, True, False, True)
    with gate.case("attention grid b1 h1 s4194304 window"):  # a 4M-token row at a 4096-token window
        _attention(mod, 1, 1, 1, 1 << 22, 64, BF16, True, False, False, 4096)


def _attention(mod, b, h, hkv, s, d, dtype, causal, masked, docs=False, window=None):
    import torch
    q = _meta(b, h, s, d, dtype=dtype)
    k, v = _meta(b, hkv, s, d, dtype=dtype), _meta(b, hkv, s, d, dtype=dtype)
    mask = torch.empty(b, s, dtype=torch.bool, device="meta") if masked else None
    ids = torch.empty(b, s, dtype=torch.int32, device="meta") if docs else None
    out, lse = mod.attention(q, k, v, causal=causal, key_padding_mask=mask, return_lse=True, doc_ids=ids,
                             window=window)
    _backward([out, lse])


def drive_norm(gate: Gate, mod) -> None:
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


def drive_rope(gate: Gate, mod) -> None:
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


def drive_swiglu(gate: Gate, mod) -> None:
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


def drive_optim(gate: Gate, mod) -> None:
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


def drive_linear_cross_entropy(gate: Gate, mod) -> None:
    # local vocab widths that select each row of _launch_cfg (BLOCK_V 4096 / 1024 / 128: 8, 4, 2 warps), the
    # GPT-2 vocab with a bias, and the vocab-parallel form (a slice with padding, a reduce callable)
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


# module (under cuboid.kernels) -> driver. A module with Triton kernels and no entry here fails the gate.
DRIVERS: Dict[str, Callable[[Gate, object], None]] = {
    "flash_attention": drive_flash_attention,
    "linear_cross_entropy": drive_linear_cross_entropy,
    "norm": drive_norm,
    "optim": drive_optim,
    "rope": drive_rope,
    "swiglu": drive_swiglu,
}

# ----------------------------------------------------------------------------------------------- discovery


def _unwrap(obj):
    """The JITFunction inside an Autotuner / Heuristics wrapper (or obj itself), else None."""
    from triton.runtime.jit import JITFunction
    for _ in range(8):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def kernel_modules():
    """(short name, module) for every module of cuboid.kernels, imported (Triton compile mode)."""
    import cuboid.kernels as pkg
    out = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        out.append((info.name, importlib.import_module(f"{pkg.__name__}.{info.name}")))
    return out


def jit_functions(module) -> dict:
    """name -> JITFunction for the JIT functions defined in ``module`` (kernels and @triton.jit helpers)."""
    found = {}
    for name, obj in vars(module).items():
        jf = _unwrap(obj)
        if jf is not None and jf.module == module.__name__:
            found[jf.__name__] = jf
    return found


def _called(jf, seen=None) -> set:
    """Names (module:name) of the JIT functions ``jf`` calls, transitively; and whether any of them uses tl.dot."""
    seen = set() if seen is None else seen
    tree = ast.parse(textwrap.dedent(inspect.getsource(jf.fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            target = _unwrap(jf.fn.__globals__.get(node.id))
            if target is not None and f"{target.module}:{target.__name__}" not in seen:
                seen.add(f"{target.module}:{target.__name__}")
                _called(target, seen)
    return seen


def _uses_dot(jf) -> bool:
    funcs = [jf] + [_unwrap(getattr(importlib.import_module(m), n)) for m, n in
                    (s.split(":") for s in _called(jf))]
    for f in funcs:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(f.fn)))):
            if isinstance(node, ast.Attribute) and node.attr in ("dot", "dot_scaled"):
                return True
    return False


# ----------------------------------------------------------------------------------------------- compiling

_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict:
    """REG / STACK / SHARED (static) / LOCAL of the one kernel in ``cubin``, read by Triton's cuobjdump."""
    from triton import knobs
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    m = _RES.search(text)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump's resource usage:\n{text}")
    return dict(regs=int(m.group(2)), stack=int(m.group(3)), static_shared=int(m.group(4)), local=int(m.group(5)))


def compile_one(job) -> dict:
    """Compile one variant for one arch (in a worker process) and measure it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, signature, constexprs, attrs, options, arch = job
    mod = importlib.import_module(module)
    jf = next(f for f in jit_functions(mod).values() if f.__name__ == kernel)
    t0 = time.perf_counter()
    try:
        k = triton.compile(ASTSource(fn=jf, signature=signature, constexprs=constexprs, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options=dict(options))
        ptx = k.asm["ptx"]
        res = resource_usage(k.asm["cubin"])
    except Exception as e:  # noqa: BLE001 - a compile failure is a result
        msg = str(e).strip().splitlines()
        return dict(arch=arch, ok=False, error=f"{type(e).__name__}: {' | '.join(msg[:6])[:1500]}",
                    seconds=time.perf_counter() - t0)
    return dict(arch=arch, ok=True, seconds=time.perf_counter() - t0, shared=int(k.metadata.shared),
                mma_sync="mma.sync" in ptx, wgmma="wgmma.mma_async" in ptx, **res)


def _worker_init():
    os.environ["TRITON_INTERPRET"] = "0"


def run_gate(jobs: Optional[int] = None, full: bool = False) -> dict:
    """Drive every module, compile every variant for every target; the JSON-ready result."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the compile gate needs TRITON_INTERPRET unset or 0 (it compiles, it does not interpret)")
    import multiprocessing

    _torch_names()
    from cuboid.kernels import _backend

    t0 = time.perf_counter()
    modules = kernel_modules()
    gate = Gate(full)
    autotune = {}
    missing_drivers = []
    saved_check = _backend._check_triton
    _backend._check_triton = lambda op, device: "triton"  # meta tensors take the Triton path: nothing executes
    try:
        with intercept(gate), _backend.use_backend("triton"):
            for name, mod in modules:
                if not jit_functions(mod):
                    continue
                driver = DRIVERS.get(name)
                if driver is None:
                    missing_drivers.append(name)
                    continue
                picks = autotune[name] = dict(getattr(mod, "AUTOTUNE", {}))
                driver(gate, mod)
                for op, n in picks.items():  # every GPU autotune candidate, through the same launchers
                    for i in range(1, n):
                        gate.prefix, gate.tuning = f"[{op} autotune #{i}] ", True
                        with _backend.autotune_pick(op, i):
                            driver(gate, mod)
                        gate.prefix, gate.tuning = "", False
    finally:
        _backend._check_triton = saved_check
    drive_s = time.perf_counter() - t0

    # which JIT functions were reached: launched, or called by a launched kernel
    launched = {f"{v['module']}:{v['kernel']}" for v in gate.variants.values()}
    reached = set(launched)
    uses_dot = {}
    for name, mod in modules:
        for fname, jf in jit_functions(mod).items():
            key = f"{mod.__name__}:{fname}"
            if key in launched:
                reached |= _called(jf)
                uses_dot[key] = _uses_dot(jf)
    unreached = [f"{mod.__name__}:{fname}" for name, mod in modules for fname in jit_functions(mod)
                 if f"{mod.__name__}:{fname}" not in reached]

    variants = list(gate.variants.values())
    work = [(v["module"], v["kernel"], v["signature"], v["constexprs"], v["attrs"], v["options"], arch)
            for v in variants for arch in TARGETS]
    jobs = jobs or int(os.environ.get("CUBOID_GATE_JOBS", 0)) or min(8, os.cpu_count() or 1)
    t1 = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_worker_init) as pool:
            results = list(pool.map(compile_one, work, chunksize=1))
    else:
        results = [compile_one(w) for w in work]
    compile_s = time.perf_counter() - t1
    for i, v in enumerate(variants):
        v["results"] = {str(r["arch"]): r for r in results[i * len(TARGETS):(i + 1) * len(TARGETS)]}
        v["uses_dot"] = uses_dot.get(f"{v['module']}:{v['kernel']}", False)
        v["constexprs"] = {str(k): _show(val) for k, val in v["constexprs"].items()}
        v["attrs"] = {str(k): val for k, val in v["attrs"].items()}
    import triton
    return dict(triton=triton.__version__, full=full, targets={str(a): s for a, s in TARGETS.items()},
                grid_max=GRID_MAX, regs_per_sm=REGS_PER_SM, jobs=jobs, drive_seconds=drive_s, compile_seconds=compile_s,
                compile_cpu_seconds=sum(r["seconds"] for r in results),
                modules=[name for name, _ in modules], autotune=autotune,
                missing_drivers=missing_drivers, unreached=unreached,
                driver_errors=gate.errors, launches=gate.launches, variants=variants)


# ----------------------------------------------------------------------------------------------- checks


def violations(result: dict) -> Dict[str, List[str]]:
    """check name -> list of failures (empty lists pass)."""
    out = {k: [] for k in ("coverage", "compile", "shared_memory", "registers", "tensor_cores", "spills", "grid")}
    for m in result["missing_drivers"]:
        out["coverage"].append(f"module cuboid.kernels.{m} has Triton kernels but no driver: add one to DRIVERS in "
                               f"tests/kernels/compile_gate.py that calls its launchers over every dtype and "
                               f"config-table row")
    for k in result["unreached"]:
        out["coverage"].append(f"kernel {k} was never launched by the compile gate's drivers: add a case that "
                               f"reaches it to its module's driver in tests/kernels/compile_gate.py")
    out["coverage"] += [f"driver failed: {e}" for e in result["driver_errors"]]
    for v in result["variants"]:
        what = f"{v['kernel']} [{v['cases'][0]}{' +%d more' % (len(v['cases']) - 1) if len(v['cases']) > 1 else ''}]" \
               f" warps={v['num_warps']} stages={v['num_stages']}"
        for arch, r in v["results"].items():
            tag = f"sm_{arch} {what}"
            if not r["ok"]:
                out["compile"].append(f"{tag}: {r['error']}")
                continue
            smem = r["shared"] + r["static_shared"]
            if smem > result["targets"][arch]:
                out["shared_memory"].append(f"{tag}: {smem} bytes of shared memory > {result['targets'][arch]}")
            if r["regs"] * 32 * v["num_warps"] > result["regs_per_sm"]:
                out["registers"].append(f"{tag}: {r['regs']} registers x {32 * v['num_warps']} threads "
                                        f"> {result['regs_per_sm']}")
            if v["half"] and v["uses_dot"] and not (r["mma_sync"] or r["wgmma"]):
                out["tensor_cores"].append(f"{tag}: half-precision tl.dot without mma.sync / wgmma in the PTX")
            if v["half"] and (r["stack"] or r["local"]):
                out["spills"].append(f"{tag}: {r['regs']} registers, spills to a {r['stack']}-byte stack")
    for launch in result["launches"]:
        grid = launch["grid"]
        if any(g > lim for g, lim in zip(grid, result["grid_max"])) or min(grid) < 0:
            out["grid"].append(f"{launch['kernel']} [{launch['case']}]: grid {tuple(grid)} exceeds CUDA's "
                               f"(2^31-1, 65535, 65535)")
    return out


# ----------------------------------------------------------------------------------------------- report


def _dtypes(v) -> str:
    """fp32 / fp16 / bf16 of a variant: its float pointer arguments and its *_DTYPE constexprs."""
    found = {t[1:] for t in v["signature"].values() if t in ("*fp16", "*bf16", "*fp32")}
    found |= {str(val) for k, val in v["shown"].items() if k.endswith("_DTYPE")}
    return "+".join(sorted(found)) or "-"


def table(result: dict) -> str:
    """Markdown: one row per (kernel, dtypes, BLOCK_* config, warps, stages), the worst over the flag variants
    (causal, mask, residual, ...) and cases folded into it; sm_80 and sm_90 side by side."""
    groups: dict = {}
    for v in result["variants"]:
        tuned = all(c.startswith("[") for c in v["cases"])
        cfg = ", ".join(f"{k}={val}" for k, val in v["shown"].items() if k.startswith("BLOCK"))
        key = (v["module"], v["kernel"], _dtypes(v), cfg, v["num_warps"], v["num_stages"], tuned)
        groups.setdefault(key, []).append(v)
    lines = ["| kernel | dtype | tiles | warps | stages | variants | sm_80 regs / stack B / smem KB / tensor cores "
             "| sm_90 regs / stack B / smem KB / tensor cores | e.g. case |",
             "| --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[6], k[2], k[3], k[4], k[5])):
        _, kernel, dtypes, cfg, warps, stages, tuned = key
        vs = groups[key]
        cells = []
        for arch in map(str, TARGETS):
            rs = [v["results"][arch] for v in vs]
            if not all(r["ok"] for r in rs):
                cells.append("FAILED")
                continue
            tc = {"wgmma" if r["wgmma"] else "mma.sync" if r["mma_sync"] else "-" for r in rs}
            cells.append(f"{max(r['regs'] for r in rs)} / {max(r['stack'] for r in rs)} / "
                         f"{max(r['shared'] + r['static_shared'] for r in rs) / 1024:.0f} / {'+'.join(sorted(tc))}")
        case = vs[0]["cases"][0]
        lines.append(f"| {kernel}{' (autotune)' if tuned else ''} | {dtypes} | {cfg} | {warps} | {stages} | "
                     f"{len(vs)} | {cells[0]} | {cells[1]} | {case} |")
    return "\n".join(lines)


def summary(result: dict) -> str:
    """The short form of :func:`table` (bench/RESULTS.md): attention per tile row (fp16 and bf16 folded into
    "half"), the other kernels one row each (the range over their configs), autotune entries one row per kernel.
    Launch configs only: the autotune rows are separate."""
    def cls(v):
        d = _dtypes(v).split("+")
        return "half" if any(t in ("fp16", "bf16") for t in d) else "fp32"

    def cell(rs, arch):
        rs = [r[arch] for r in rs]
        if not all(r["ok"] for r in rs):
            return "FAILED"
        regs = sorted({r["regs"] for r in rs})
        tc = {"wgmma" if r["wgmma"] else "mma.sync" if r["mma_sync"] else "-" for r in rs}
        smem = max(r["shared"] + r["static_shared"] for r in rs) / 1024
        reg = f"{regs[0]}-{regs[-1]}" if len(regs) > 1 else f"{regs[0]}"
        return f"{reg} / {max(r['stack'] for r in rs)} / {smem:.0f} / {'+'.join(sorted(tc))}"

    groups: dict = {}
    for v in result["variants"]:
        tuned = all(c.startswith("[") for c in v["cases"])
        if tuned:
            key = (v["kernel"], "autotune entries", "", "")
        elif v["uses_dot"]:
            cfg = "x".join(str(val) for k, val in v["shown"].items() if k in ("BLOCK_M", "BLOCK_N"))
            key = (v["kernel"], cls(v), f"d<={v['shown'].get('BLOCK_D')} {cfg}", f"{v['num_warps']}/{v['num_stages']}")
        else:
            key = (v["kernel"], cls(v), "", "")
        groups.setdefault(key, []).append(v)
    lines = ["| kernel | dtype | tiles | warps / stages | variants | sm_80 regs / stack B / smem KB / tensor cores "
             "| sm_90 regs / stack B / smem KB / tensor cores |", "| --- | --- | --- | --- | ---: | --- | --- |"]

    def order(k):
        d = k[2].split()[0][3:] if k[2] else "0"
        return (k[0], k[1] == "autotune entries", k[1], int(d) if d.isdigit() else 0)
    for key in sorted(groups, key=order):
        kernel, dtype, tiles, ws = key
        vs = groups[key]
        if not ws:
            ws = "/".join(sorted({f"{v['num_warps']}" for v in vs}, key=int)) + " warps"
        rs = [v["results"] for v in vs]
        lines.append(f"| {kernel} | {dtype} | {tiles or '-'} | {ws} | {len(vs)} | {cell(rs, '80')} | "
                     f"{cell(rs, '90')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown registers / spills / smem table (worst over each config's variants)")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count, at most 8)")
    ap.add_argument("--summary", action="store_true", help="print the short table of bench/RESULTS.md")
    ap.add_argument("--full", action="store_true", default=os.environ.get("CUBOID_GATE_FULL") == "1",
                    help="every dtype x flag x shape (default: the CI subset; env CUBOID_GATE_FULL=1)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    result = run_gate(args.jobs, args.full)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    bad = violations(result)
    n_compiles = len(result["variants"]) * len(TARGETS)
    print(f"compile gate: {len(result['variants'])} variants x {len(TARGETS)} targets = {n_compiles} compiles, "
          f"{len(result['launches'])} launches; drive {result['drive_seconds']:.1f} s, compile "
          f"{result['compile_seconds']:.1f} s wall ({result['compile_cpu_seconds']:.1f} s in workers, "
          f"{result['jobs']} jobs)")
    for check, items in bad.items():
        print(f"{check}: {'ok' if not items else f'{len(items)} FAILED'}")
        for item in items[:40]:
            print(f"  {item}")
    if args.table:
        print(table(result))
    if args.summary:
        print(summary(result))
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
