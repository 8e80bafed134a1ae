"""Experiment trackers (``--report-to``): the rows of ``metrics.jsonl`` sent to trackio, TensorBoard, Weights &
Biases or MLflow, as the Hugging Face Trainer's and TRL's ``report_to`` does.

``report_to`` is ``none`` (the default), ``all`` (every tracker whose package is installed), or a comma list of
:data:`TRACKERS`. Each runs in its local, offline mode with its files under the run's ``output_dir`` (as the HF
Trainer's ``logging_dir`` sits under its ``output_dir``), unless the tracker's own environment variable points
it elsewhere:

- ``trackio``: its SQLite store in ``output_dir/trackio`` (``$TRACKIO_DIR`` or ``$TRACKIO_SPACE_ID`` win; the
  folder is fixed when trackio is first imported in a process); ``trackio show`` reads it;
- ``tensorboard``: event files in ``output_dir/tensorboard`` (``tensorboard --logdir``);
- ``wandb``: an offline run in ``output_dir/wandb`` (``$WANDB_MODE`` and ``$WANDB_DIR`` win; ``wandb sync``
  uploads it);
- ``mlflow``: its SQLite store ``output_dir/mlflow.db`` (``$MLFLOW_TRACKING_URI`` wins; ``mlflow ui
  --backend-store-uri sqlite:///.../mlflow.db``).

Rank 0 alone reports. Each tracker gets every row the loop writes to ``metrics.jsonl`` (the
:class:`~cuboid.train.callbacks.TrainerCallback` event ``on_log``), with the same metric names (``loss``,
``lr``, ``grad_norm``, ``eval_loss``, ...) and the row's ``step`` as its step, and at the start the run's
configuration and plan as hyper-parameters (:func:`hyperparameters`). A tracker whose package is missing is a
one-sentence error naming the ``track`` extra, before any work.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from cuboid.train.callbacks import TrainerCallback

TRACKERS = ("trackio", "tensorboard", "wandb", "mlflow")
PACKAGES = {"trackio": "trackio", "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
INSTALL = 'pip install "cuboid[track]" (from a clone: pip install -e ".[track]")'
PROJECT = "cuboid"  # the project / experiment the runs go to, unless the tracker's own variable names one


def installed(name: str) -> bool:
    """Whether tracker ``name``'s package can be imported here (without importing it)."""
    return importlib.util.find_spec(PACKAGES[name]) is not None


def parse(value: Any) -> tuple:
    """``--report-to``'s value (a comma string or a list; None, ``none`` or empty: no tracker; ``all``: those
    installed) as a tuple of :data:`TRACKERS` names; a one-sentence ValueError for an unknown name or a
    tracker whose package is missing."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [str(v).strip().lower() for v in items if str(v).strip()]
    if not names or names == ["none"]:
        return ()
    if "none" in names or "all" in names:
        if len(names) > 1:
            raise ValueError(f"--report-to {','.join(names)}: 'none' and 'all' stand alone")
        return tuple(n for n in TRACKERS if installed(n))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"--report-to {', '.join(unknown)}: unknown tracker; give {', '.join(TRACKERS)}, all or none")
    missing = [n for n in names if not installed(n)]
    if missing:
        raise ValueError(f"--report-to {', '.join(missing)} needs the {' and '.join(PACKAGES[n] for n in missing)} "
                         f"package{'s' if len(missing) > 1 else ''}: {INSTALL}")
    return tuple(dict.fromkeys(names))


def callbacks(value: Any) -> list:
    """The run's tracker callback for ``--report-to`` ``value`` (none for no tracker)."""
    names = parse(value)
    return [Reporter(names)] if names else []


# ---------------------------------------------------------------- what is reported


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: containers walked, a task or model by its description, others as text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "describe"):
        return value.describe()
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    return type(value).__name__ if not isinstance(value, (os.PathLike,)) else os.fspath(value)


def hyperparameters(run) -> dict:
    """The run's configuration (:class:`~cuboid.train.config.FinetuneConfig`'s fields; the model and data as
    named, the task as described), its plan (``plan``: the plan's fields) and what the loop derived from them
    (steps, warmup steps, peak lr, micro-batch, accumulation, world size): what each tracker records once."""
    cfg = run.cfg
    config = {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "callbacks"}
    if not isinstance(cfg.model, (str, os.PathLike)):
        config["model"] = type(cfg.model).__name__
    if not isinstance(cfg.data, (str, os.PathLike)):
        config["data"] = type(cfg.data).__name__
    config["plan"] = run.plan.to_dict()
    config.update(world_size=run.mesh.world_size, max_steps=run.steps, warmup_steps=run.warmup,
                  peak_lr=run.peak_lr, micro_batch_size=run.micro, gradient_accumulation_steps=run.accumulate,
                  run_id=run.run_id)
    return config


