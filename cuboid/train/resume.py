"""Which checkpoint a fine-tune resumes from, agreed by every rank, and which files in its output folder
are its own.

Saves go to a hidden temporary folder renamed into place when complete
(:mod:`cuboid.zoo.checkpoint.folder`), so an interrupted save never matches ``checkpoint-*``;
:func:`complete` also skips folders a crash left half-deleted. Under torch's elastic launcher a
restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, :func:`restart_count`) resumes from the newest
complete checkpoint of its own run by itself. Every run has an id, recorded in each checkpoint's
trainer state and in the output folder's :data:`RUN_FILE` when it starts (a resumed run keeps the
checkpoint's): ``--resume latest``, restarts and ``--keep``'s pruning touch only that run's
checkpoints, never another run's (an older run, a Hugging Face Trainer's) in the same folder, and a
fresh run refuses a folder an earlier run left files in (:func:`check_output_dir`). Rank 0 decides and
reads (:func:`decided_on_rank0`), so no two ranks resume differently and the checksums are read once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import uuid
from pathlib import Path
from typing import Optional

from cuboid.parallel import Mesh, comm

RUN_FILE = "cuboid-run.json"  # the id of the run that last started in an output folder
RUN_OUTPUTS = frozenset({"final", "metrics.jsonl", "curves.png"})  # (the run file alone: a run that failed early)


def checkpoints(out: Path) -> list[Path]:
    """The ``checkpoint-<step>`` folders in ``out``, oldest first."""
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def complete(path: Path) -> bool:
    """A training checkpoint with its commit file (the model index, or the single model file)."""
    from cuboid.zoo import lora
    from cuboid.zoo.checkpoint.format import INDEX, TRAINER_STATE

    return (path / TRAINER_STATE).is_file() and ((path / INDEX).is_file() or (path / "model.safetensors").is_file()
                                                 or lora.is_checkpoint(path))


def _run_id(file: Path, *keys: str) -> Optional[str]:
    """The string at ``keys`` in the JSON ``file``, read leniently as data (None: absent or unreadable)."""
    from cuboid.zoo.checkpoint.format import CheckpointError, parse_json

    try:
        value = parse_json(file.read_bytes(), file)
    except (OSError, CheckpointError):
        return None
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


def run_id_of(path: Path) -> Optional[str]:
    """The run id a checkpoint's trainer state records (None: none, or unreadable)."""
    from cuboid.zoo.checkpoint.format import TRAINER_STATE

    return _run_id(path / TRAINER_STATE, "state", "run_id")


def folder_run_id(out: Path) -> Optional[str]:
    """The id of the run that last started in ``out`` (its :data:`RUN_FILE`), or None."""
    return _run_id(out / RUN_FILE, "run_id")


def write_run_file(out: Path, run_id: str, model: Optional[str] = None) -> None:
    """Record ``run_id`` as ``out``'s current run (rank 0, before its first checkpoint), with the model folder
    it starts from (``model``, when it is one: what ``cuboid eval --task dpo`` takes as the reference)."""
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, **({"model": model} if model else {})}) + "\n")
    os.replace(tmp, out / RUN_FILE)


def starting_folder(model) -> Optional[str]:
    """The model folder a run starts from, resolved (None for a preset or a module)."""
    return str(Path(model).resolve()) if isinstance(model, (str, os.PathLike)) and os.path.isdir(model) else None


def starting_model(folder) -> Optional[tuple]:
    """(the model folder a fine-tune started from, the file that records it) for one of its folders: a
    ``checkpoint-<step>`` (its trainer state's run settings), or ``final/`` and the checkpoints beside it (the
    output folder's :data:`RUN_FILE`); None where none is recorded, or the folder recorded is not there."""
    from cuboid.zoo.checkpoint.format import TRAINER_STATE

    folder = Path(folder)
    for file, keys in ((folder / TRAINER_STATE, ("state", "run", "model")), (folder.parent / RUN_FILE, ("model",))):
        model = _run_id(file, *keys)
        if model and Path(model).is_dir() and Path(model).resolve() != folder.resolve():
            return model, file
    return None


def own_checkpoints(out: Path, run_id: Optional[str]) -> list[Path]:
    """The ``checkpoint-<step>`` folders of the run ``run_id`` in ``out``, oldest first (every one when None)."""
    return [p for p in checkpoints(out) if run_id is None or run_id_of(p) == run_id]


def newer_checkpoints(out: Path, run_id: str, step: int) -> list[Path]:
    """The run ``run_id``'s checkpoints in ``out`` past ``step`` (resuming ``step`` abandons them: a rewind)."""
    return [p for p in own_checkpoints(out, run_id) if int(p.name.split("-")[-1]) > step]


