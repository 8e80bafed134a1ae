"""The compile gate for cuboid.kernels.grouped_gemm: every launch its launchers can make, compiled for sm_80 and
sm_90 on this CPU machine, with tensor cores in half precision, no spills, shared memory within the target.

The machinery is tests/kernels/compile_gate.py's (launches recorded on meta tensors, ``triton.compile`` for
``GPUTarget("cuda", 80 | 90, 32)``, cuobjdump's resource usage, the same checks), run here over this module
alone by a subprocess (the test process has ``TRITON_INTERPRET=1``, whose kernels cannot be compiled)::

    python tests/kernels/test_grouped_gemm_gate.py [--json out.json] [--full] [--jobs N]

:func:`drive_grouped_gemm` is the module's driver (``DRIVERS["grouped_gemm"]`` of compile_gate_drivers.py calls it).
Launch configurations depend on the config row (half with 16-multiple strides, half without, fp32) and the
autotune entry; the shapes select the rows and add the specializations Triton makes (one group). CI: every entry
of every row (bf16 on an aligned MoE shape and an unaligned one, fp32), fp16 on entry 0, bf16 on one group;
``--full`` (CUBOID_GATE_FULL=1): every dtype x shape x entry, and a shape aligned in K but not N.
"""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# (M rows, G groups, K, N): a Qwen3-30B-A3B expert layer's gate_up on 4096 routed rows; an unaligned shape
# (odd sizes: no 16-divisibility); one group (G = 1 is specialized as a constant)
ALIGNED, UNALIGNED, ONE_GROUP = (4096, 64, 2048, 1536), (1000, 7, 200, 333), (512, 1, 768, 2048)
HALF_ALIGNED = (1000, 7, 2048, 333)


def drive_grouped_gemm(gate, mod) -> None:
    """Forward, dx and dw of ``mod.grouped_mm`` on meta tensors over the dtypes and shapes above."""
    import torch

    F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
    if gate.full:
        cases = [(dt, s) for dt in (BF16, F16, F32) for s in (ALIGNED, UNALIGNED, ONE_GROUP, HALF_ALIGNED)]
    elif gate.tuning:  # autotune entries 1..: one dtype per config row
        cases = [(BF16, ALIGNED), (BF16, UNALIGNED), (F32, ALIGNED)]
    else:
        cases = [(BF16, ALIGNED), (F32, ALIGNED), (F16, ALIGNED), (BF16, UNALIGNED), (BF16, ONE_GROUP)]
    for dtype, (m, g, k, n) in cases:
        with gate.case(f"grouped_mm {str(dtype)[6:]} M{m} G{g} K{k} N{n}"):
            x = torch.empty(m, k, dtype=dtype, device="meta", requires_grad=True)
            w = torch.empty(g, n, k, dtype=dtype, device="meta", requires_grad=True)
            counts = torch.empty(g, dtype=torch.int64, device="meta")
            y = mod.grouped_mm(x, w, counts)
            torch.autograd.backward(y, torch.empty_like(y))


def run(jobs=None, full=False) -> dict:
    """compile_gate.run_gate over this module alone."""
    from tests.kernels import compile_gate as G

    return G.run_gate(jobs, full, only=["grouped_gemm"])


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the full result here")
    ap.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count, at most 8)")
    ap.add_argument("--full", action="store_true", default=os.environ.get("CUBOID_GATE_FULL") == "1")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"
    if ROOT not in sys.path:
        sys.path.append(ROOT)  # tests.kernels.compile_gate; appended so that the root's kernels/ shadows nothing
    from tests.kernels import compile_gate as G

    result = run(args.jobs, args.full)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    bad = G.violations(result)
    print(f"grouped_gemm gate: {len(result['variants'])} variants x {len(G.TARGETS)} targets; compile "
          f"{result['compile_seconds']:.1f} s wall")
    for check, items in bad.items():
        print(f"{check}: {'ok' if not items else f'{len(items)} FAILED'}")
        for item in items[:40]:
            print(f"  {item}")
    print(G.table(result))
    return 1 if any(bad.values()) else 0


# ----------------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    """This file run as a script (compiling needs TRITON_INTERPRET=0), its JSON read back with the checks."""
    from tests.kernels import compile_gate as G
    from tests.kernels.test_compile_gate import _toolchain_missing

    if _toolchain_missing():
        pytest.skip(_toolchain_missing())
    out = tmp_path_factory.mktemp("grouped_gemm_gate") / "gate.json"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--json", str(out)], capture_output=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, text=True, timeout=1800)
    assert out.exists(), f"the gate did not run (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    return dict(result, violations=G.violations(result))


@pytest.mark.parametrize("check", ["coverage", "compile", "shared_memory", "registers", "tensor_cores", "spills",
                                   "grid"])
def test_gate_check(gate, check):
    bad = gate["violations"][check]
    assert not bad, f"{len(bad)} {check} failure(s):\n  " + "\n  ".join(bad)


def test_every_config_and_kernel_was_compiled(gate):
    """Both kernels (forward and dx share one), every entry of every config row, both targets; the
    half-precision ones on tensor cores (mma.sync on sm_80, wgmma on sm_90 where the tile has 64 rows)."""
    from cuboid.kernels import grouped_gemm as GG

    seen = set()
    for v in gate["variants"]:
        cfg = (v["shown"]["BLOCK_M"], v["shown"]["BLOCK_N"], v["shown"]["BLOCK_K"], v["num_warps"], v["num_stages"])
        seen.add((v["kernel"], cfg))
        assert set(v["results"]) == {"80", "90"}
        if v["half"]:
            sm80, sm90 = v["results"]["80"], v["results"]["90"]
            assert v["uses_dot"] and sm80["mma_sync"] and (sm90["wgmma"] or sm90["mma_sync"]), v["cases"]
            # wgmma takes tiles of 64 rows and more (a warp group's instruction); smaller ones run mma.sync
            assert sm90["wgmma"] or v["shown"]["BLOCK_M"] < 64, v["cases"]
    want = {(kernel, cfg) for kernel, table in (("_gmm_kernel", GG._MM_CFG), ("_gmm_dw_kernel", GG._DW_CFG))
            for cfgs in table.values() for cfg in cfgs}
    assert max(len(cfgs) for cfgs in GG._DW_CFG.values()) == GG.AUTOTUNE["grouped_mm"]
    assert want <= seen, sorted(want - seen)
    dtypes = {v["signature"]["A"] for v in gate["variants"] if v["kernel"] == "_gmm_kernel"}
    assert dtypes == {"*bf16", "*fp16", "*fp32"}


if __name__ == "__main__":
    sys.exit(main())