def flat(params: dict, prefix: str = "") -> dict:
    """``params`` with nested tables spelled ``plan.dp`` (trackers that take flat key/value hyper-parameters)."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def metrics_of(row: dict) -> dict:
    """The numbers of a ``metrics.jsonl`` row, ``step`` aside (the trackers' step)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---------------------------------------------------------------- the trackers


class Trackio:
    def __init__(self, run, params: dict) -> None:
        if "trackio" not in sys.modules and not os.environ.get("TRACKIO_DIR"):
            os.environ["TRACKIO_DIR"] = str((run.output_dir / "trackio").resolve())
        import contextlib
        import io

        import trackio

        with contextlib.redirect_stdout(io.StringIO()):  # its banner and dashboard hint; cuboid says where
            self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=run.output_dir.name,
                                    config=params, resume="allow" if run.start else "never",
                                    auto_log_gpu=False, auto_log_cpu=False)
        from trackio.utils import TRACKIO_DIR

        self.where = f"{TRACKIO_DIR} (trackio show)"

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "FINISHED") -> None:
        """trackio's ``finish`` (the module's: it writes the rows still queued and forgets the run, so trackio's
        exit hook has none to finish); what it says of rows it could not write (printed, or warned) is one
        warning line each, its progress line aside."""
        import contextlib
        import io
        import warnings

        import trackio

        said = io.StringIO()
        with contextlib.redirect_stdout(said), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trackio.finish()
        notes = [str(w.message) for w in caught] + [line for line in said.getvalue().splitlines()
                                                    if line.strip() and "Run finished" not in line]
        for note in notes:
            print(f"warning: --report-to trackio: {' '.join(note.strip(' *').split())}", file=sys.stderr,
                  flush=True)


class TensorBoard:
    def __init__(self, run, params: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        folder = run.output_dir / "tensorboard"
        # a resumed run drops the events its checkpoint's step is past (an interrupted run's last ones)
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=run.start + 1 if run.start else None)
        self.writer.add_text("config", "```json\n" + json.dumps(params, indent=2) + "\n```")
        # the HParams tab's record, in this run's own event file (add_hparams would start a second one)
        scalars = {k: v if isinstance(v, (bool, int, float, str)) else json.dumps(v) for k, v in flat(params).items()}
        for summary in hparams(scalars, {}):
            self.writer.file_writer.add_summary(summary)
        self.where = f"{folder} (tensorboard --logdir)"

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self, status: str = "FINISHED") -> None:
        self.writer.close()


class WandB:
    def __init__(self, run, params: dict) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        folder = Path(os.environ.get("WANDB_DIR") or run.output_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run.output_dir.name,
                              id=run.run_id, dir=str(folder), mode=os.environ.get("WANDB_MODE", "offline"),
                              config=params, resume="allow" if run.start else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                                                      silent=True))
        self.where = f"{self.run.dir.rsplit(os.sep + 'files', 1)[0]} (wandb sync)"

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str = "FINISHED") -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MLflow:
    def __init__(self, run, params: dict) -> None:
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its lines on building the tables
        folder = run.output_dir.resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{folder / 'mlflow.db'}"  # MLflow's local store
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        found = self.client.get_experiment_by_name(name)
        artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (folder / "mlartifacts").as_uri()
        experiment = found.experiment_id if found is not None else self.client.create_experiment(
            name, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment, run_name=run.output_dir.name,
                                             tags={"cuboid.run_id": str(run.run_id)}).info.run_id
        values = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000]) for k, v in flat(params).items()]
        for i in range(0, len(values), 100):  # at most 100 params a batch
            self.client.log_batch(self.run_id, params=values[i:i + 100])
        self.where = f"{uri} (mlflow ui --backend-store-uri)"

    def log(self, metrics: dict, step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()
                                                    if math.isfinite(v)])

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)  # FINISHED, KILLED (Ctrl-C, SIGTERM) or FAILED


KINDS = {"trackio": Trackio, "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class Reporter(TrainerCallback):
    """Opens the trackers when training begins, sends each ``metrics.jsonl`` row, closes them at the end (a run
    that stops early: as KILLED after Ctrl-C or SIGTERM, FAILED after an error); on rank 0 only (the others
    hold nothing). A tracker that cannot start is a one-line error; one that fails later is one warning line
    and gets no more rows (``metrics.jsonl`` has them all)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.open: list = []

    def on_train_begin(self, run) -> None:
        if not run.mesh.is_main:
            return
        params = hyperparameters(run)
        for name in self.names:
            try:
                tracker = KINDS[name](run, params)
            except Exception as e:  # noqa: BLE001 - a tracker's own failure (a bad URI, a store it cannot write)
                raise ValueError(f"--report-to {name}: the tracker did not start: {_line(e)}") from None
            tracker.name = name
            self.open.append(tracker)
            print(f"report to {name}: {tracker.where}", file=sys.stderr, flush=True)

    def on_log(self, run, row: dict) -> None:
        metrics = metrics_of(row)
        for tracker in list(self.open):
            try:
                tracker.log(metrics, int(row["step"]))
            except Exception as e:  # noqa: BLE001 - the run goes on; the tracker is left out from here on
                self.open.remove(tracker)
                print(f"warning: --report-to {tracker.name} failed at step {row['step']}: {_line(e)}; it gets no "
                      f"more rows (metrics.jsonl has them)", file=sys.stderr, flush=True)
                self._close(tracker, "FAILED")

    def on_train_end(self, run, summary: dict) -> None:
        self.close()

    def on_train_abort(self, run, error: BaseException) -> None:
        from cuboid.train.interrupt import Terminated

        self.close("KILLED" if isinstance(error, (KeyboardInterrupt, Terminated)) else "FAILED")

    def close(self, status: str = "FINISHED") -> None:
        while self.open:
            self._close(self.open.pop(), status)

    @staticmethod
    def _close(tracker, status: str) -> None:
        try:
            tracker.close(status)
        except Exception as e:  # noqa: BLE001 - closing must not hide the run's own end
            print(f"warning: --report-to {tracker.name} did not close: {_line(e)}", file=sys.stderr, flush=True)


def _line(e: BaseException) -> str:
    """An error's first line with its type (a tracker's messages run to many lines)."""
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
