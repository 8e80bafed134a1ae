"""The compile gate: every Triton kernel of cuboid.kernels, as its launcher picks it, compiled for sm_80 and sm_90.

Run by ``tests/kernels/test_compile_gate.py`` in a subprocess (the test process
has ``TRITON_INTERPRET=1``, under which ``@triton.jit`` makes interpreter
objects that cannot be compiled), or by hand::

    python tests/kernels/compile_gate.py [--json out.json] [--table | --summary] [--full] [--jobs N] [--only MOD..]

How it works:

1. ``JITFunction.run`` (what ``kernel[grid](...)`` calls) and
   ``Autotuner.run`` are replaced by a recorder: a launch binds its arguments
   with Triton's own binder (the same specialization a real launch makes:
   pointer dtypes, ints equal to 1 made constexpr, 16-divisibility
   attributes) and records (kernel, signature, constexprs, attributes,
   num_warps, num_stages, grid) instead of running. An autotuned kernel
   records one launch per config in its list.
2. A *driver* per kernel module (tests/kernels/compile_gate_drivers.py)
   calls the module's public functions (forward and backward through
   autograd) on ``meta`` tensors, with the Triton backend forced, over the
   dtypes and shapes that select every row of the launcher's config table, every entry of the module's GPU autotune list
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
from typing import Dict, List, Optional

try:  # run as a script, tests/kernels is on sys.path; imported, the package path holds
    import compile_gate_drivers as drivers
except ImportError:
    from tests.kernels import compile_gate_drivers as drivers
DRIVERS, DRIVEN_BY = drivers.DRIVERS, drivers.DRIVEN_BY  # the drivers' own dicts: an entry added here counts there
_torch_names = drivers._torch_names

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


@contextlib.contextmanager
def real_custom_ops(modules):
    """Run the torch custom ops defined in ``modules`` (the kernel files' ``cuboid::*``) on meta tensors
    through their real implementations, which launch the kernels (recorded by :func:`intercept`), instead of
    their fake ones, which only give shapes (torch makes the fake implementation the meta device's kernel)."""
    from torch._library.custom_ops import CustomOpDef

    ops = {id(o): o for _, mod in modules for o in vars(mod).values() if isinstance(o, CustomOpDef)}.values()
    saved = [(op, op._abstract_fn) for op in ops]
    for op in ops:
        op._abstract_fn = op._init_fn
    try:
        yield
    finally:
        for op, fn in saved:
            op._abstract_fn = fn


def run_gate(jobs: Optional[int] = None, full: bool = False, only: Optional[List[str]] = None) -> dict:
    """Drive every module (``only``: the drivers of these modules), compile every variant for every target; the
    JSON-ready result."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("the compile gate needs TRITON_INTERPRET unset or 0 (it compiles, it does not interpret)")
    import multiprocessing

    _torch_names()
    from cuboid.kernels import _backend

    t0 = time.perf_counter()
    modules = kernel_modules()  # every module: each defines its own cuboid:: ops
    if only:
        keep = set(only) | {m for m, by in DRIVEN_BY.items() if by in only}
        modules = [(name, mod) for name, mod in modules if name in keep]
    gate = Gate(full)
    autotune = {}
    missing_drivers = [name for name, mod in modules
                       if jit_functions(mod) and name not in DRIVERS and name not in DRIVEN_BY]
    saved_check = _backend._check_triton
    _backend._check_triton = lambda op, device: "triton"  # meta tensors take the Triton path: nothing executes
    try:
        with intercept(gate), _backend.use_backend("triton"), real_custom_ops(kernel_modules()):
            for name, mod in modules:
                driver = DRIVERS.get(name)
                if driver is None:
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
                               f"tests/kernels/compile_gate_drivers.py that calls its launchers over every dtype and "
                               f"config-table row")
    for k in result["unreached"]:
        out["coverage"].append(f"kernel {k} was never launched by the compile gate's drivers: add a case that "
                               f"reaches it to its module's driver in tests/kernels/compile_gate_drivers.py")
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
    ap.add_argument("--only", nargs="+", metavar="MODULE",
                    help="drive these modules of cuboid.kernels only (e.g. flash_attention), and the modules whose "
                         "kernels they launch")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    result = run_gate(args.jobs, args.full, args.only)
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
