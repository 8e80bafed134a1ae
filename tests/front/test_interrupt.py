"""Ctrl-C and ``--resume`` with other settings (issue 51): the first SIGINT finishes the step, saves it and
exits 130 with one line naming the checkpoint and the command that resumes; a second aborts at once; under
dp=2 every rank stops after the same step, whether the signal reached one worker or the launcher (a
terminal's Ctrl-C), with no traceback; a resume names the settings that changed in one line, runs the new
lr schedule, and refuses an optimizer that cannot change.

The signals are sent by a callback at a chosen step (interrupt_job.py), so every run is deterministic."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cuboid.cli import main
from cuboid.train.resume import complete
from cuboid.train.schedule import lr_lambda, warmup_steps

from . import fixtures as F
from .interrupt_job import SigintCallback
from .test_finetune import ENV, metrics

ROOT = Path(__file__).resolve().parents[2]  # where `python -m tests.front.interrupt_job` finds the tests package


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The flags of a tiny causal-LM run (a 2-layer Qwen2 on 60 sentences), less --output-dir and --steps."""
    root = tmp_path_factory.mktemp("interrupt")
    model = F.hf_qwen2_folder(root / "model")
    (root / "data.txt").write_text("\n".join(t for t, _ in F.sentences(60)) + "\n")
    return ["--model", str(model), "--data", str(root / "data.txt"), "--task", "causal", "--seq-len", "32",
            "--batch-size", "8", "--log-every", "1", "--eval-every", "100", "--no-progress", "--no-plot"]


def lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_ctrl_c_saves_the_step_then_a_resume_says_what_changed(job, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["finetune", *job, "--steps", "12", "--output-dir", str(out)]
    rc = main(argv, callbacks=[SigintCallback("0:3")])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err, err
    assert lines(err)[-1] == (f"cuboid finetune: interrupted after step 3 of 12: saved {out / 'checkpoint-3'}; "
                              f"resume with: cuboid {shlex.join(argv)} --resume latest"), err
    assert complete(out / "checkpoint-3") and not (out / "final").exists()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3]

    # an optimizer cannot change on resume: one line, exit 2, nothing trained
    rc = main([*argv, "--optimizer", "lamb", "--resume", "latest"])
    err = capsys.readouterr().err
    assert rc == 2 and len(lines(err)) == 1 and "Traceback" not in err, err
    assert "optimizer adamw there, lamb here" in err and "keeps its optimizer" in err, err

    # steps and lr may change: one line lists them, and the run follows the new schedule from step 4
    rc = main([*argv, "--steps", "5", "--lr", "2e-3", "--resume", "latest"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert [line for line in lines(err) if "settings changed" in line] == [
        f"resuming {out / 'checkpoint-3'} with settings changed from its run: steps 12 -> 5, lr 0.001 -> 0.002"], err
    f = lr_lambda("cosine", warmup_steps(0.1, 5), 5)
    rows = metrics(out)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]
    assert [m["lr"] for m in rows[3:]] == pytest.approx([2e-3 * f(4), 2e-3 * f(5)])  # (the lr of the next step)
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["state"]["run"]["lr"] == 2e-3


def test_a_second_ctrl_c_aborts_at_once(job, tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["finetune", *job, "--steps", "12", "--output-dir", str(out)], callbacks=[SigintCallback("0:2:twice")])
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err, err
    assert lines(err)[-1].startswith("cuboid finetune: interrupted at once, without saving: --resume latest"), err
    assert not list(out.glob("checkpoint-*")) and not list(out.glob(".checkpoint-*"))


def run_job(args: list, env: dict, timeout: float = 240) -> tuple[int, str]:
    """``python -m tests.front.interrupt_job finetune ARGS`` in a session of its own; (exit code, stderr).
    A run that does not end within ``timeout`` is killed and fails the test."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    p = subprocess.Popen([sys.executable, "-m", "tests.front.interrupt_job", "finetune", *args],
                         env={**ENV, **env, "PYTHONPATH": path}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        pytest.fail(f"the interrupted run did not end within {timeout:.0f} s (a rank that did not stop?):\n"
                    f"{err[-3000:]}")
    return p.returncode, err


def test_dp2_ranks_stop_after_the_same_step_without_a_traceback(job, tmp_path):
    out, log = tmp_path / "run", tmp_path / "steps"
    args = [*job, "--steps", "40", "--plan", "dp=2", "--output-dir", str(out)]
    # the signal reaches rank 1 alone: rank 0 learns of it through the step's stop flag
    rc, err = run_job(args, {"CUBOID_SIGINT": "1:2", "CUBOID_SIGINT_LOG": str(log)})
    assert rc == 130 and "Traceback" not in err, err
    assert [(log / f"rank{r}").read_text() for r in (0, 1)] == ["2", "2"], err
    assert [line for line in lines(err) if "interrupted" in line] == [
        f"cuboid finetune: interrupted after step 2 of 40: saved {out / 'checkpoint-2'}; resume with: "
        f"python -m tests.front.interrupt_job {shlex.join(['finetune', *args])} --resume latest"], err
    assert complete(out / "checkpoint-2")

    # resumed, then a terminal's Ctrl-C: the launcher gets it and passes it on; both ranks stop together
    rc, err = run_job([*args, "--resume", "latest"], {"CUBOID_SIGINT": "0:4:agent", "CUBOID_SIGINT_LOG": str(log)})
    assert rc == 130 and "Traceback" not in err, err
    stopped = {(log / f"rank{r}").read_text() for r in (0, 1)}
    assert len(stopped) == 1 and int(next(iter(stopped))) >= 4, (stopped, err)
    step = int(stopped.pop())
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in err, err
    assert [line for line in lines(err) if "interrupted" in line][0].startswith(
        f"cuboid finetune: interrupted after step {step} of 40: saved {out / f'checkpoint-{step}'}"), err
    assert complete(out / f"checkpoint-{step}") and not (out / "final").exists()


def test_sigterm_says_so_names_the_checkpoint_and_exits_143(job, tmp_path):
    """Issue 65, item 5.6: SIGTERM stops the run at once (no save of its own) with one line naming the newest
    complete checkpoint and the command that resumes, exit code 143 (128 + 15): one process, and dp=2 with
    the signal sent to the launcher's agent, as a scheduler stops a job."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    for plan, who in (("dp=1", "term"), ("dp=2", "agent-term")):
        out = tmp_path / plan
        argv = ["finetune", *job, "--steps", "12", "--save-every", "2", "--plan", plan, "--output-dir", str(out)]
        p = subprocess.run([sys.executable, "-m", "tests.front.interrupt_job", *argv], capture_output=True,
                           text=True, timeout=300, env={**ENV, "CUBOID_SIGINT": f"0:3:{who}", "PYTHONPATH": path})
        assert p.returncode == 143 and "Traceback" not in p.stderr, (plan, p.returncode, p.stderr[-3000:])
        assert lines(p.stderr)[-1] == (
            f"cuboid finetune: stopped by SIGTERM, checkpoint {out / 'checkpoint-2'} is the newest complete one; "
            f"resume with: python -m tests.front.interrupt_job {shlex.join(argv)} --resume latest"), p.stderr[-3000:]
