"""bench/gpu.py part 6: the README's main command, ``cuboid finetune`` (the embedded default job), on one GPU.

It runs as a user runs it, in a fresh process (``python -m cuboid finetune``), with only the first GPU visible
(``CUDA_VISIBLE_DEVICES``), into a temporary output folder. The row keeps the line in which the command says
which plan it chose for the devices, the exit code, the wall time and the last metrics line. The dry run runs
the same command on the CPU for 2 steps (there the default plan is 2 CPU processes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from gpu_common import fmt, markdown

FIRST_GUESS_S = 90.0  # the default job on one GPU (400 steps of vit-debug, 4 evaluations), with start-up
DRY_FLAGS = ["--steps", "2", "--eval-every", "2", "--no-plot"]


def command(dry: bool, out: Path) -> list:
    return [sys.executable, "-m", "cuboid", "finetune", "--output-dir", str(out), "--no-progress",
            *(DRY_FLAGS if dry else [])]


def one_gpu_env(dry: bool) -> dict:
    """The environment: the first GPU only (the README's one-GPU case), cuboid's kernels as a user gets them
    (no Triton interpreter: the dry run's kernel parts set TRITON_INTERPRET for this process only)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not dry:
        visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def run_main_command(budget, dry: bool) -> dict:
    """One row: ``status`` ran | failed: why | skipped: why, with ``seconds``, ``plan_line``, ``metrics``."""
    row = dict(command="cuboid finetune" + (" " + " ".join(DRY_FLAGS) if dry else ""), status="ran", seconds=None,
               plan_line=None, metrics=None, returncode=None)
    if not budget.allows("README main command", FIRST_GUESS_S):
        row["status"] = budget.skipped[-1].split(": ", 1)[1]
        return row
    with tempfile.TemporaryDirectory(prefix="cuboid_main_cmd_") as tmp:
        out = Path(tmp) / "run"
        t0 = time.perf_counter()
        try:
            p = subprocess.run(command(dry, out), capture_output=True, text=True, env=one_gpu_env(dry),
                               timeout=max(10.0, budget.left()))
        except subprocess.TimeoutExpired:
            row.update(status=f"failed: still running after {time.perf_counter() - t0:.0f} s (the budget's end)",
                       seconds=time.perf_counter() - t0)
            return row
        row["seconds"] = time.perf_counter() - t0
        row["returncode"] = p.returncode
        row["plan_line"] = next((ln for ln in p.stderr.splitlines() if ln.startswith("cuboid finetune:")), None)
        row["metrics"] = last_metrics(out)
        if p.returncode != 0:
            tail = " | ".join(p.stderr.strip().splitlines()[-3:])
            row["status"] = f"failed: exit {p.returncode}: {tail[:400]}"
        elif row["metrics"] is None:
            row["status"] = "failed: exit 0 but no metrics.jsonl was written"
    return row


def last_metrics(out: Path) -> Optional[dict]:
    """The last line of the run's metrics.jsonl that has an accuracy (an evaluation), else the last line."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return None
    lines = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    evals = [ln for ln in lines if "accuracy" in ln]
    return (evals or lines or [None])[-1]


def print_main_command(row: dict, dry: bool) -> None:
    print("\nthe README's main command on one GPU" + (" (dry run: on the CPU, 2 steps)" if dry else "") + ":\n")
    m = row["metrics"] or {}
    line = (row["plan_line"] or "-").removeprefix("cuboid finetune: ")
    markdown("command | status | seconds: | chosen plan | step: | loss: | accuracy:",
             [[row["command"], row["status"], fmt(row["seconds"]), line, m.get("step", "-"),
               fmt(m.get("loss", m.get("eval_loss")), 3), fmt(m.get("accuracy"), 3)]])
