"""bench/gpu.py --dry-run walks the training, generation and main-command parts on the CPU.

The dry run builds tiny Llama-3.2-1B- and Qwen2.5-0.5B-shaped models (a step or two each), generates at batch 1
and 8, and runs the README's main command for 2 steps; every row of its tables must carry numbers where it ran
and a reason where it did not (the compiled path without its engine: "not built"; Liger's kernels on a CPU:
"skipped" with the error). The kernel parts' dry run (the Triton interpreter, ~1 minute) is not run here.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_models  # noqa: E402  (bench/ is not a package: its scripts import their siblings by name)

ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
ENV.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def dry_run(tmp_path: Path, *flags: str, timeout: int = 600):
    out = tmp_path / "gpu.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run", "--out", str(out), *flags],
                       capture_output=True, text=True, timeout=timeout, env=ENV, cwd=ROOT)
    return p, (json.loads(out.read_text()) if out.is_file() else None)


def number(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def table_rows(stdout: str, first_cells) -> list[list[str]]:
    """The cells of the printed markdown rows whose first cell is one of ``first_cells``, in printed order."""
    rows = [ln for ln in stdout.splitlines() if any(ln.startswith(f"| {c} |") for c in first_cells)]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in rows]


@pytest.fixture(scope="module")
def models_run(tmp_path_factory):
    p, result = dry_run(tmp_path_factory.mktemp("dry"), "--part", "train,generate,main,compiled")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout, result


def test_training_rows_have_numbers_or_a_reason(models_run):
    stdout, result = models_run
    spec = gpu_models.TRAIN["dry"]
    train = [r for r in result["models"] if r["part"] == "train"]
    expected = {(m, s, i) for m in spec["models"] for s in spec["seqs"] for i in gpu_models.IMPLS}
    assert {(r["model"], r["seq"], r["impl"]) for r in train} == expected and len(train) == len(expected)
    vocab = gpu_models.TINY["vocab_size"]
    for r in train:
        if r["impl"] in ("transformers", "cuboid eager"):
            assert r["status"] == "ran", r
        if r["status"] == "ran":
            assert number(r["ms"]) and number(r["tokens_s"]), r
            assert r["tokens_s"] == pytest.approx(r["seq"] * r["batch"] / (r["ms"] / 1e3))
            # random weights: the first loss is near ln(vocab) on both sides, so both trained the same task
            assert abs(r["loss"] - math.log(vocab)) < 0.5, r
            assert r["peak_gib"] is None  # not measured on a CPU, and not made up
        else:
            assert re.match(r"(not built|skipped): \S", r["status"]), r
    compiled = [r for r in train if r["impl"] == "cuboid compiled"]
    assert all(r["status"] == "ran" or r["status"].startswith(("not built", "skipped")) for r in compiled)
    # the printed table has every row, with its numbers or its reason
    printed = table_rows(stdout, spec["models"])
    printed_train = [c for c in printed if len(c) == 11]
    assert len(printed_train) == len(train)
    for cells, r in zip(printed_train, train):
        assert cells[2] == r["impl"] and cells[10] == r["status"]
        if r["status"] == "ran":
            assert float(cells[3]) > 0 and float(cells[4]) > 0 and float(cells[9]) > 0
    assert "peak memory is measured on CUDA only" in stdout


def test_generation_rows_and_the_main_command(models_run):
    stdout, result = models_run
    spec = gpu_models.GENERATE["dry"]
    gen = [r for r in result["models"] if r["part"] == "generate"]
    assert {(r["batch"], r["impl"]) for r in gen} == {(b, i) for b in spec["batches"] for i in ("transformers",
                                                                                                   "cuboid")}
    for r in gen:
        assert r["status"] == "ran" and number(r["ms"]), r
        assert r["tokens_s"] == pytest.approx(r["batch"] * spec["new"] / (r["ms"] / 1e3))
    printed = [c for c in table_rows(stdout, [spec["model"]]) if len(c) == 8]
    assert len(printed) == len(gen) and all(float(c[4]) > 0 for c in printed)
    main = result["main_command"]
    assert main["status"] == "ran" and main["returncode"] == 0, main
    assert main["plan_line"] == ("cuboid finetune: no GPU found: the default job runs plan dp=2 on 2 CPU processes "
                                 "(gloo)")
    assert main["metrics"]["step"] == 2 and 0.0 <= main["metrics"]["accuracy"] <= 1.0
    # the goal of the issue is not claimed from a CPU run
    assert all(g["met"] is None for g in result["goals"]), result["goals"]


def test_budget_skips_and_says_so(tmp_path):
    p, result = dry_run(tmp_path, "--part", "train,main", "--budget-s", "0", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = result["models"]
    assert rows and not any(r["status"] == "ran" for r in rows), rows
    always = [r for r in rows if r["impl"] in ("transformers", "cuboid eager")]  # the paths that always run
    assert len(always) == 8 and all(r["status"].startswith("skipped by the 0 s budget") for r in always), always
    assert result["main_command"]["status"].startswith("skipped by the 0 s budget")
    assert len(result["budget"]["skipped"]) == sum(r["status"].startswith("skipped by") for r in rows) + 1
    assert "SKIPPED train llama3.2-1b seq 64 transformers: skipped by the 0 s budget" in p.stdout
