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

A folder at ``path`` that does not look like a checkpoint (files, but no
``config.json`` / model weights) is never replaced: that is an error.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Callable

from .format import CheckpointError

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


def looks_like_checkpoint(path: Path) -> bool:
    return any((path / f).is_file() for f in ("config.json", "model.safetensors", "model.safetensors.index.json"))


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
    """Check ``path`` may be (re)placed and create the temporary folder beside it."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not looks_like_checkpoint(path):
        raise CheckpointError(f"refusing to replace {path}: it is not a checkpoint folder "
                              "(no config.json or model weights)")
    path.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    hook("begin")
    return tmp


def commit(tmp: Path, path: Path) -> None:
    """Steps 1-3 of the protocol (module docstring)."""
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
    """The folder a load of ``path`` reads: ``path``, or ``{name}.old`` after a crash mid-replace."""
    path = Path(path)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is not a folder")
    old = old_of(path)
    if old.is_dir():
        warnings.warn(f"{path} is missing but {old.name} exists (a save was interrupted while replacing it): "
                      f"reading the previous checkpoint {old}", RuntimeWarning, stacklevel=3)
        return old
    raise FileNotFoundError(f"{path}: no such checkpoint folder")
