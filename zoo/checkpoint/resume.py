"""Reading optimizer and training state back for an exact resume (what :mod:`.state` records).

:func:`load_optimizer` opens the optimizer files with the reader's
:class:`~.reader.TensorFolder` and gives each rank its parameters' parts: a
tensor-parallel layer's ``local_part(name, sliceable)`` (packed segments,
padding) or, without one, its ``shard_slices``; a ZeRO rank keeps its dp
piece; a pipeline stage loads the state of its own parameters only.
:func:`load_training_state` adds the scheduler and this rank's RNG states.

Its own module so that the writer, which needs only the recording side
(:mod:`.state`), never reaches the reader.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from cuboid.parallel import zero

from .folder import resolve
from .format import TRAINER_STATE, CheckpointError, parse_json
from .reader import TensorFolder
from .stages import elsewhere
from .state import FORMAT, dist_info, jsonable, parameters_by_id, set_rng_state


def _restore_type(saved: Any, current: Any) -> Any:
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _local_part(mod, local: str, sl, what: str) -> torch.Tensor:
    """This rank's local tensor, shaped like the parameter, from a lazy slice of the full one.

    The tensor modes' ``local_part`` assembles packed segments (a list of
    slice tuples) and zero padding; a plain tuple of slices is read directly.
    """
    if hasattr(mod, "local_part"):
        return mod.local_part(local, sl)
    slices = mod.shard_slices(local)
    if not isinstance(slices, tuple):
        raise CheckpointError(f"{what}: {type(mod).__name__}.shard_slices is not one tuple of slices; "
                              "the layer needs local_part(name, full)")
    return sl[slices]


def load_optimizer(root, model: torch.nn.Module, optimizer) -> None:
    """Restore ``optimizer`` from the checkpoint, each rank reading its parameters' slices.

    Param groups are matched by position and their parameters by name; a
    pipeline stage model loads the state of its own parameters only.
    """
    ts = TensorFolder(root, "optimizer")
    info = ts.metadata.get("optimizer")
    if not isinstance(info, dict):
        raise CheckpointError(f"{ts.index_path}: no optimizer record in the index metadata")
    if info["class"] != type(optimizer).__name__:
        raise CheckpointError(f"{root}: the checkpoint holds {info['class']} state, not {type(optimizer).__name__}")
    names = parameters_by_id(model)
    saved_groups, cur_groups = info["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(cur_groups):
        raise CheckpointError(f"{root}: {len(saved_groups)} optimizer param groups saved, {len(cur_groups)} now")
    groups, state, idx = [], {}, 0
    for gi, (saved, cur) in enumerate(zip(saved_groups, cur_groups)):
        cur_names = [names[id(p)][0] if id(p) in names else "<not a model parameter>" for p in cur["params"]]
        # state is matched by name: the order may differ (stages saved in stage order); names of
        # another pipeline stage's layers are that stage's to load
        want = {n for n in saved["params"] if not elsewhere(model, n)}
        if set(cur_names) != want or len(set(cur_names)) != len(cur_names):
            diff = sorted(set(cur_names) ^ want) or ["(a parameter listed twice)"]
            raise CheckpointError(f"{root}: optimizer param group {gi} differs from the checkpoint's: "
                                  f"{', '.join(diff[:8])}")
        group = {k: _restore_type(v, cur.get(k)) for k, v in saved.items() if k != "params"}
        group["params"] = list(range(idx, idx + len(cur_names)))
        groups.append(group)
        for j, p in enumerate(cur["params"]):
            name, mod, local = names[id(p)]
            st = dict(info["state"].get(name, {}))
            for key in info["tensors"].get(name, []):
                stored = f"{name}/{key}"
                shape, _ = ts.shape_dtype(stored)
                full = tuple(mod.full_shape(local))
                if shape == full and full != tuple(p.shape):  # sharded parameter: this rank's part only
                    st[key] = _local_part(mod, local, ts.get_slice(stored), stored)
                else:
                    st[key] = ts.get_tensor(stored)
                if shape == full and tuple(st[key].shape) != tuple(p.shape):
                    raise CheckpointError(f"{stored}: checkpoint {tuple(st[key].shape)}, parameter {tuple(p.shape)}")
                if shape == full and zero.view_of(p) is not None:  # ZeRO: this dp rank's piece
                    st[key] = zero.piece_of(p, st[key])
            if st:
                state[idx + j] = st
        idx += len(cur_names)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_training_state(path, model: torch.nn.Module, optimizer=None, scheduler=None, *, rng: bool = True) -> dict:
    """Restore optimizer, scheduler and this rank's RNG states saved by ``save(..., optimizer=, state=)``.

    Load the model weights first (:func:`load`): optimizers take fp32 masters
    from the checkpoint, not from the parameters. RNG states are restored only
    when the world size matches the saved one (rank r gets rank r's states);
    otherwise a warning says resume is not exact. Returns
    ``{"step", "state", "plan", "config", "world_size", "rng_restored"}`` where
    ``state`` is the dict given to ``save``.
    """
    root = resolve(path)
    file = root / TRAINER_STATE
    if not file.is_file():
        raise CheckpointError(f"{root}: no {TRAINER_STATE} (saved without optimizer/state?)")
    rec = parse_json(file.read_bytes(), file)
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a cuboid training state")
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else None
    if config is not None and jsonable(config, "config") != rec.get("config"):
        warnings.warn(f"{root}: the model's config differs from the checkpoint's", RuntimeWarning, stacklevel=2)
    if optimizer is not None:
        load_optimizer(root, model, optimizer)
    if scheduler is not None:
        if rec.get("scheduler") is None:
            raise CheckpointError(f"{root}: no scheduler state was saved")
        scheduler.load_state_dict(rec["scheduler"])
    rank, world = dist_info()
    restored = False
    if rng:
        if world == rec.get("world_size") and rank < len(rec.get("rng", [])):
            set_rng_state(rec["rng"][rank])
            restored = True
        else:
            warnings.warn(f"{root}: saved by {rec.get('world_size')} ranks, loading on {world}: RNG states not "
                          "restored, resume is not bit-exact", RuntimeWarning, stacklevel=2)
    return {"step": rec.get("step"), "state": rec.get("state", {}), "plan": rec.get("plan"),
            "config": rec.get("config"), "world_size": rec.get("world_size"), "rng_restored": restored}
