"""Optimizer and training state for exact resume.

Beside the model files a training checkpoint holds:

- ``optimizer-0000i-of-0000N.safetensors`` + ``optimizer.safetensors.index.json``
  (always an index, even for one file: its metadata carries the rest):
  every tensor of the optimizer state as a *full* tensor under
  ``{zoo parameter name}/{state key}`` (``blocks.0.attn.qkv.weight/exp_avg``,
  ``.../exp_avg_sq``, ``.../momentum_buffer``, ``.../master``), so it loads into
  any plan the way parameters do; the index metadata ``optimizer`` holds the
  class name, the param groups (hyperparameters, params as zoo names) and the
  non-tensor state per parameter (cuboid's integer ``step``).
- ``trainer_state.json``: ``step``, the scheduler's ``state_dict()``, the RNG
  states of every rank (torch CPU and CUDA, python ``random``, numpy), the
  caller's opaque ``state`` dict (data position), the plan, the zoo config and
  the world size.

Optimizer state of a parameter whose shard is smaller than its full shape
(tensor-parallel modes) is gathered by the layer's ``full_tensor_like(name,
local)`` (a collective: every rank calls it in the same order) and read back
through the layer's ``local_part(name, sliceable)`` (packed segments, padding)
or, without one, ``shard_slices``; a layer without ``full_tensor_like`` is an
error at planning time. Single-device and data-parallel runs (every rank a
full replica) need nothing more. Under pipeline parallelism each stage
writes the state of its own parameters (:mod:`.stages`), the index records
every stage's param groups merged by position, and a load matches state by
parameter name, so a checkpoint resumes under another pp layout or on one
device. ZeRO-sharded state (:mod:`cuboid.parallel.zero`) is saved whole too:
each parameter's pieces are assembled over dp before the tensor-parallel
gather, and a load keeps this rank's piece, so a checkpoint moves between ZeRO
stages, dp sizes and plans without ZeRO.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import random
import warnings
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from cuboid.parallel import zero

from ..common import sharded_parameters
from .folder import resolve
from .format import CheckpointError
from .planner import Source, meta
from .reader import TensorFolder
from .stages import elsewhere

TRAINER_STATE = "trainer_state.json"
FORMAT = "cuboid-training-state"


def dist_info() -> Tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def jsonable(v: Any, what: str) -> Any:
    """A JSON value for ``v`` (tuples become lists, 1-element tensors numbers), or an error naming ``what``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x, what) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x, f"{what}.{k}") for k, x in v.items()}
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    if isinstance(v, np.generic):
        return v.item()
    raise CheckpointError(f"{what}: a {type(v).__name__} cannot be stored in a checkpoint (JSON values only)")


def _restore_type(saved: Any, current: Any) -> Any:
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def _names(model: torch.nn.Module) -> Dict[int, tuple]:
    zero.reshard(model)  # the parameters the optimizer holds (ZeRO-3 after an evaluation forward)
    return {id(p): (name, mod, local) for name, mod, local, p in sharded_parameters(model)}


# --------------------------------------------------------------------- optimizer


def _fetch_state(mod, local: str, v: torch.Tensor, sharded: bool, p: torch.Tensor, piece):
    def fetch() -> List[torch.Tensor]:
        whole = zero.full_local(p, v, piece) if piece is not None else v  # ZeRO: every dp rank's piece
        full = mod.full_tensor_like(local, whole) if sharded else whole
        return [full.detach().cpu().contiguous()]

    return fetch


def optimizer_sources(model: torch.nn.Module, optimizer) -> Tuple[List[Source], dict]:
    """The optimizer's tensors as sources (full shapes) and the JSON record of the rest."""
    names = _names(model)
    groups, scalars, tensor_keys, sources = [], {}, {}, []
    for gi, g in enumerate(optimizer.param_groups):
        gnames = []
        for p in g["params"]:
            if id(p) not in names:
                raise CheckpointError(f"optimizer param group {gi} holds a tensor {tuple(p.shape)} that is not "
                                      "a parameter of the model")
            name, mod, local = names[id(p)]
            gnames.append(name)
            piece = zero.view_of(p)
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if not torch.is_tensor(v):
                    scalars.setdefault(name, {})[key] = jsonable(v, f"optimizer state {name}/{key}")
                    continue
                if piece is not None and tuple(v.shape) != tuple(piece.shape):
                    raise CheckpointError(f"{name}/{key}: state {tuple(v.shape)} is not this rank's ZeRO piece "
                                          f"{tuple(piece.shape)}")
                like = piece is not None or tuple(v.shape) == tuple(p.shape)
                full = tuple(mod.full_shape(local)) if like else tuple(v.shape)
                sharded = like and full != tuple(p.shape)
                if sharded and not hasattr(mod, "full_tensor_like"):
                    raise CheckpointError(f"{name}/{key}: optimizer state of a sharded parameter needs "
                                          f"{type(mod).__name__}.full_tensor_like(name, local)")
                sources.append(Source((f"{name}/{key}",), (meta(full, v.dtype),),
                                      _fetch_state(mod, local, v, sharded, p, piece)))
                tensor_keys.setdefault(name, []).append(key)
        groups.append({**{k: jsonable(v, f"param group {gi}.{k}") for k, v in g.items() if k != "params"},
                       "params": gnames})
    return sources, {"class": type(optimizer).__name__, "param_groups": groups, "state": scalars,
                     "tensors": tensor_keys}


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
    names = _names(model)
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


# ---------------------------------------------------------------------------- RNG


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict:
    """This process's RNG states as JSON: torch CPU (+ every CUDA device in use), python, numpy."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out = {"torch": _b64(torch.get_rng_state()), "python": [version, list(mt), gauss],
           "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(d: dict) -> None:
    torch.set_rng_state(_unb64(d["torch"]))
    version, mt, gauss = d["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = d["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if d.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in d["cuda"]])


def gather_rng(world: int) -> List[dict]:
    """Every rank's RNG state, on every rank (a collective when distributed)."""
    mine = rng_state()
    if world == 1:
        return [mine]
    import torch.distributed as dist

    out: List[Optional[dict]] = [None] * world
    dist.all_gather_object(out, mine)
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------- training state


def _plan_record(model: torch.nn.Module, world: int) -> Any:
    plan = getattr(model, "plan", None)
    if plan is None or (dataclasses.is_dataclass(plan) and plan == type(plan)()):  # no plan, or the default one
        return {"name": "single" if world == 1 else "dp", "dp": world}
    if hasattr(plan, "to_dict"):
        return jsonable(plan.to_dict(), "plan")
    if dataclasses.is_dataclass(plan):
        return jsonable(dataclasses.asdict(plan), "plan")
    return str(plan)


def training_record(model, optimizer, scheduler, state: Optional[dict], world: int) -> dict:
    """trainer_state.json's content. Collective (gathers every rank's RNG state)."""
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"state must be a dict of JSON values, got {type(state).__name__}")
    user = jsonable(state or {}, "state")
    sched = jsonable(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    step = user.get("step")
    if step is None and optimizer is not None:
        steps = [st["step"] for st in optimizer.state.values() if "step" in st]
        step = max((int(s) for s in steps), default=0)
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dataclasses.asdict(model.config)
    return {"format": FORMAT, "version": 1, "step": step, "state": user, "scheduler": sched,
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "rng": gather_rng(world), "world_size": world, "plan": _plan_record(model, world),
            "config": jsonable(config, "config")}


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
    try:
        rec = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    if rec.get("format") != FORMAT:
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
