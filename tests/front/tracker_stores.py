"""Reads back what a ``cuboid finetune --report-to ...`` run left in its output folder, each tracker's store with
that tracker's own reader, and prints one JSON object: ``{tracker: {"loss": [[step, loss], ...], "config":
{...}}}``. Run as ``python tracker_stores.py OUTPUT_DIR TRACKER...`` in a process of its own: trackio fixes
its folder when first imported, so one process reads one run's store.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path


def tensorboard(out: Path) -> dict:
    """TensorBoard's EventAccumulator over ``out/tensorboard``: the ``loss`` scalars and the config text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    loss = [[e.step, e.value] for e in acc.Scalars("loss")]
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    config = json.loads(text.strip().removeprefix("```json").removesuffix("```"))
    return {"loss": loss, "config": config}


def trackio(out: Path) -> dict:
    """trackio's local API (its SQLite store in ``out/trackio``): the run's logs and config."""
    os.environ["TRACKIO_DIR"] = str(out / "trackio")
    from trackio.sqlite_storage import SQLiteStorage

    runs = SQLiteStorage.get_runs("cuboid")
    assert runs == [out.name], runs
    logs = SQLiteStorage.get_logs("cuboid", out.name)
    config = SQLiteStorage.get_run_config("cuboid", out.name)
    return {"loss": [[r["step"], r["loss"]] for r in logs if "loss" in r], "config": config}


def mlflow(out: Path) -> dict:
    """MLflow's client over the SQLite store ``out/mlflow.db``: the ``loss`` history and the params."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("cuboid")
    (run,) = client.search_runs([experiment.experiment_id])
    loss = sorted([m.step, m.value] for m in client.get_metric_history(run.info.run_id, "loss"))
    return {"loss": loss, "config": dict(run.data.params), "status": run.info.status}


def wandb_records(path: Path):
    """The records of a W&B offline run file (``run-<id>.wandb``): LevelDB's log format (32 KiB blocks of
    checksummed chunks: full, first, middle, last) after a 7-byte ``:W&B`` header, each record one
    ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic, version)
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb(out: Path) -> dict:
    """The offline run's ``.wandb`` file read with wandb's protobuf records: history rows and config."""
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (path,) = run_dir.glob("run-*.wandb")
    loss, config = [], {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "loss" in row:
                loss.append([row["_step"], row["loss"]])
        elif kind in ("config", "run"):  # the config given to wandb.init rides on the run record
            for item in (record.config if kind == "config" else record.run.config).update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in config.items()}  # {"value": ...}
    return {"loss": loss, "config": config}


if __name__ == "__main__":
    out = Path(sys.argv[1]).resolve()
    readers = {"tensorboard": tensorboard, "trackio": trackio, "mlflow": mlflow, "wandb": wandb}
    print(json.dumps({name: readers[name](out) for name in sys.argv[2:]}))