def occupant(out: Path) -> Optional[str]:
    """The first entry of ``out`` that an earlier run left (checkpoints, ``final/``, metrics), or None: what a
    fresh run would mix its own files with."""
    if not out.is_dir():
        return None
    for entry in sorted(out.iterdir()):
        if entry.name in RUN_OUTPUTS or (entry.name.startswith("checkpoint-") and entry.is_dir()):
            return entry.name + ("/" if entry.is_dir() else "")
    return None


def resolve_resume(resume: Optional[str], out: Path, run_id: Optional[str] = None) -> Optional[Path]:
    """The folder to resume from. 'latest' is the newest complete ``checkpoint-<step>`` of the run ``run_id``
    (of any run when None; None if there is none)."""
    if resume in (None, "", "none"):
        return None
    if resume == "latest":
        found = [p for p in own_checkpoints(out, run_id) if complete(p)]
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume {resume}: no such checkpoint folder")
    return path


def interrupted(out: Path) -> list[str]:
    """Names of the saves a crash interrupted in ``out`` (temporary folders, incomplete checkpoints)."""
    if not out.is_dir():
        return []
    tmp = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith(".checkpoint-")
                 and ".tmp-" in p.name)
    return tmp + [p.name for p in checkpoints(out) if not complete(p)]


def decided_on_rank0(mesh: Mesh, decide, errors=(ValueError,)):
    """``decide()`` run on rank 0 only and its answer sent to every rank; an error of ``errors`` there is
    raised on every rank (as a ValueError), so no rank goes on alone."""
    answer: tuple = ("ok", None)
    if mesh.is_main:
        try:
            answer = ("ok", decide())
        except errors as e:
            answer = ("error", str(e.args[0]) if e.args else str(e))
    if mesh.world_size > 1:
        import torch.distributed as dist

        box = [answer]
        with comm.guarded("broadcast_object_list (rank 0's decision)", None):
            dist.broadcast_object_list(box, src=0)
        answer = box[0]
    if answer[0] == "error":
        raise ValueError(answer[1])
    return answer[1]


def agreed_resume(resume: Optional[str], out: Path, mesh: Mesh, run_id: Optional[str] = None) -> Optional[Path]:
    """:func:`resolve_resume` decided on rank 0 and sent to every rank."""
    found = decided_on_rank0(mesh, lambda: resolve_resume(resume, out, run_id))
    return None if found is None else Path(found)


def resume_folder(resume: Optional[str], out: Path, mesh: Mesh, restart: int) -> Optional[Path]:
    """The checkpoint this attempt resumes from: ``resume`` on the first attempt ('latest': of the run that
    last started in ``out``; a one-line error when there is none); a restart takes the newest complete one
    of its own run (``resume`` when there is none, else None: step 0)."""
    run_id = decided_on_rank0(mesh, lambda: folder_run_id(out))
    if restart == 0:
        found = agreed_resume(resume, out, mesh, run_id)
        if found is None and resume == "latest":
            raise ValueError(f"--resume latest: no complete checkpoint in {out} to resume from; "
                             "leave out --resume to start a fresh run")
        return found
    return agreed_resume("latest", out, mesh, run_id) or agreed_resume(resume, out, mesh, run_id)


def check_output_dir(out: Path, resume: Optional[str], overwrite: bool, mesh: Mesh, restart: int) -> Optional[str]:
    """A resumed run (a checkpoint folder, first attempt) refuses an output folder another run's files are in
    (:func:`check_resume_into`) unless ``overwrite``. A fresh run (no ``resume``, first attempt) refuses an
    output folder an earlier run left files in,
    unless ``overwrite`` (``--overwrite-output-dir``: its files stay, this run prunes and resumes only its own
    checkpoints, and replaces ``final/`` and the metrics); then it records a new run id there at once (so a
    restart after an early crash takes this run's id, not an earlier run's) and returns it. None otherwise."""
    if restart:
        return None
    if resume not in (None, "", "none"):
        if resume != "latest" and not overwrite:
            decided_on_rank0(mesh, lambda: check_resume_into(Path(resume), out))
        return None
    found = None if overwrite else decided_on_rank0(mesh, lambda: occupant(out))
    if found is not None:
        raise ValueError(f"--output-dir {out} already holds {found} of an earlier run: resume it with --resume "
                         "latest, pick another --output-dir, or pass --overwrite-output-dir to train a new run "
                         "beside it")

    def claim() -> str:
        run_id = uuid.uuid4().hex
        out.mkdir(parents=True, exist_ok=True)
        write_run_file(out, run_id)
        return run_id

    return decided_on_rank0(mesh, claim, errors=(OSError,))


