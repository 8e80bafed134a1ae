"""The README's main command (`cuboid finetune`, the embedded default job) on the devices present.

The device count is simulated in the process that chooses the plan (torch.cuda.is_available and
device_count monkeypatched); nothing is launched on CUDA: the launcher and the trainer are replaced by
recorders, and the one-GPU choice then runs for real on the CPU in this process.
"""
from __future__ import annotations

import sys

import pytest
import torch

import cuboid.train.loop
from cuboid import kernels
from cuboid.cli import finetune as finetune_cli
from cuboid.cli import main
from cuboid.train.config import FinetuneConfig
from cuboid.parallel import Plan


def choose(monkeypatch, capsys, gpus: int, *flags: str, env: dict | None = None):
    """Run `cuboid finetune [flags]` with ``gpus`` simulated CUDA devices; returns (what was started, the
    door's stderr lines). What was started: ("launch", nproc, argv) or ("run", FinetuneConfig)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    started = []
    monkeypatch.setattr(finetune_cli, "_launch",
                        lambda nproc, argv, restarts=0, module="cuboid": started.append(("launch", nproc, argv)) or 0)
    monkeypatch.setattr(cuboid.train.loop, "run", lambda cfg: started.append(("run", cfg)))
    argv = ["finetune", *flags]
    monkeypatch.setattr(sys, "argv", ["cuboid", *argv])
    assert main(argv) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("cuboid finetune:")]
    assert len(started) == 1, started
    return started[0], lines


def flag(argv: list, name: str) -> str:
    """The value of the last ``name VALUE`` in argv."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


@pytest.mark.parametrize("gpus,nproc,line", [
    (0, 2, "no GPU found: the default job runs plan dp=2 on 2 CPU processes (gloo)"),
    (2, 2, "2 GPUs found: the default job runs plan dp=2 on 2 processes, one per GPU (nccl)"),
    (8, 8, "8 GPUs found: the default job runs plan dp=8 on 8 processes, one per GPU (nccl)"),
])
def test_several_processes_one_per_gpu_or_two_on_cpu(monkeypatch, capsys, gpus, nproc, line):
    started, lines = choose(monkeypatch, capsys, gpus, "--no-progress")
    kind, n, argv = started
    assert kind == "launch" and n == nproc
    assert lines == [f"cuboid finetune: {line}"]
    # the workers are told the plan (they must not choose again), and the default batch divides
    assert flag(argv, "--plan") == f"dp={nproc}" and "--batch-size" not in argv
    assert argv[0] == "finetune" and "--model" not in argv


def test_one_gpu_is_a_single_process(monkeypatch, capsys):
    (kind, cfg), lines = choose(monkeypatch, capsys, 1, "--no-progress")
    assert kind == "run" and isinstance(cfg, FinetuneConfig)
    assert cfg.plan == Plan() and cfg.plan.world_size == 1
    assert (cfg.model, cfg.data, cfg.steps, cfg.batch_size) == ("vit-debug", "digits", 400, 64)
    assert lines == ["cuboid finetune: 1 GPU found: the default job runs plan dp=1 on a single process on cuda:0"]


def test_gpu_count_that_does_not_divide_the_batch_rounds_it_up(monkeypatch, capsys):
    (kind, n, argv), lines = choose(monkeypatch, capsys, 3, "--no-progress")
    assert kind == "launch" and n == 3
    assert flag(argv, "--plan") == "dp=3" and flag(argv, "--batch-size") == "66"
    assert lines[0].endswith("; global batch 66 (64 rounded up to a multiple of 3)")


def test_a_given_plan_or_process_count_wins(monkeypatch, capsys):
    (kind, n, argv), lines = choose(monkeypatch, capsys, 8, "--plan", "dp=2", "--no-progress")
    assert (kind, n, lines) == ("launch", 2, [])  # the user's plan: no device line
    (kind, n, argv), lines = choose(monkeypatch, capsys, 8, "--nproc-per-node", "4", "--no-progress")
    assert (kind, n) == ("launch", 4) and flag(argv, "--plan") == "dp=4" and "--nproc-per-node" not in argv
    assert lines == ["cuboid finetune: --nproc-per-node 4: the default job runs plan dp=4 on 4 processes, "
                     "one per GPU (nccl)"]
    # a hand-started torchrun of 4: every rank runs dp=4 (rank 0 says so)
    (kind, cfg), lines = choose(monkeypatch, capsys, 0, "--no-progress", env=dict(WORLD_SIZE="4", RANK="0"))
    assert kind == "run" and cfg.plan == Plan(dp=4)
    assert lines == ["cuboid finetune: 4 process(es) under the launcher: the default job runs plan dp=4 on 4 CPU "
                     "processes (gloo)"]


def test_one_gpu_choice_runs_the_default_job(monkeypatch, capsys, tmp_path):
    """The single-process default job the one-GPU machine gets, run here on the CPU for a few steps."""
    (_, cfg), _ = choose(monkeypatch, capsys, 1, "--no-progress", "--no-plot", "--steps", "3", "--eval-every", "3",
                         "--output-dir", str(tmp_path / "run"))
    monkeypatch.undo()  # the real CUDA probes and trainer: this machine's CPU
    with kernels.use_backend("torch"):  # a user's CPU kernels (this test process runs the Triton interpreter)
        result = cuboid.train.loop.run(cfg)
    assert result["step"] == 3 and 0.0 <= result["accuracy"] <= 1.0
    assert (tmp_path / "run" / "final" / "config.json").is_file()
