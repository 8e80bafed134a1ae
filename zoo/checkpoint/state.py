"""Optimizer and training state for exact resume: what a save records (:mod:`.resume` reads it back).

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
(:mod:`.resume`) through the layer's ``local_part(name, sliceable)`` (packed
segments, padding) or, without one, ``shard_slices``; a layer without ``full_tensor_like`` is an
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
import random
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from cuboid.parallel import zero
from cuboid.parallel.plan import Plan
from cuboid.parallel.state import state_of

from ..common import sharded_parameters
from .format import CheckpointError
from .shards import Source, meta

FORMAT = "cuboid-training-state"  # trainer_state.json's "format"


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


def parameters_by_id(model: torch.nn.Module) -> Dict[int, tuple]:
    """id(parameter) -> (zoo name, owning layer, its local name), for the parameters the optimizer holds."""
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
    names = parameters_by_id(model)
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
    plan = state_of(model).plan
    if plan == Plan():  # no plan, or the default one
        return {"name": "single" if world == 1 else "dp", "dp": world}
    return jsonable(plan.to_dict(), "plan")


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