def check_resume_into(checkpoint: Path, out: Path) -> None:
    """A one-line ValueError when resuming ``checkpoint`` with ``out`` as the output folder would write over
    another run's files: ``out`` holds checkpoints, ``final/`` or metrics and its run record names a run other
    than the checkpoint's (the resumed run would replace that run's ``final/``, cut its metrics and take its
    record, so that its ``--resume latest`` went on with the wrong run)."""
    found = occupant(out)
    if found is None or not checkpoint.is_dir():
        return
    mine, theirs = run_id_of(checkpoint), folder_run_id(out)
    if theirs is None and checkpoint.resolve().parent == out.resolve():
        return  # the checkpoint's own folder, its run record not kept (a copied checkpoint): nothing else's
    if mine is None or mine != theirs:
        raise ValueError(f"--resume {checkpoint} continues run {mine or '(unrecorded)'}, but --output-dir {out} "
                         f"holds {found} of run {theirs or '(unrecorded)'}: resume into the checkpoint's own "
                         "--output-dir, give an empty one, or pass --overwrite-output-dir to write over it")


def keep_metrics(path: Path, step: Optional[int]) -> Optional[str]:
    """Rewrite the metrics log ``path`` with its rows up to ``step`` (None: none, a fresh log), atomically (a
    temporary file renamed over it). A line that is not a JSON row (the last one, cut off by a kill mid-append)
    is dropped; the warning that names the file and its lines is returned (None: nothing was dropped)."""
    kept, bad = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            at = row["step"] if isinstance(row, dict) else None
        except (ValueError, KeyError):
            at = None
        if not isinstance(at, (int, float)):
            bad.append(number)
        elif step is not None and at <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    if not bad:
        return None
    which = f"line {bad[0]}" if len(bad) == 1 else f"lines {', '.join(map(str, bad))}"
    return (f"warning: {path} {which} not a metrics row (cut off by a kill mid-write?): dropped"
            if step is not None else None)


def verify_once(verify, path: Path, mesh: Mesh) -> None:
    """``verify(path)`` on rank 0 (one read of every byte, not one per rank); every rank raises its error."""
    from cuboid.zoo.checkpoint import CheckpointError

    try:
        decided_on_rank0(mesh, lambda: verify(path) and None, errors=(ValueError, OSError))
    except ValueError as e:  # CheckpointError is a ValueError; the other ranks hear of it too
        raise CheckpointError(e.args[0]) from None


def restart_count(mesh: Mesh) -> int:
    """How often the job has been restarted: the largest ``TORCHELASTIC_RESTART_COUNT`` of any rank.

    Each node's agent counts its own restarts; a node restarted because another
    failed (a membership change) does not count one, so ranks take the maximum.
    """
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mesh.world_size == 1:
        return mine
    import torch.distributed as dist

    counts: list = [None] * mesh.world_size
    with comm.guarded("all_gather_object (restart counts)", None):
        dist.all_gather_object(counts, mine)
    return max(counts)


def load_checkpoint(path: Path, model, optimizer, scheduler, mesh: Mesh, lora: bool) -> dict:
    """Read ``path`` into the model, optimizer and scheduler (and the RNG); the saved training state.
    Every file is checked against its SHA-256 first (on rank 0, before any value is used); ``lora``: a LoRA
    run's checkpoint (:mod:`cuboid.zoo.checkpoint.lora_state`), read into any plan as a full one is."""
    if lora:
        from cuboid.zoo.checkpoint.lora_state import verify_lora
        from cuboid.zoo.lora import load_checkpoint as load_adapters

        verify_once(verify_lora, path, mesh)
        return load_adapters(model, path, optimizer=optimizer, scheduler=scheduler, verify=False)
    from cuboid.zoo import checkpoint as ckpt

    verify_once(ckpt.verify, path, mesh)  # before any value is used
    ckpt.load(model, path)
    return ckpt.load_training_state(path, model, optimizer=optimizer, scheduler=scheduler)["state"]


# what a checkpoint's run recorded (its trainer state's "run", :func:`run_settings`) that a
# resume cannot change: another objective, optimizer state of another kind, adapters of another shape, another
# base format would each train something else than the checkpoint holds
FIXED_SETTINGS = ("task", "optimizer", "lora", "quantize")


