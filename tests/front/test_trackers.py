"""``--report-to``: each tracker's local store, read back with its own reader (tests/front/tracker_stores.py),
holds the run's loss curve (the rows of metrics.jsonl) and its config and plan: all four under dp=2 (a --config
file's list), trackio, TensorBoard and W&B on one device too (the flag)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cuboid.cli import main
from cuboid.train import trackers
from cuboid.train.config import FinetuneConfig, checked

ENV = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRACKIO_DIR", "WANDB_MODE", "WANDB_DIR",
                                                         "MLFLOW_TRACKING_URI", "TRACKIO_SPACE_ID")}
ENV.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
ALL = ("trackio", "tensorboard", "wandb", "mlflow")
READER = Path(__file__).with_name("tracker_stores.py")


def test_report_to_values_and_errors(monkeypatch, capsys, tmp_path):
    assert trackers.parse(None) == trackers.parse("none") == trackers.parse([]) == ()
    assert trackers.parse("all") == tuple(n for n in ALL if trackers.installed(n))
    with pytest.raises(ValueError, match="--report-to comet: unknown tracker; give trackio, tensorboard, wandb"):
        trackers.parse("tensorboard,comet")
    with pytest.raises(ValueError, match="'none' and 'all' stand alone"):
        trackers.parse("none,wandb")
    real = trackers.installed
    monkeypatch.setattr(trackers, "installed", lambda name: name != "wandb" and real(name))
    with pytest.raises(ValueError, match=r'--report-to wandb needs the wandb package: pip install "cuboid\[track\]"'):
        trackers.parse(["wandb"])
    monkeypatch.undo()
    # the CLI: one line, exit 2, before any model or data is read
    rc = main(["finetune", "--model", "vit-debug", "--data", "digits", "--report-to", "visdom", "--output-dir",
               str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--report-to visdom: unknown tracker" in err[0], err
    # the Python API's config: the trackers' callback joins the run's (once)
    cfg = checked(FinetuneConfig(report_to="tensorboard"))
    assert cfg.report_to == ("tensorboard",) and [type(c) for c in cfg.callbacks] == [trackers.Reporter]
    assert len(checked(cfg).callbacks) == 1
    assert checked(FinetuneConfig()).callbacks == []


def _start(args, out: Path):
    return subprocess.Popen([sys.executable, "-m", "cuboid", "finetune", *args, "--output-dir", str(out),
                             "--no-progress", "--no-plot"], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _finish(p, timeout=300) -> str:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"cuboid finetune did not finish in {timeout} s")
    assert p.returncode == 0, err
    return err


def _read(out: Path, names):
    return subprocess.Popen([sys.executable, str(READER), str(out), *names], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_each_tracker_holds_the_loss_curve_and_config_one_device_and_dp2(tmp_path):
    for name in ALL:
        if not trackers.installed(name):
            pytest.skip(f"the track extra is not installed ({name} missing): pip install -e '.[track]'")
    common = ["--model", "vit-debug", "--data", "digits", "--steps", "4", "--batch-size", "16", "--lr", "0.01",
              "--eval-every", "2", "--log-every", "1"]
    config = tmp_path / "run.toml"  # dp=2 takes its trackers from a --config file (a list there)
    config.write_text('plan = "dp=2"\nreport_to = ["trackio", "tensorboard", "wandb", "mlflow"]\n')
    one, two = tmp_path / "one", tmp_path / "two"
    local = ALL  # one device: the four from the flag
    runs = [_start([*common, "--report-to", ",".join(local)], one), _start([*common, "--config", str(config)], two)]
    errs = [_finish(p) for p in runs]
    for err, names in zip(errs, (local, ALL)):
        assert all(f"report to {name}: " in err for name in names), err
    readers = [_read(one, local), _read(two, ALL)]
    stores = []
    for p in readers:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        stores.append(json.loads(out.strip().splitlines()[-1]))
    for out, store, dp in ((one, stores[0], 1), (two, stores[1], 2)):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        curve = [[r["step"], r["loss"]] for r in rows]
        assert [s for s, _ in curve] == [1, 2, 3, 4]
        for name in store:
            got = store[name]["loss"]
            assert [s for s, _ in got] == [s for s, _ in curve], (name, got)
            assert all(abs(a - b) <= 1e-6 * abs(b) for (_, a), (_, b) in zip(got, curve)), (name, got, curve)
        for name in ("trackio", "tensorboard", "wandb"):  # nested: the plan a table of its fields
            cfg = store[name]["config"]
            assert cfg["lr"] == 0.01 and cfg["max_steps"] == 4 and cfg["plan"]["dp"] == dp, (name, cfg)
            assert cfg["model"] == "vit-debug" and cfg["world_size"] == dp, (name, cfg)
        params = store["mlflow"]["config"]  # flat string params
        assert params["lr"] == "0.01" and params["plan.dp"] == str(dp) and params["batch_size"] == "16", params
        assert store["mlflow"]["status"] == "FINISHED"
        # rank 0 alone reported: one offline W&B run, one trackio run (the reader checks), one event file
        assert len(list((out / "wandb").glob("offline-run-*"))) == 1
        assert len([f for f in (out / "tensorboard").iterdir() if f.name.startswith("events")]) == 1


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, capsys, monkeypatch):
    """Issue 65, item 5.6: an MLflow server that does not answer: one line naming the tracker, exit 2 (was a
    110-line traceback)."""
    if not trackers.installed("mlflow"):
        pytest.skip("mlflow is not installed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9/")  # (the discard port: nothing listens)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    rc = main(["finetune", "--model", "vit-debug", "--data", "digits", "--steps", "1", "--batch-size", "16",
               "--report-to", "mlflow", "--output-dir", str(tmp_path / "out"), "--no-progress", "--no-plot",
               "--plan", "dp=1"])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("cuboid finetune: error: --report-to mlflow: the tracker did not start: "
                             "MlflowException: "), err


def test_ctrl_c_ends_the_tracker_runs_as_killed_with_every_row(tmp_path):
    """Issue 65, item 5.6: Ctrl-C after step 3: the MLflow run ends KILLED (it stayed RUNNING), and trackio's
    and MLflow's stores hold the three rows metrics.jsonl holds."""
    for name in ("trackio", "mlflow"):
        if not trackers.installed(name):
            pytest.skip(f"{name} is not installed")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "tests.front.interrupt_job", "finetune", "--model", "vit-debug",
                        "--data", "digits", "--steps", "10", "--batch-size", "16", "--log-every", "1",
                        "--eval-every", "100", "--report-to", "trackio,mlflow", "--plan", "dp=1", "--output-dir",
                        str(out), "--no-progress", "--no-plot"], capture_output=True, text=True, timeout=300,
                       env={**ENV, "CUBOID_SIGINT": "0:3", "PYTHONPATH": str(root)})
    assert p.returncode == 130, p.stderr[-3000:]
    reader = _read(out, ("trackio", "mlflow"))
    got, err = reader.communicate(timeout=180)
    assert reader.returncode == 0, err
    store = json.loads(got.strip().splitlines()[-1])
    assert store["mlflow"]["status"] == "KILLED", store["mlflow"]["status"]
    for name in ("trackio", "mlflow"):
        assert [s for s, _ in store[name]["loss"]] == [1, 2, 3], (name, store[name]["loss"])


def test_what_trackio_says_of_unwritten_rows_is_shown(monkeypatch, capsys):
    """Issue 65, item 5.6: trackio's finish() prints (to the stdout cuboid hides its banners from) or warns that
    rows are still buffered or were not sent; each is a warning line on stderr, not lost."""
    if not trackers.installed("trackio"):
        pytest.skip("trackio is not installed")
    import warnings

    import trackio

    def finish():
        print("* Run finished. Uploading logs to Trackio (please wait...)")
        print("* Some logs could not be sent to the remote server (it may still be starting up).")
        warnings.warn("Could not flush all logs within 30s. Some data may be buffered locally.")

    monkeypatch.setattr(trackio, "finish", finish)
    tracker = object.__new__(trackers.Trackio)
    tracker.close("KILLED")
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: --report-to trackio: Could not flush all logs within 30s. Some data may be buffered "
                   "locally.", "warning: --report-to trackio: Some logs could not be sent to the remote server (it "
                   "may still be starting up)."], err
