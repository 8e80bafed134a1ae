"""Which checkpoint a fine-tune resumes from, agreed by every rank.

Saves go to a hidden temporary folder renamed into place when complete
(:mod:`cuboid.zoo.checkpoint.folder`), so an interrupted save never matches ``checkpoint-*``;
:func:`complete` also skips folders a crash left half-deleted. Under torch's elastic launcher a
restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, :func:`restart_count`) resumes from the newest
complete checkpoint by itself. Rank 0 decides and reads (:func:`decided_on_rank0`), so no two ranks
resume differently and the checksums are read once.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from cuboid.parallel import Mesh, comm


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


def resolve_resume(resume: Optional[str], out: Path) -> Optional[Path]:
    """The folder to resume from. 'latest' is the newest complete ``checkpoint-<step>`` (None if none)."""
    if resume in (None, "", "none"):
        return None
    if resume == "latest":
        found = [p for p in checkpoints(out) if complete(p)]
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


def agreed_resume(resume: Optional[str], out: Path, mesh: Mesh) -> Optional[Path]:
    """:func:`resolve_resume` decided on rank 0 and sent to every rank."""
    found = decided_on_rank0(mesh, lambda: resolve_resume(resume, out))
    return None if found is None else Path(found)


def resume_folder(resume: Optional[str], out: Path, mesh: Mesh, restart: int) -> Optional[Path]:
    """The checkpoint this attempt resumes from: ``resume`` on the first attempt; a restart takes the newest
    complete one in ``out`` (``resume`` when there is none)."""
    if restart == 0:
        return agreed_resume(resume, out, mesh)
    return agreed_resume("latest", out, mesh) or agreed_resume(resume, out, mesh)


def verify_once(ckpt, path: Path, mesh: Mesh) -> None:
    """``ckpt.verify(path)`` on rank 0 (one read of every byte, not one per rank); every rank raises its error."""
    try:
        decided_on_rank0(mesh, lambda: ckpt.verify(path) and None, errors=(ValueError, OSError))
    except ValueError as e:  # CheckpointError is a ValueError; the other ranks hear of it too
        raise ckpt.CheckpointError(e.args[0]) from None


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
    A full checkpoint has every file checked against its SHA-256 first; ``lora``: the adapters only."""
    if lora:
        from cuboid.zoo.lora import load_checkpoint as load_adapters

        return load_adapters(model, path, optimizer=optimizer, scheduler=scheduler)
    from cuboid.zoo import checkpoint as ckpt

    verify_once(ckpt, path, mesh)  # before any value is used
    ckpt.load(model, path)
    return ckpt.load_training_state(path, model, optimizer=optimizer, scheduler=scheduler)["state"]
