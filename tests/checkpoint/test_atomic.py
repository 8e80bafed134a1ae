"""Crash safety: a save killed (SIGKILL) at any stage leaves the previous checkpoint loadable.

Each child process saves a seed-1 model over a seed-0 checkpoint and kills
itself (SIGKILL) at one stage of the protocol (zoo/checkpoint/folder.py); all
children run at once, forked from the test's process (a new interpreter would
import torch and cuboid before the same save).
Then the folder must still verify and load (the old weights, or the new ones
once the rename happened), no partial temporary folder may pass verify, and
the next save must succeed and clean up.
"""
import multiprocessing
import warnings

import pytest
import torch

import cuboid
from cuboid.zoo import checkpoint
from cuboid.zoo.checkpoint import CheckpointError
from cuboid.zoo.checkpoint.folder import old_of

from ._child import crash
from .common import assert_same, params

# stage -> which checkpoint `path` must hold afterwards
STAGES = {"begin": 0, "file#1": 0, "file#4": 0, "written": 0, "moved-old": 0, "committed": 1}
PARTIAL = ("begin", "file#1", "file#4")  # later, the temporary folder is complete (just not in place)


def _crash(path, stage):
    """A child's body: _child.py's ``crash`` (a seed-1 save over ``path``, killed at ``stage``), on the torch
    kernels a child process uses."""
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        crash(path, stage, 1)


def _killed_saves(paths: dict) -> dict:
    """stage -> the exit code of its child (-9: killed by its own SIGKILL; 3: the stage never came), all at once."""
    ctx = multiprocessing.get_context("fork")
    procs = {stage: ctx.Process(target=_crash, args=(path, stage)) for stage, path in paths.items()}
    for p in procs.values():
        p.start()
    for p in procs.values():
        p.join(timeout=120)
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join()
    return {stage: p.exitcode for stage, p in procs.items()}


def leftovers(path):
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.tmp-"))


def test_killed_save_leaves_the_previous_checkpoint(tmp_path):
    models = {s: cuboid.load("gpt-debug", seed=s) for s in (0, 1, 2)}
    paths = {stage: tmp_path / stage.replace("#", "") / "ckpt" for stage in STAGES}
    for path in paths.values():
        checkpoint.save(models[0], path, max_shard_size="100KB", state={"step": 0})
    results = _killed_saves(paths)
    for stage, expect in STAGES.items():
        rc = results[stage]
        assert rc == -9, f"{stage}: child exited {rc}, not killed at the stage"
        path = paths[stage]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint.verify(path)
            model = cuboid.load("gpt-debug", seed=5)
            checkpoint.load(model, path)
            state = checkpoint.load_training_state(path, model, rng=False)
        assert (stage == "moved-old") == any(old_of(path).name in str(w.message) for w in caught), stage
        assert state["step"] == expect, stage
        assert_same(params(model), params(models[expect]))
        for tmp in leftovers(path):
            if stage in PARTIAL:  # killed before its commit file: never passes for complete
                with pytest.raises((CheckpointError, FileNotFoundError)):
                    checkpoint.verify(tmp)
        # the next save succeeds and leaves no debris
        checkpoint.save(models[2], path, max_shard_size="100KB")
        assert not leftovers(path) and not old_of(path).exists(), stage
        fresh = cuboid.load("gpt-debug", seed=5)
        checkpoint.load(fresh, path, verify=True)
        assert_same(params(fresh), params(models[2]))


def test_failed_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """An I/O error mid-save (here: on the third file) is raised, and cleans up its temporary folder."""
    from cuboid.zoo.checkpoint import folder as folder_mod

    path = checkpoint.save(cuboid.load("gpt-debug", seed=0), tmp_path / "c", max_shard_size="100KB")
    n = {"files": 0}

    def hook(stage):
        if stage.startswith("file:"):
            n["files"] += 1
            if n["files"] == 3:
                raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder_mod, "hook", hook)
    with pytest.raises(OSError, match="No space left"):
        checkpoint.save(cuboid.load("gpt-debug", seed=1), path, max_shard_size="100KB")
    assert not leftovers(path)
    model = cuboid.load("gpt-debug", seed=5)
    checkpoint.load(model, path, verify=True)
    assert torch.equal(model.tok_emb.weight, cuboid.load("gpt-debug", seed=0).tok_emb.weight)
