"""The large-batch recipe in `cuboid finetune` / `cuboid.finetune`: lr scaling, warmup, polynomial decay.

The formulas (cuboid/train/schedule.py) against their definitions, the schedule a
``LambdaLR`` then applies to a real optimizer, the Python API's LARS run with
linear scaling, bad values as one-line errors, and the embedded default job
under ``--optimizer lamb --lr-scaling sqrt`` for a few steps.
"""
from __future__ import annotations

import math

import pytest
import torch

import cuboid
from cuboid.cli import main
from cuboid.train.schedule import lr_lambda, scaled_lr, warmup_steps

from . import fixtures as F
from .test_finetune import cli, metrics


def test_lr_scaling_is_the_formula():
    assert scaled_lr(1e-3, 4096, 256, "none") == 1e-3
    assert scaled_lr(1e-3, 4096, 256, "linear") == pytest.approx(1e-3 * 16)
    assert scaled_lr(1e-3, 4096, 256, "sqrt") == pytest.approx(1e-3 * 4)
    assert scaled_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.05)  # a smaller batch scales down
    with pytest.raises(ValueError, match="unknown lr scaling 'cubic'"):
        scaled_lr(1e-3, 64, 256, "cubic")
    with pytest.raises(ValueError, match="reference-batch"):
        scaled_lr(1e-3, 64, 0, "linear")


def test_warmup_and_poly_decay_are_the_formula():
    assert warmup_steps(0.1, 50) == 5 and warmup_steps(7, 50) == 7 and warmup_steps(0, 3) == 0
    # a fraction rounds up, as the HF Trainer's warmup_ratio: warmup asked for is at least one step
    assert warmup_steps(0.25, 10) == 3 and warmup_steps(0.1, 3) == 1 and warmup_steps(0.1, 30) == 3
    total, warm, power = 20, 5, 2.0
    f = lr_lambda("poly", warm, total, power)
    for t in range(total):
        want = (t + 1) / warm if t < warm else (1 - (t - warm) / (total - warm)) ** power
        assert f(t) == pytest.approx(want), t
    assert f(warm) == 1.0 and f(total) == 0.0
    # power 1 is the linear schedule; cosine and constant keep their shapes
    lin, poly1 = lr_lambda("linear", warm, total), lr_lambda("poly", warm, total, 1.0)
    assert all(lin(t) == pytest.approx(poly1(t)) for t in range(total + 1))
    assert lr_lambda("cosine", 0, 10)(5) == pytest.approx(0.5) and lr_lambda("constant", 2, 10)(9) == 1.0
    with pytest.raises(ValueError, match="decay-power"):
        lr_lambda("poly", 0, 10, 0.0)
    # what LambdaLR applies to an optimizer, step by step: the scaled peak times f
    peak = scaled_lr(1e-2, 1024, 256, "sqrt")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
    seen = []
    for _ in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2e-2 * f(t) for t in range(total)])


def test_python_finetune_lars_with_linear_scaling(tmp_path, capsys):
    from cuboid.kernels import use_backend

    out, images = tmp_path / "lars", F.image_folder(tmp_path / "img")  # 24 images: quick to prepare
    with use_backend("torch"):  # not the Triton interpreter this test process switches on (tests/conftest.py)
        cuboid.finetune("vit-debug", str(images), optimizer="lars", lr=0.5, lr_scaling="linear", reference_batch=8,
                        batch_size=16, eval_fraction=0.25, steps=4, warmup=0.5, schedule="poly", decay_power=2.0, log_every=1,
                        eval_every=4, output_dir=str(out), progress=False, plot=False)
    assert "lars at peak lr 1 (linear scaling of 0.5 at batch 8), 2 warmup steps, poly decay" \
        in capsys.readouterr().err
    # a row's lr is the one set for the next step (after scheduler.step()): peak * f(step)
    f = lr_lambda("poly", 2, 4, 2.0)
    assert [r["lr"] for r in metrics(out)] == pytest.approx([1.0 * f(s) for s in range(1, 5)])
    assert all(math.isfinite(r["loss"]) for r in metrics(out))


@pytest.mark.parametrize("flag,value,message", [
    ("--lr-scaling", "cubic", "unknown lr scaling 'cubic'"),
    ("--schedule", "step", "unknown schedule 'step'"),
    ("--decay-power", "-1", "--decay-power -1.0"),
])
def test_bad_recipe_values_are_one_line_and_exit_2(flag, value, message, capsys, tmp_path):
    rc = main(["finetune", "--model", "vit-debug", "--data", "digits", flag, value, "--output-dir", str(tmp_path),
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and message in err[0], err


def test_cli_default_job_with_lamb_and_sqrt_scaling(tmp_path):
    """`cuboid finetune --optimizer lamb --lr-scaling sqrt`: the embedded default job (dp=2, batch 64, lr 1e-2)."""
    out = tmp_path / "lamb"
    rc, _, err = cli("finetune", "--optimizer", "lamb", "--lr-scaling", "sqrt", "--reference-batch", "16",
                     "--schedule", "poly", "--decay-power", "2", "--warmup", "0.5", "--steps", "4", "--log-every", "1",
                     "--eval-every", "4", "--output-dir", str(out), "--no-progress", "--no-plot")
    assert rc == 0, err
    assert "lamb at peak lr 0.02 (sqrt scaling of 0.01 at batch 16)" in err, err  # 1e-2 * sqrt(64 / 16)
    rows = metrics(out)
    f = lr_lambda("poly", 2, 4, 2.0)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == pytest.approx([0.02 * f(s) for s in range(1, 5)])
    assert "accuracy" in rows[-1]
