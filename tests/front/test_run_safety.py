"""A run touches only its own files and refuses bad input before it builds anything (issue 39, case 2, the
labels of case 5 and the process bound of case 7): a run id in every checkpoint, pruning and ``--resume
latest`` limited to it, a fresh run refusing a used output folder without ``--overwrite-output-dir``,
one sentence for ``--resume latest`` with nothing to resume and for ``--steps`` below the resumed step."""
from __future__ import annotations

import json
import sys
import time

import pytest

import cuboid
from cuboid.cli import main
from cuboid.train.resume import RUN_FILE, run_id_of

from . import fixtures as F

OPTS = dict(batch_size=4, save_every=1, keep=2, progress=False, plot=False)


@pytest.fixture(autouse=True)
def torch_kernels():
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        yield


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return F.image_folder(tmp_path_factory.mktemp("img"), per_class=4)


def _steps(out):
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def test_a_fresh_run_refuses_a_used_output_folder_and_keeps_other_runs_checkpoints(images, tmp_path):
    out = tmp_path / "out"
    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=4, **OPTS)
    first = run_id_of(out / "checkpoint-4")
    assert first and json.loads((out / RUN_FILE).read_text())["run_id"] == first
    assert _steps(out) == [3, 4]
    with pytest.raises(ValueError, match="already holds checkpoint-3/ of an earlier run.*--overwrite-output-dir"):
        cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, **OPTS)

    # a new run beside it: its own id; --keep prunes only its checkpoints; the older run's 3 and 4 stay
    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, overwrite_output_dir=True,
                    **{**OPTS, "keep": 1})
    assert _steps(out) == [2, 3, 4]
    second = run_id_of(out / "checkpoint-2")
    assert second and second != first and run_id_of(out / "checkpoint-4") == first
    # --resume latest takes this run's newest (2), not the older run's 4; the resumed run keeps its id
    result = cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=3, resume="latest",
                             **{**OPTS, "keep": 1})
    assert result["step"] == 3 and run_id_of(out / "checkpoint-3") == second
    assert _steps(out) == [3, 4] and run_id_of(out / "checkpoint-4") == first


def test_resume_latest_with_nothing_and_steps_below_the_checkpoint_say_so(images, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--resume latest: no complete checkpoint in .* to resume from"):
        cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, resume="latest", **OPTS)
    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, **OPTS)
    final = (out / "final" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="--steps 1 is below step 2 of .*checkpoint-2.*nothing is left to train"):
        cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=1, resume="latest", **OPTS)
    assert (out / "final" / "model.safetensors").read_bytes() == final
    capsys.readouterr()
    assert main(["finetune", "--model", "vit-debug", "--data", str(images), "--output-dir", str(out),
                 "--steps", "2", "--no-progress", "--no-plot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds" in err[0], err


def test_an_elastic_restart_with_no_checkpoint_starts_from_step_0(images, tmp_path, monkeypatch):
    out = tmp_path / "out"
    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, **OPTS)
    older = run_id_of(out / "checkpoint-2")
    # a new run beside it dies before its first checkpoint; its restart starts at step 0 as that run (its id
    # was recorded at the start), not from the older run's checkpoint-2. torchrun's workers of a job that may
    # restart see TORCHELASTIC_MAX_RESTARTS, which keeps the failed start's run file for the restart
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(Exception):
        cuboid.finetune("vit-debug", str(tmp_path / "no-such-data"), output_dir=str(out), steps=3,
                        overwrite_output_dir=True, **OPTS)
    new = json.loads((out / RUN_FILE).read_text())["run_id"]
    assert new != older
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    result = cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=1, resume="latest", **OPTS)
    assert result["step"] == 1 and run_id_of(out / "checkpoint-1") == new
    assert run_id_of(out / "checkpoint-2") == older
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_a_stray_label_is_refused_before_a_head_is_built(tmp_path):
    import datasets

    from cuboid.data.formats import DataError

    rows = F.sentences(16)
    labels = [y for _, y in rows]
    labels[3] = 10 ** 9
    data = datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": labels})
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="class id 1000000000.*0..2.*ClassLabel"):
        cuboid.finetune("bert-debug", data, task="seqcls", output_dir=str(tmp_path / "out"), steps=1, **OPTS)
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "out" / "final").exists()
    from cuboid.data.formats import num_classes

    split = datasets.Dataset.from_dict
    assert num_classes(split({"label": [0, 1, 1]}), "label", split({"label": [2]})) == 3  # over both splits
    for bad, message in (([0, 2], "class id 2, but its 2 distinct ids must be 0..1 .missing 1."),
                         ([0, -1], "class id -1")):
        with pytest.raises(DataError, match=message):
            num_classes(split({"label": bad}), "label")


