"""The atomic-replace protocol for checkpoint folders.

A save writes everything into a temporary sibling ``.{name}.tmp-{pid}-{rand}``
(every file fsync'd, the commit file last: the model index, or the single
``model.safetensors`` that carries the checksums), fsyncs that folder, and then:

1. if ``path`` exists (a complete checkpoint: only complete folders are ever
   renamed to ``path``), remove a stale ``{name}.old`` left by an earlier
   crash and rename ``path`` -> ``{name}.old``;
2. rename the temporary folder -> ``path``, fsync the parent;
3. delete ``{name}.old``.

What a crash (a killed process) at any point leaves, and how it reads:

- before step 1: ``path`` is the previous checkpoint; the temporary folder is
  garbage (hidden, never named ``path``; a partial one lacks its commit file or
  fails its checksums, so it never passes :func:`verify`). The next save
  deletes temporary folders whose writing process is gone.
- between 1 and 2: ``path`` is missing and ``{name}.old`` is the previous
  complete checkpoint. :func:`resolve` (used by load and verify) then answers
  ``{name}.old``, with a warning; the next save renames its new folder to
  ``path`` and deletes ``{name}.old``.
- between 2 and 3: ``path`` is the new checkpoint, ``{name}.old`` a stale
  copy that loads ignore and the next save deletes.

What may be replaced: an empty folder, or one whose every entry is a model
file (:func:`is_model_file`: config, safetensors weights and index,
tokenizer, generation config, training state, LoRA adapters and state) or a
file the folder's own commit record lists (cuboid wrote it). Anything else
(a ``.tex`` file, a ``src/`` folder, a README that no commit recorded) makes
:func:`begin` refuse in one sentence naming it: nothing of the user's is
deleted by a save, ``cuboid convert --overwrite`` or the trainer's ``final/``.

Paths are resolved first (:func:`real`): a save to a symbolic link replaces
the folder it points to and leaves the link in place, so every later save of
that path works too.

:func:`stale_files` is what :func:`~.writer.export` removes when it writes
one ``model.safetensors`` into a folder that held another save: the old index
and its shards (which a reader would otherwise have to choose between) and
the training state the old commit recorded for the old weights.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Callable

from .format import INDEX, OPTIMIZER_INDEX, TRAINER_STATE, CheckpointError, lora_commit, read_header

# Fault-injection point for the crash tests: called with a stage name at every
# step of a save on the writing rank ("begin", "file:<name>", "written",
# "moved-old", "committed", "done"). A no-op in normal use.
hook: Callable[[str], None] = lambda stage: None

_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]+$")


def old_of(path: Path) -> Path:
    return path.with_name(path.name + ".old")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# what a tokenizer's save_pretrained writes beside files named tokenizer* and *.model (sentencepiece)
TOKENIZER_NAMES = frozenset({"special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                             "merges.txt", "chat_template.jinja", "chat_template.json"})
_MODEL_NAMES = frozenset({"config.json", "generation_config.json", "preprocessor_config.json", "model.safetensors",
                          INDEX, "optimizer.safetensors", OPTIMIZER_INDEX, TRAINER_STATE, "adapter_config.json",
                          "adapter_model.safetensors"})
_MODEL_PATTERN = re.compile(r"(model|optimizer)-\d+-of-\d+\.safetensors|lora-[\w.-]+\.(pt|safetensors|json)"
                            r"|\.cuboid-export-\w+|\.(adapter_model\.safetensors|adapter_config\.json)\.tmp")
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def is_tokenizer_file(name: str) -> bool:
    return name.startswith("tokenizer") or name in TOKENIZER_NAMES or name.endswith(".model")


def is_model_file(name: str) -> bool:
    """A name that a model or checkpoint folder holds (cuboid's, ``transformers``', ``peft``'s), by name alone."""
    return name in _MODEL_NAMES or is_tokenizer_file(name) or _MODEL_PATTERN.fullmatch(name) is not None


def _json(path: Path):
    """A small JSON file's content, or None when it is absent or unreadable (a record read leniently)."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None


def commit_record(path: Path) -> dict:
    """The records (file -> {size, sha256}) of the folder's cuboid commit (the model index, a LoRA commit file or
    the single model file), plus the commit file itself and the shards its index names; empty for a folder
    cuboid did not write (read leniently: a damaged record is none)."""
    files: dict = {}
    index = _json(path / INDEX)
    if isinstance(index, dict) and isinstance(index.get("metadata"), dict) \
            and isinstance(index["metadata"].get("files"), dict):
        files = dict(index["metadata"]["files"], **{INDEX: {}})
        wm = index.get("weight_map")
        files.update({f: {} for f in (wm.values() if isinstance(wm, dict) else ()) if isinstance(f, str)})
    elif (name := lora_commit(path)) is not None:  # a LoRA checkpoint or adapters
        record = _json(path / name)
        if isinstance(record, dict) and isinstance(record.get("files"), dict):
            files = dict(record["files"], **{name: {}})
    elif (path / "model.safetensors").is_file():
        try:
            record = json.loads(read_header(path / "model.safetensors")[1].get("__metadata__", {})["cuboid"])
            files = dict(record["files"], **{"model.safetensors": {}})
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, RecursionError):
            files = {}
    return {f: r for f, r in files.items() if isinstance(f, str)}


def foreign_entry(path: Path):
    """The first entry of the folder ``path`` that is neither a model file nor recorded by its commit, or None."""
    recorded = None
    for entry in sorted(path.iterdir()):
        if is_model_file(entry.name) and (entry.is_file() or entry.name.startswith(".")):
            continue
        if recorded is None:
            recorded = commit_record(path)
        if entry.name not in recorded or not entry.is_file():
            return entry.name + ("/" if entry.is_dir() else "")
    return None


def looks_like_checkpoint(path: Path) -> bool:
    """A folder :func:`begin` may replace: empty, or holding only model files and files its commit records."""
    return not path.is_dir() or foreign_entry(path) is None


def stale_files(path: Path) -> list:
    """The files of an earlier save in ``path`` that a single ``model.safetensors`` + ``config.json`` replaces:
    the model index first (the old set's commit file), then its shards (by the HF shard name, whichever index
    listed them), and the optimizer and trainer state an old cuboid commit recorded."""
    out = [path / INDEX] if (path / INDEX).is_file() else []
    out += sorted(p for p in path.iterdir() if _SHARD.fullmatch(p.name) and p.is_file())
    recorded = commit_record(path)
    out += sorted(path / f for f in recorded if (path / f).is_file() and (
        f in (OPTIMIZER_INDEX, TRAINER_STATE) or re.fullmatch(r"optimizer(-\d+-of-\d+)?\.safetensors", f)))
    return list(dict.fromkeys(out))


def real(path) -> Path:
    """``path`` absolute with every symbolic link resolved: saves replace the folder a link points to."""
    return Path(path).expanduser().resolve()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_tmp(path: Path) -> None:
    for sib in path.parent.iterdir():
        m = _TMP.match(sib.name)
        if m and m["name"] == path.name and sib.is_dir() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(sib, ignore_errors=True)


def begin(path: Path) -> Path:
    """Check ``path`` may be (re)placed (module docstring) and create the temporary folder beside it."""
    path = real(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder")
    other = foreign_entry(path) if path.is_dir() else None
    if other is not None:
        raise CheckpointError(f"refusing to replace {path}: it is not a checkpoint folder ({other} is not a model "
                              "file, and cuboid replaces only a folder it wrote or one of nothing but config, "
                              "weights, tokenizer and training state): move it out or save elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    hook("begin")
    return tmp


def commit(tmp: Path, path: Path) -> None:
    """Steps 1-3 of the protocol (module docstring)."""
    path = real(path)
    fsync_dir(tmp)
    hook("written")
    old = old_of(path)
    if path.is_dir():
        if old.exists():
            shutil.rmtree(old)  # stale: path itself is complete
        if any(path.iterdir()):
            os.rename(path, old)
            fsync_dir(path.parent)
            hook("moved-old")
        else:
            path.rmdir()
    os.rename(tmp, path)
    fsync_dir(path.parent)
    hook("committed")
    if old.exists():
        shutil.rmtree(old)
        fsync_dir(path.parent)
    hook("done")


def abort(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def resolve(path) -> Path:
    """The folder a load of ``path`` reads: ``path``, or ``{name}.old`` after a crash mid-replace (beside the
    folder a link ``path`` points to)."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a folder")
    old = old_of(real(path))
    if old.is_dir():
        warnings.warn(f"{path} is missing but {old.name} exists (a save was interrupted while replacing it): "
                      f"reading the previous checkpoint {old}", RuntimeWarning, stacklevel=3)
        return old
    raise FileNotFoundError(f"{path}: no such checkpoint folder")