def run_settings(cfg, task, steps: int) -> dict:
    """What a run's checkpoints record of its settings (their trainer state's ``run``), as JSON values: what
    :func:`changed_settings` compares on resume. The plan is not among them: any plan resumes any checkpoint."""
    import json

    lora = cfg.lora
    if lora is not None and not (isinstance(lora, (str, os.PathLike)) and os.path.isdir(lora)):
        from cuboid.parallel.lora import LoraConfig

        c = LoraConfig.parse(lora)
        lora = f"r={c.r},alpha={c.alpha:g},dropout={c.dropout:g},targets={'+'.join(c.targets)}"
    settings = {"model": starting_folder(cfg.model), "task": task.label, "task_options": task.describe(),
                "optimizer": cfg.optimizer,
                "lora": None if lora is None else str(lora), "quantize": cfg.quantize, "steps": steps,
                "batch_size": cfg.batch_size, "micro_batch_size": cfg.micro_batch_size, "lr": cfg.lr,
                "lr_scaling": cfg.lr_scaling, "reference_batch": cfg.reference_batch, "warmup": cfg.warmup,
                "schedule": cfg.schedule, "decay_power": cfg.decay_power, "weight_decay": cfg.weight_decay,
                "max_grad_norm": cfg.max_grad_norm, "seed": cfg.seed, "seq_len": cfg.seq_len, "packing": cfg.packing,
                "data": (str(Path(cfg.data).resolve()) if os.path.exists(cfg.data) else cfg.data)
                if isinstance(cfg.data, str) else None}
    return json.loads(json.dumps(settings))


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def changed_settings(checkpoint: Path, now: dict) -> Optional[str]:
    """One line naming the settings of this run (``now``) that differ from those the run of ``checkpoint``
    recorded (None: none differ, or the checkpoint recorded none); a one-line ValueError when one of
    :data:`FIXED_SETTINGS` differs."""
    from cuboid.zoo.checkpoint.format import TRAINER_STATE

    saved = _run_settings(checkpoint / TRAINER_STATE)
    if not saved:
        return None
    diffs = [(k, saved[k], v) for k, v in now.items() if k in saved and saved[k] != v]
    fixed = [d for d in diffs if d[0] in FIXED_SETTINGS]
    if fixed:
        what = "; ".join(f"{k} {_shown(old)} there, {_shown(new)} here" for k, old, new in fixed)
        raise ValueError(f"--resume {checkpoint}: {what}: a resumed run keeps its {' and '.join(k for k, *_ in fixed)}"
                         f"; give the checkpoint's, or start a fresh run in another --output-dir")
    if not diffs:
        return None
    return (f"resuming {checkpoint} with settings changed from its run: "
            + ", ".join(f"{k} {_shown(old)} -> {_shown(new)}" for k, old, new in diffs))


def _run_settings(file: Path) -> dict:
    """The ``state.run`` table of a trainer state file, read leniently as data ({} when absent)."""
    from cuboid.zoo.checkpoint.format import CheckpointError, parse_json

    try:
        value = parse_json(file.read_bytes(), file)
    except (OSError, CheckpointError):
        return {}
    run = value.get("state", {}).get("run") if isinstance(value, dict) and isinstance(value.get("state"), dict) \
        else None
    return run if isinstance(run, dict) else {}


def new_recipe(optimizer, scheduler, peak_lr: float) -> None:
    """After a resume with changed settings: the scheduler's peak lr is this run's ``peak_lr`` (the checkpoint's
    scheduler state brought back the old one; the steps, warmup and decay are this run's already: its
    ``lr_lambda`` is not saved), and the step about to run takes the new schedule's lr."""
    groups = optimizer.param_groups
    if any(base != peak_lr for base in scheduler.base_lrs):
        scheduler.base_lrs = [peak_lr] * len(groups)
        for g in groups:
            g["initial_lr"] = peak_lr
    for g, base, f in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * f(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in groups]


@dataclasses.dataclass(frozen=True)
class FolderBefore:
    """What an output folder was before a run (:func:`folder_before`): its names, the bytes of its
    :data:`RUN_FILE`, and the first folder of its path that did not exist (None: it existed)."""

    names: frozenset
    run_file: Optional[bytes]
    created: Optional[Path]


def folder_before(out: Path) -> FolderBefore:
    """``out`` as it is before a run starts (:func:`tidy_failed` puts it back after an early failure)."""
    out = Path(out)
    created = None
    for p in [out, *out.parents]:
        if p.exists():
            break
        created = p
    names = frozenset(p.name for p in out.iterdir()) if out.is_dir() else frozenset()
    run_file = (out / RUN_FILE).read_bytes() if (out / RUN_FILE).is_file() else None
    return FolderBefore(names, run_file, created)


