"""One GPU call (at most 6 minutes): every cuboid kernel checked and timed, then whole training steps and generation
against transformers and Liger, and the README's main command on one GPU.

    python bench/gpu.py [--out bench/gpu.json]     # one GPU, within --budget-s (default 345 s)
    python bench/gpu.py --dry-run                  # CPU: the comparison plan, then the code paths at tiny sizes
    python bench/gpu.py --part train,generate      # some parts: checks, train, generate, main, compiled, timing, tune

The parts, in the order they run (the time budget skips what would pass it, and the report says what):

Part 1 (checks) prints PASS/FAIL per kernel check with the worst error as a
fraction of the tolerance (``max |got - ref| / (atol + rtol |ref|)``, PASS
when <= 1) and the absolute error; the script exits 1 if any check (or any
timing, or a cuboid training or generation row, or the main command) failed,
after running the other parts and printing the summary.
Parts 2 and 3 (train, generate; bench/gpu_models.py): Llama-3.2-1B- and
Qwen2.5-0.5B-shaped models (random weights, fp32 parameters, bf16 autocast,
sequence 2048 and 4096 at 8192 tokens a step) trained a few steps through
``cuboid.load`` + ``cuboid.train_step`` beside transformers (sdpa) and
transformers with Liger's patches: ms per step, tokens/s, peak memory; greedy
generation at batch 1 and 8 against transformers' ``generate``.
Part 4 (main; bench/gpu_readme.py): ``cuboid finetune`` as the README runs it,
on the first GPU only, with the line that says which plan it chose.
Part 5 (compiled): the training rows of cuboid under plan ``compile=true``
(after the others: compiling takes tens of seconds), in the same table.
Part 6 (timing; bench/gpu_kernels.py) times each kernel with ``triton.testing.do_bench`` (median of
runs, warmup=25 ms, rep=100 ms) side by side with its anchors on the same
inputs: attention against torch SDPA (flash backend) and FlashAttention 2 (if
``flash_attn`` imports); layer norm, RMS norm, RoPE, SwiGLU and the fused
linear cross-entropy against Liger-Kernel (if ``liger_kernel`` imports:
``pip install liger-kernel``) and torch (the cross-entropy's peak memory too);
AdamW against torch's fused AdamW. Each row gives TFLOP/s or GB/s, the
fraction of a ceiling measured in the same run (a ~1 GiB ``copy_`` and an
8192^3 bf16 matmul) and of the device's datasheet peak (PEAKS, by device
name). An anchor that is missing is skipped with its reason, printed. Byte
and FLOP counts are stated in NOTES and printed under the table.
Part 7 (tune; bench/gpu_tune.py) times every entry of every kernel's GPU autotune list (the
``AUTOTUNE`` of each kernels module, picked with
``cuboid.kernels._backend.autotune_pick``; the compile gate,
tests/kernels/test_compile_gate.py, has compiled each for sm_80 and sm_90)
and checks each entry's output against entry 0's.

``--dry-run`` first prints every comparison the GPU run would make (kernel,
size, dtype, model, each anchor and whether it is available), then sets
TRITON_INTERPRET=1 before cuboid.kernels is imported, uses CPU tensors, checks
fp32/fp16 only (the interpreter's bf16 arithmetic is wrong), times with
time.perf_counter and skips the anchors that need CUDA; the training and
generation parts run tiny models of the same families for a step or two with
cuboid's torch kernels (the CPU path), and a peer that cannot run on a CPU
(Liger) is reported as skipped with its error; the main command runs 2 steps
on the CPU. Its timings are meaningless and it measures no memory: it only
proves every branch runs.
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
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from gpu_checks import check_attention, check_lce, check_norms, check_optim, check_rope, check_swiglu  # noqa: E402
from gpu_common import (BF16, DRY_CFG, F16, F32, GPU, NOTES, Budget, Check, device_peaks, finite, fmt,  # noqa: E402
                        free, load_anchors, make_bench)
from gpu_kernels import (ceilings, evaluate_goals, time_attention, time_lce, time_norms, time_optim,  # noqa: E402
                         time_rope, time_swiglu)
from gpu_models import (EAGER, model_goals, plan_lines, print_models, run_generate, run_train,  # noqa: E402
                        table_order)
from gpu_readme import print_main_command, run_main_command  # noqa: E402
from gpu_report import header_line, print_plan, print_skipped, print_table, print_tune  # noqa: E402
from gpu_tune import tune_sweep  # noqa: E402

# in the order they run: what the issue asks first, the compiled steps (tens of seconds of compiling) after them
PARTS = ("checks", "train", "generate", "main", "compiled", "timing", "tune")
BUDGET_S = 345.0  # the call's 6 minutes, less start-up and the report
# the budget's estimate of the seconds each kernel part takes on one GPU
PART_GUESS_S = {"checks": 90.0, "timing": 60.0, "tune": 30.0}


def parts_of(spec: str) -> list:
    names = PARTS if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        raise SystemExit(f"bench/gpu.py: unknown part(s) {', '.join(unknown) or spec!r}; parts: all or a "
                         f"comma list of {', '.join(PARTS)}")
    return [p for p in PARTS if p in names]


def run_checks(checks: list, K, cfg, dev, dtypes, section_s: dict) -> None:
    sections = (("attention", lambda: check_attention(checks, K, cfg["attn_check"], dev, dtypes)),
                ("norms", lambda: check_norms(checks, K, cfg["norm_check"], dev, dtypes)),
                ("rope", lambda: check_rope(checks, K, cfg["rope_check"], dev, dtypes)),
                ("swiglu", lambda: check_swiglu(checks, K, cfg["swiglu_check"], dev, dtypes)),
                ("linear_cross_entropy", lambda: check_lce(checks, K, cfg["lce_check"], dev, dtypes)),
                ("optimizers", lambda: check_optim(checks, cfg["opt_check"], dev, dtypes)))
    for name, fn in sections:
        t0 = time.perf_counter()
        print(f"\n== check {name}", flush=True)
        try:
            fn()
        except Exception as e:  # a section that cannot even start is one FAIL
            traceback.print_exc()
            checks.append(Check(f"check {name}", False, math.inf, math.inf, "-", f"{type(e).__name__}: {e}"))
        free()
        section_s[f"check {name}"] = time.perf_counter() - t0


def run_timing(t: dict, K, cfg, dev, dry: bool, anchors: dict, peaks: tuple, tune: bool, timing: bool,
               section_s: dict) -> None:
    """Parts 6 and 7 (timing, tune) into ``t`` (rows, skipped, tune_rows, timing_errors, ceil)."""
    bench = make_bench(dry)
    if dry:
        flash_ctx = contextlib.nullcontext  # no sdpa flash backend on CPU
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        flash_ctx = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    rows, skipped, ceil = t["rows"], t["skipped"], t["ceil"]
    sections = []
    if timing:
        sections += [
            ("ceilings", lambda: ceil.update(ceilings(bench, cfg, dev))),
            ("attention", lambda: time_attention(rows, bench, K, cfg, dev, ceil, flash_ctx, anchors, skipped, peaks)),
            ("norms", lambda: time_norms(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
            ("rope", lambda: time_rope(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
            ("swiglu", lambda: time_swiglu(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
            ("linear_cross_entropy", lambda: time_lce(rows, bench, K, cfg, dev, ceil, anchors, skipped, peaks)),
            ("optimizers", lambda: time_optim(rows, bench, cfg, dev, ceil, peaks))]
    if tune:
        sections.append(("tune", lambda: tune_sweep(t["tune_rows"], t["timing_errors"], bench, K, cfg, dev)))
    for name, fn in sections:
        t0 = time.perf_counter()
        print(f"\n== time {name}", flush=True)
        try:
            fn()
        except Exception as e:  # report, keep going with the other sections
            traceback.print_exc()
            t["timing_errors"].append(f"time {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        free()
        section_s[f"time {name}"] = time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (kernels through the Triton interpreter)")
    ap.add_argument("--part", default="all", help=f"all, or a comma list of {', '.join(PARTS)} (for a quick rerun)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"seconds the parts may take; what would pass it is skipped and said so "
                         f"(default {BUDGET_S:g})")
    ap.add_argument("--out", default=None, help="JSON output (default bench/gpu.json; a temp file with --dry-run)")
    args = ap.parse_args(argv)
    parts = parts_of(args.part)
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device found. This benchmark needs a GPU; pass --dry-run to run the same "
              "code paths on CPU at tiny sizes.", file=sys.stderr)
        return 2
    budget = Budget(args.budget_s)
    dry = args.dry_run
    out_path = args.out or (os.path.join(tempfile.gettempdir(), "cuboid_gpu_dry_run.json") if dry else "bench/gpu.json")
    from cuboid import kernels as K  # after TRITON_INTERPRET was decided

    cfg, dev = (DRY_CFG, torch.device("cpu")) if dry else (GPU, torch.device("cuda"))
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
        torch.backends.cudnn.allow_tf32 = False
    header = header_line(dry)
    print(header, flush=True)
    anchors = load_anchors(dry)
    peaks = device_peaks(dry)
    lines = plan_lines(dry)
    plan = print_plan(anchors, peaks) + lines
    for line in lines:
        print(f"  - {line}")
    if dry:
        print("\n(dry run: the same code paths follow on CPU at tiny sizes; anchors that need CUDA are skipped)")
        print("note: bf16 checks skipped in --dry-run (the Triton interpreter's bf16 arithmetic is wrong)")
    dtypes = (F16, F32) if dry else (BF16, F16, F32)
    checks: list = []
    section_s: dict = {}
    t = dict(rows=[], skipped=[], tune_rows=[], timing_errors=[],
             ceil=dict(copy_GBps=math.nan, copy_bytes=4 * cfg["copy_numel"], matmul_bf16_TFLOPs=math.nan,
                       matmul_n=cfg["mm"]))
    model_rows: list = []
    main_row = None
    for part in parts:
        if part in PART_GUESS_S and not budget.allows(part, PART_GUESS_S[part]):
            print(f"\n== {part}: {budget.skipped[-1]}", flush=True)
            continue
        t0 = time.perf_counter()
        if part == "checks":
            run_checks(checks, K, cfg, dev, dtypes, section_s)
        elif part in ("timing", "tune"):
            run_timing(t, K, cfg, dev, dry, anchors, peaks, tune=part == "tune", timing=part == "timing",
                       section_s=section_s)
        elif part == "main":
            print("\n== the README's main command", flush=True)
            main_row = run_main_command(budget, dry)
            print(f"  {main_row['status']}: {main_row['plan_line']}", flush=True)
        elif part == "generate":
            print("\n== generate", flush=True)
            run_generate(model_rows, budget, dry, dev)
        else:
            print(f"\n== {part} training steps", flush=True)
            run_train(model_rows, budget, dry, dev, impls=EAGER if part == "train" else ("cuboid compiled",))
        section_s[part] = time.perf_counter() - t0
    model_rows = table_order(model_rows)
    goals = evaluate_goals(t["rows"], t["ceil"], cfg["goal_seq"]) if "timing" in parts else []
    goals += [dict(g, value=None, target=None) for g in model_goals(model_rows)]
    total_s = time.perf_counter() - budget.t0
    failures = report(header, dry, parts, checks, t, model_rows, main_row, goals, budget)
    print("\nseconds: " + ", ".join(f"{k} {v:.1f}" for k, v in section_s.items()) + f"; total {total_s:.1f}")

    result = dict(header=header, dry_run=dry, date=datetime.datetime.now().astimezone().isoformat(),
                  device=header.split(" | ")[2], torch=torch.__version__, triton=triton.__version__, parts=parts,
                  ceilings=t["ceil"], checks=[dataclasses.asdict(c) for c in checks],
                  rows=[dict(dataclasses.asdict(r), speedup=r.speedup, fraction_of_ceiling=r.fraction,
                             fraction_of_peak=r.of_peak) for r in t["rows"]],
                  peaks=dict(zip(("bf16_TFLOPs", "HBM_GBps"), peaks)), plan=plan,
                  anchors_skipped=list(dict.fromkeys(t["skipped"])),
                  anchors={n: dict(available=a.fn is not None, why=a.why, version=a.version)
                           for n, a in anchors.items()},
                  tune=[dataclasses.asdict(r) for r in t["tune_rows"]],
                  models=[dataclasses.asdict(r) for r in model_rows], main_command=main_row,
                  budget=dict(seconds=budget.seconds, skipped=budget.skipped),
                  goals=goals, timing_errors=t["timing_errors"], failures=failures, notes=NOTES,
                  seconds=dict(section_s, total=total_s))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(finite(result), f, indent=1)
    print(f"wrote {out_path}")
    return 1 if failures else 0


def report(header: str, dry: bool, parts: list, checks: list, t: dict, model_rows: list, main_row, goals: list,
           budget: Budget) -> list:
    """The tables and the summary; returns the failures (check FAILs, timing errors, cuboid rows that failed,
    the main command failing)."""
    if "timing" in parts:
        print_table(header, t["rows"], t["ceil"], dry)
        print_skipped(t["skipped"])
    print_tune(t["tune_rows"])
    print_models(model_rows, dry)
    if main_row is not None:
        print_main_command(main_row, dry)
    failed = [c for c in checks if not c.passed]
    failures = [f"FAIL {c.name}: {c.error or c.worst} (err/tol={c.ratio:.3g})" for c in failed]
    failures += [f"ERROR {e}" for e in t["timing_errors"]]
    failures += [f"FAILED {r.part} {r.model} {r.seq} x {r.batch} {r.impl}: {r.status}" for r in model_rows
                 if r.status.startswith("failed") and r.impl.startswith("cuboid")]
    if main_row is not None and main_row["status"].startswith("failed"):
        failures.append(f"FAILED the README's main command: {main_row['status']}")
    print(f"\n## Summary\n\nchecks: {len(checks) - len(failed)}/{len(checks)} PASS"
          + (f", {len(failed)} FAIL" if failed else ""))
    for line in failures:
        print(f"  {line}")
    for line in budget.skipped:
        print(f"  SKIPPED {line}")
    print("\ngoals" + (" -- dry run: meaningless" if dry else "") + ":")
    for g in goals:
        target = "" if g["target"] is None else f" (value {fmt(g['value'], 2)}, target {g['target']:g})"
        met = "UNMEASURED" if g["met"] is None else "MET" if g["met"] else "NOT MET"
        print(f"  {met:<10} {g['goal']}{target}: {g['note']}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
