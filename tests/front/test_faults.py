"""Surviving faults: a killed worker restarts and the run ends bit for bit as if nothing had happened;
two launchers on one machine make the one-node job.

Each faulty run chains three SIGKILLs through ``CUBOID_FAULT`` (fault_job.py's ``Fault``, installed as a
trainer callback: the k-th entry acts on attempt k), so one run shows all three points at the cost of one
launch:

- attempt 0 loses a rank mid-step (step 3): the restart resumes from checkpoint-2;
- attempt 1 loses the writer mid-save (checkpoint-4 half written in its temporary folder): the restart
  ignores it and resumes from checkpoint-2 again;
- attempt 2 loses a rank right after checkpoint-4 is committed: the restart resumes from checkpoint-4;
- attempt 3 finishes. Its final checkpoint (model and optimizer tensors) equals the uninterrupted run's,
  compared with ``torch.equal``, and so do the logged losses of every step.

dp=2 goes through ``cuboid finetune --max-restarts`` (fault_job.py wrapping ``cuboid.cli.main``); tp1d
(tp=2) through ``torchrun --max-restarts`` and the Python API, with dropout, so the RNG restore is part of
what must come out equal (fault_job.py).
Every process group is gloo on 127.0.0.1; every launch is bounded and killed with its process group.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from ..parallel.launch import free_port
from . import fault_job
from . import fixtures as F
from .test_finetune import ENV

HERE = Path(__file__).parent
ROOT = HERE.parents[1]  # where `python -m tests.front.fault_job` finds the tests package
FAULTS = {"dp": "1:3:step,0:4:save,0:4:saved", "tp1d": "0:3:step,0:4:save,1:4:saved"}
RESUMES = [(1, 2), (2, 2), (3, 4)]  # (restart, the step it resumes from) for the chains above
RUN_TIMEOUT = 300  # seconds for one launch, restarts included


def cli_args(data: Path) -> list[str]:
    """The dp=2 job: the same numbers as fault_job.py's, so both runs are small alike."""
    return ["finetune", "--model", "vit-debug", "--data", str(data), "--plan", "dp=2",
            "--steps", str(fault_job.STEPS), "--batch-size", str(fault_job.BATCH), "--lr", str(fault_job.LR),
            "--save-every", str(fault_job.SAVE_EVERY), "--log-every", "1", "--eval-every", "100",
            "--no-progress", "--no-plot"]