@contextlib.contextmanager
def tidied_on_failure(out: Path):
    """A run's body: when it raises, rank 0 puts ``out`` back as it was (:func:`tidy_failed`), and the error
    goes on. Not when the elastic agent may restart the workers (``--max-restarts``): a restart takes the run's
    id from the run file the first attempt wrote, and would take an earlier run's from a restored one."""
    before = folder_before(out)
    try:
        yield
    except BaseException:
        if os.environ.get("RANK", "0") == "0" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) == 0:
            tidy_failed(out, before)
        raise


def tidy_failed(out: Path, before: FolderBefore) -> None:
    """After a failed run (rank 0): when it wrote nothing useful (no checkpoint, metrics, final/ or any file
    beside its :data:`RUN_FILE`), the output folder as it was before: the run file it wrote removed (an
    earlier one put back) and the folders it made removed if empty; anything else stays."""
    out = Path(out)
    if not out.is_dir():
        return
    new = {p.name for p in out.iterdir()} - before.names
    if new - {RUN_FILE, f".{RUN_FILE}.tmp", LOCK_FILE}:
        return  # the run left something of its own: keep it all
    # (a new run lock goes too: the failed run let go of it, and a run refused meanwhile did not wait on it)
    for name in new:
        (out / name).unlink(missing_ok=True)
    if before.run_file is not None and (out / RUN_FILE).is_file() and (out / RUN_FILE).read_bytes() != before.run_file:
        (out / RUN_FILE).write_bytes(before.run_file)
    if before.created is not None:
        for p in [out, *out.parents]:
            try:
                p.rmdir()  # only an empty folder goes
            except OSError:
                break
            if p == before.created:
                break


# ---------------------------------------------------------------- one run at a time in an output folder

LOCK_FILE = ".cuboid-lock"  # flock'ed for a run's life; its text names the holder (pid, host, start time)
LOCK_ENV = "CUBOID_OUTPUT_LOCK"  # set by the launcher that holds the lock: "<pid>:<folder>", for its workers
_HELD: dict = {}  # resolved output folder -> the open lock file this process holds


def _holder(file: Path) -> dict:
    """The lock file's record of its holder, read as data ({} when absent or unreadable)."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _dead(holder: dict) -> bool:
    """Whether ``holder`` names a process of this host that is gone (a stale lock: a fork of it may keep the
    flock after the pid that wrote the record died)."""
    import socket

    pid = holder.get("pid")
    if not isinstance(pid, int) or holder.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _try_lock(file: Path):
    """The open ``file`` with an exclusive flock taken, or None when another process holds it."""
    import fcntl

    f = open(file, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def lock_output_dir(out: Path) -> None:
    """Take ``out``'s run lock for this process's life (or until :func:`unlock_output_dir`), before the run
    writes anything there; a one-line ValueError naming the holder (pid, host, start time) when another live
    run holds it (this process too: a second run started inside a first). A lock whose recorded holder is a
    dead process of this host is taken over. The workers of the launcher that holds it (:data:`LOCK_ENV`)
    pass: they are its run, restarts included."""
    import socket
    import time

    out = Path(out)
    key = str(out.resolve())
    file = out / LOCK_FILE
    launcher, _, folder = os.environ.get(LOCK_ENV, "").partition(":")
    if folder == key and str(_holder(file).get("pid")) == launcher:
        return
    out.mkdir(parents=True, exist_ok=True)
    f = _try_lock(file)
    if f is None and _dead(_holder(file)):
        file.unlink(missing_ok=True)  # a new file (inode): the dead run's flock holds the old one only
        f = _try_lock(file)
    if f is None:
        h = _holder(file)
        who = (f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')}" if h
               else "another process (its record not written yet)")
        raise ValueError(f"--output-dir {out} is in use by a run that is still going ({who}; lock {file}): "
                         "wait for it to end, or pick another --output-dir")
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}) + "\n")
    f.flush()
    _HELD[key] = f


def holds_output_dir(out: Path) -> bool:
    """Whether this process holds ``out``'s run lock."""
    return str(Path(out).resolve()) in _HELD


def unlock_output_dir(out: Path) -> None:
    """Let go of ``out``'s run lock if this process holds it (the file stays: removing it would let a
    process that opened it meanwhile lock a file no one else sees)."""
    f = _HELD.pop(str(Path(out).resolve()), None)
    if f is not None:
        f.close()