def test_a_plan_past_the_machine_s_processes_starts_nothing(tmp_path, capsys):
    t0 = time.perf_counter()
    rc = main(["finetune", "--model", "vit-debug", "--plan", "dp=100000", "--steps", "1",
               "--output-dir", str(tmp_path / "out"), "--no-progress", "--no-plot"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "100000 processes" in err[0] and "CUBOID_MAX_LOCAL_PROCESSES" in err[0]
    assert time.perf_counter() - t0 < 30 and not (tmp_path / "out").exists()


def _second_runs(out, images, capsys) -> list:
    """What a second run into ``out`` says while a first holds it: (exit code, stderr lines) of the CLI with
    one process and with a dp=2 launch, and the Python API's error."""
    said = []
    for plan in ("dp=1", "dp=2"):
        capsys.readouterr()
        rc = main(["finetune", "--model", "vit-debug", "--data", str(images), "--output-dir", str(out), "--plan",
                   plan, "--steps", "2", "--batch-size", "4", "--overwrite-output-dir", "--no-progress", "--no-plot"])
        said.append((rc, capsys.readouterr().err.strip().splitlines()))
    with pytest.raises(ValueError) as e:
        cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, resume="latest", **OPTS)
    return said + [str(e.value)]


def test_a_second_run_into_a_busy_output_dir_is_refused_and_a_dp2_resume_after_it_goes(images, tmp_path, capsys,
                                                                                      monkeypatch):
    """Issue 65, item 5.1: a run holds its output folder's lock for its life. Started while it trains (from its
    step-1 callback), a second run, one process or a dp=2 launch, fresh or resuming, is refused in one line
    naming the holder, and writes nothing; once the first ended, a dp=2 run resumes there (the launcher's
    workers are its run)."""
    import os
    import socket

    from cuboid.train.callbacks import TrainerCallback
    from cuboid.train.resume import LOCK_FILE

    out = tmp_path / "out"
    seen = {}

    class SecondRun(TrainerCallback):
        def on_step_end(self, run, step, row):
            if step == 1:
                seen["files"] = sorted(p.name for p in out.iterdir())
                seen["said"] = _second_runs(out, images, capsys)
                seen["after"] = sorted(p.name for p in out.iterdir())

    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=3, log_every=1,
                    callbacks=[SecondRun()], **OPTS)
    (rc1, err1), (rc2, err2), api = seen["said"]
    for rc, err in ((rc1, err1), (rc2, err2)):
        assert rc == 2 and len(err) == 1, err
        assert f"pid {os.getpid()} on {socket.gethostname()}, started " in err[0] and "in use by a run" in err[0]
    assert f"pid {os.getpid()}" in api
    assert seen["after"] == seen["files"]  # the second runs wrote nothing
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and _steps(out) == [2, 3]  # the first run's own, whole
    assert (out / LOCK_FILE).is_file()

    capsys.readouterr()
    argv = ["finetune", "--model", "vit-debug", "--data", str(images), "--output-dir", str(out), "--plan", "dp=2",
            "--steps", "4", "--batch-size", "4", "--save-every", "1", "--resume", "latest", "--no-progress",
            "--no-plot"]
    monkeypatch.setattr(sys, "argv", ["cuboid", *argv])  # what the launched workers run
    assert main(argv) == 0
    assert _steps(out) == [3, 4] and run_id_of(out / "checkpoint-4") == run_id_of(out / "checkpoint-3")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_a_lock_whose_holder_died_is_taken_over(tmp_path):
    """The recorded holder is dead though its flock lives on (a forked child kept the file open): the lock is
    taken over; a live holder's is not."""
    import os
    import signal
    import subprocess

    from cuboid.train.resume import LOCK_FILE, lock_output_dir, unlock_output_dir

    out = tmp_path / "out"
    code = ("import os, sys, time\nfrom pathlib import Path\nfrom cuboid.train.resume import lock_output_dir\n"
            "lock_output_dir(Path(sys.argv[1]))\nchild = os.fork()\nif child == 0:\n"
            "    null = os.open(os.devnull, os.O_WRONLY)\n    os.dup2(null, 1)\n    os.dup2(null, 2)\n"
            "    time.sleep(120)\n"
            "else:\n    print(child, flush=True)\n")
    child = int(subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                               check=True, timeout=120).stdout)
    try:
        recorded = json.loads((out / LOCK_FILE).read_text())["pid"]
        assert recorded != child
        lock_output_dir(out)
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(ValueError, match=f"in use by a run that is still going .pid {os.getpid()} "):
            lock_output_dir(out)  # a live holder's lock, this process's too
        unlock_output_dir(out)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_metrics_line_cut_off_by_a_kill_is_dropped_on_resume_with_a_warning(images, tmp_path, capsys):
    """Issue 65, item 5.3: a kill mid-append leaves half a row last in metrics.jsonl; the resume drops it,
    says so naming the file and line, and writes the log anew (no temporary file left)."""
    out = tmp_path / "out"
    cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=2, log_every=1, **OPTS)
    metrics = out / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "loss": 0.12')  # the kill came mid-line
    capsys.readouterr()
    result = cuboid.finetune("vit-debug", str(images), output_dir=str(out), steps=3, log_every=1, resume="latest",
                             **OPTS)
    assert result["step"] == 3
    err = capsys.readouterr().err
    assert f"warning: {metrics} line 3 not a metrics row" in err, err
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".metrics")) == []