def launch(*commands: list, env: dict | None = None, what: str, timeout: float = RUN_TIMEOUT) -> list[str]:
    """Run ``commands`` side by side, each in its own process group; their stderr. A failure or a
    timeout fails the test with the command's last lines, and kills every process it started."""
    logs = [tempfile.TemporaryFile("w+") for _ in commands]  # files, not pipes: no launcher blocks on a full one
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=log, text=True, env={**ENV, **(env or {})},
                              start_new_session=True) for c, log in zip(commands, logs)]
    deadline = time.monotonic() + timeout
    try:
        for p, log in zip(procs, logs):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.seek(0)
                pytest.fail(f"{what} did not finish within {timeout:.0f} s (a hang, or restarts that never end); "
                            f"its last output:\n{log.read()[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    errs = []
    for p, log in zip(procs, logs):
        log.seek(0)
        errs.append(log.read())
        log.close()
        tail = "\n".join(line for line in errs[-1].splitlines() if not line.startswith("[rank"))[-3000:]
        assert p.returncode == 0, f"{what} failed with exit code {p.returncode}:\n{tail}"
    return errs


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def job_tp1d(data: Path, out: Path, *, restarts: int = 0) -> list[str]:
    return torchrun("--standalone", "--nproc-per-node", "2", f"--max-restarts={restarts}",
                    str(HERE / "fault_job.py"), str(data), "tp1d", str(out))


def tensors(checkpoint: Path) -> dict:
    """Every tensor of a checkpoint folder (model and optimizer files), keyed by file and name."""
    from safetensors.torch import load_file

    out = {f"{f.name}:{k}": v for f in sorted(checkpoint.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert any(k.startswith("model") for k in out) and any(k.startswith("optimizer") for k in out), checkpoint
    return out


def assert_identical(ran: Path, reference: Path) -> None:
    """The final checkpoints hold the same tensors, bit for bit, and the runs logged the same losses."""
    final = f"checkpoint-{fault_job.STEPS}"
    a, b = tensors(ran / final), tensors(reference / final)
    assert sorted(a) == sorted(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ from the uninterrupted run's, first {differ[0]}"
    losses = [[(r["step"], r["loss"]) for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())]
              for d in (ran, reference)]
    assert losses[0] == losses[1] and len(losses[0]) == fault_job.STEPS


def assert_restarts(err: str, out: Path) -> None:
    """Each restart resumed from the checkpoint the chain predicts; the half-written save was never read."""
    seen = [(int(k), int(step)) for step, k in re.findall(r"resumed from \S+ at step (\d+) \(restart (\d+)\)", err)]
    assert seen == RESUMES, f"restarts (restart, resumed at step) {seen}, expected {RESUMES}"
    assert re.search(r"restart 2: ignored the interrupted save\(s\) \.checkpoint-4\.tmp-", err), \
        "the save killed on attempt 1 left no temporary folder for attempt 2 to ignore"
    assert not list(out.glob(".checkpoint-*")), "a temporary checkpoint folder outlived the run"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return F.image_folder(tmp_path_factory.mktemp("faults") / "img", per_class=8)


@pytest.fixture(scope="module")
def reference_dp(data, tmp_path_factory) -> Path:
    """The uninterrupted dp=2 run, shared by the dp fault run and the two-launcher run."""
    out = tmp_path_factory.mktemp("reference-dp")
    launch([sys.executable, "-m", "cuboid", *cli_args(data), "--output-dir", str(out)], what="the dp=2 reference")
    return out


def test_dp2_cli_survives_three_kills(data, reference_dp, tmp_path):
    out = tmp_path / "run"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    err, = launch([sys.executable, "-m", "tests.front.fault_job", *cli_args(data), "--output-dir", str(out),
                   "--max-restarts", "3", "--timeout-s", "60"], env={"CUBOID_FAULT": FAULTS["dp"], "PYTHONPATH": path},
                  what="the dp=2 run with 3 kills")
    assert_restarts(err, out)
    assert_identical(out, reference_dp)
    assert err.count("(collective timeout 60 s)") == 4  # --timeout-s reached every attempt's process groups


def test_tp1d_torchrun_with_dropout_survives_three_kills(data, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "run"
    launch(job_tp1d(data, reference), what="the tp1d reference")
    # torchrun users set this too: on torch's shared rendezvous store a restarted gloo group can read the
    # previous round's addresses (pytorch/pytorch#135712); `cuboid finetune` sets it for its launcher
    err, = launch(job_tp1d(data, out, restarts=3), what="the tp1d run with 3 kills",
                  env={"CUBOID_FAULT": FAULTS["tp1d"], "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert_restarts(err, out)
    assert_identical(out, reference)


def test_two_launchers_end_like_one_node(data, reference_dp, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` twice on 127.0.0.1 = dp=2 on one node."""
    out = tmp_path / "two-nodes"
    node = torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "cuboid-two-nodes",
                    "--local-addr", "127.0.0.1", "-m", "cuboid", *cli_args(data), "--output-dir", str(out))
    errs = launch(node, node, what="the two-launcher run", env={"GLOO_SOCKET_IFNAME": "lo"})
    assert sum("on 2 process(es)" in e for e in errs) == 1  # rank 0 logs, on whichever launcher it landed
    assert_identical(out, reference_dp)


@pytest.mark.parametrize("where", ["raise", "crash"])
def test_an_error_on_one_rank_is_the_headline(data, tmp_path, where):
    """Issue 65, item 5.4: rank 1 alone raises at step 2 (a bad value, or a bug); rank 0 only meets its absence.
    The last line names rank 1's error with its rank; rank 0's collateral "peer closed" error is not shown;
    a bad value prints no traceback, a bug prints rank 1's (prefixed with its rank) and no other."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-m", "tests.front.fault_job", *cli_args(data), "--output-dir",
                        str(tmp_path / "run"), "--timeout-s", "60"], capture_output=True, text=True,
                       timeout=RUN_TIMEOUT, env={**ENV, "CUBOID_FAULT": f"1:2:{where}", "PYTHONPATH": path})
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    kind, code = ("ValueError", 2) if where == "raise" else ("RuntimeError", 1)
    headline = f"[rank 1] {kind}: rank 1 was told to fail at step 2 (CUBOID_FAULT)"
    assert p.returncode == code and headline in lines[-2:], p.stderr[-3000:]
    assert "closed" not in p.stderr and "CollectiveError" not in p.stderr and "[rank 0]" not in p.stderr, p.stderr
    tracebacks = [line for line in lines if "Traceback" in line]
    assert tracebacks == ([] if where == "raise" else ["[rank 1] Traceback (most recent call last):"]), p.stderr


def test_a_bad_value_every_rank_meets_is_one_line_as_ever(data, tmp_path):
    """Every rank refuses the same value: rank 0's one line, without a rank, exit 2."""
    p = subprocess.run([sys.executable, "-m", "cuboid", *cli_args(data), "--output-dir", str(tmp_path / "run"),
                        "--label-column", "digit"], capture_output=True, text=True, timeout=RUN_TIMEOUT, env=ENV)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and lines == ["cuboid finetune: error: column 'digit' not found (columns: image, label); "
                                           "set --label-column"], p.stderr[-3000:]


# ---------------------------------------------------------------- in-process pieces (no launcher)


def test_latest_skips_interrupted_and_incomplete_saves(tmp_path):
    from cuboid.train.resume import interrupted, resolve_resume

    def folder(name: str, *files: str) -> None:
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_text("{}")

    full = ("config.json", "model.safetensors", "trainer_state.json")
    folder("checkpoint-2", *full)
    folder("checkpoint-4", "config.json", "optimizer-00001-of-00001.safetensors")  # half deleted or copied
    folder(".checkpoint-6.tmp-123-abcd0123", *full)  # complete files, never renamed into place
    folder("checkpoint-8.old", *full)  # the previous copy of a checkpoint being replaced
    assert resolve_resume("latest", tmp_path) == tmp_path / "checkpoint-2"
    assert interrupted(tmp_path) == [".checkpoint-6.tmp-123-abcd0123", "checkpoint-4"]
    assert resolve_resume("latest", tmp_path / "nothing-here") is None
    with pytest.raises(ValueError, match="--resume nowhere: no such checkpoint folder"):
        resolve_resume("nowhere", tmp_path)


def test_fault_spec_acts_on_its_attempt_and_rank(monkeypatch):
    from .fault_job import Fault, FaultCallback

    monkeypatch.setenv("CUBOID_FAULT", "1:3:step, 0:4:save")
    faults = FaultCallback().faults
    assert Fault.pick(faults, 1, 0) == Fault(1, 3, "step") and Fault.pick(faults, 0, 0) is None
    assert Fault.pick(faults, 0, 1) == Fault(0, 4, "save") and Fault.pick(faults, 0, 2) is None
    monkeypatch.setenv("CUBOID_FAULT", "1:3:later")
    with pytest.raises(ValueError, match="CUBOID_FAULT='1:3:later': expected rank:step:where"):
        FaultCallback()


def test_callbacks_see_every_event_in_order(tmp_path):
    """The trainer's callbacks: each event once per step or save, in the loop's order, with the step, the
    checkpoint path and, on the writing rank, each file as it lands in the save's temporary folder."""
    import cuboid
    from cuboid.train.callbacks import TrainerCallback
    from cuboid.kernels import use_backend

    class Record(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_train_begin(self, run):
            self.seen.append(("begin", run.start, run.restart))

        def on_step_begin(self, run, step):
            self.seen.append(("step", step))

        def on_step_end(self, run, step, row):
            self.seen.append(("step_end", step, row["step"]))

        def on_save_begin(self, run, step, path):
            self.seen.append(("save_begin", step, path.name))

        def on_save_file(self, run, step, name):
            assert not (run.output_dir / f"checkpoint-{step}").exists()  # still in the temporary folder
            self.seen.append(("file", step))

        def on_save(self, run, step, path):
            assert path.is_dir()
            self.seen.append(("saved", step, path.name))

        def on_train_end(self, run, summary):
            self.seen.append(("end", summary["step"]))

    rec = Record()
    data = F.image_folder(tmp_path / "img", per_class=4)
    with use_backend("torch"):
        cuboid.finetune("vit-debug", str(data), steps=2, batch_size=4, save_every=1, output_dir=str(tmp_path / "run"),
                        progress=False, plot=False, callbacks=[rec])
    files = [e for e in rec.seen if e[0] == "file"]
    assert len(files) >= 4 and {s for _, s in files} == {1, 2}  # several files per checkpoint
    assert [e for e in rec.seen if e[0] != "file"] == [
        ("begin", 0, 0), ("step", 1), ("step_end", 1, 1), ("save_begin", 1, "checkpoint-1"),
        ("saved", 1, "checkpoint-1"), ("step", 2), ("step_end", 2, 2), ("save_begin", 2, "checkpoint-2"),
        ("saved", 2, "checkpoint-2"), ("end", 2)]
    with pytest.raises(TypeError, match="TrainerCallback instances, got function"):
        cuboid.finetune("vit-debug", str(data), steps=1, callbacks=[lambda run: None])


def test_resume_verifies_checksums_and_bad_launch_values(tmp_path, capsys):
    """--resume refuses a flipped data byte, which only the SHA-256 check can see; --timeout-s and
    --max-restarts refuse values that make no sense."""
    import cuboid
    from cuboid.cli import main
    from cuboid.kernels import use_backend
    from cuboid.zoo.checkpoint import CheckpointError

    data = F.image_folder(tmp_path / "img", per_class=4)
    out = tmp_path / "run"
    opts = dict(steps=2, batch_size=4, save_every=1, output_dir=str(out), progress=False, plot=False)
    with use_backend("torch"):
        cuboid.finetune("vit-debug", str(data), **opts)
        model = out / "checkpoint-2" / "model.safetensors"
        raw = bytearray(model.read_bytes())
        raw[-5] ^= 0x01  # the last tensor's data: the header and every shape stay valid
        model.write_bytes(bytes(raw))
        with pytest.raises(CheckpointError, match=r"model\.safetensors.*SHA-256"):
            cuboid.finetune("vit-debug", str(data), resume="latest", **{**opts, "steps": 3})
    for flag, value, message in (("--timeout-s", "0", "--timeout-s 0.0: must be in (0.0, "),
                                 ("--max-restarts", "-1", "--max-restarts -1: must be in [0, ")):
        assert main(["finetune", "--data", str(data), flag, value, "--no-progress"]) == 2
        assert message in capsys.readouterr().err
