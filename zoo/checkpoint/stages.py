"""Checkpoints of pipeline-parallel models: who writes what, and what a stage model lacks on purpose.

Under a plan with ``pp > 1`` a rank's model holds only its stages' layers;
the others stand as placeholder modules (``placeholder = True``, no
parameters) so the kept ones keep their single-device names. A save then has
no rank that holds every tensor, and none gathers the model:

- every rank describes its sources (names, shapes, dtypes: no data) and one
  ``all_gather_object`` gives every rank every stage's description, so all
  plan the same files (:func:`plan_stages`): each stage's tensors are split
  into files of their own (HF's splitter, per stage), numbered across stages
  (``model-0000i-of-0000N.safetensors``, always with an index). A tensor held
  by several stages (GPT's tied token embedding, on the first and the last
  stage) is planned once, for the first stage that holds it;
- each stage's files are written by its own writer, the rank with pp
  coordinate s and every other coordinate 0; the ranks of that writer's
  replica (``dp`` = ``sp`` = 0, every tensor rank) fetch the stage's tensors
  in plan order, so the tensor-parallel gathers run inside the stage as they
  do without a pipeline; other data-parallel replicas fetch nothing, unless
  the plan shards over dp (ZeRO, or experts over ``ep``): then every rank
  fetches, since the gathers run over groups that span the replicas;
- rank 0 (a writer) opens the temporary folder, gathers every writer's file
  records, writes config, optimizer index, training state and the model
  index last, and commits (:mod:`.folder`), as in a save without stages.

:func:`elsewhere` tells a loader that a parameter lies under a placeholder,
so it is neither missing nor unexpected on that rank: each rank reads only
its stages' tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cuboid.parallel.state import state_of

from .format import CheckpointError
from .shards import ShardPlan, Size, Source, meta, plan_shards


def elsewhere(model: torch.nn.Module, name: str) -> bool:
    """Whether the parameter ``name`` lies under a placeholder module (another pipeline stage's)."""
    mod = model
    for part in name.split(".")[:-1]:
        mod = mod._modules.get(part) if isinstance(mod, torch.nn.Module) else None
        if mod is None:
            return False
        if getattr(mod, "placeholder", False):
            return True
    return False


@dataclass(frozen=True)
class StageLayout:
    """This rank's part in a save: ``stages`` pp ranks, this one's ``stage``, whether it fetches / writes."""

    stages: int = 1
    stage: int = 0
    fetches: bool = True
    writes: bool = False


def stage_layout(model: torch.nn.Module, rank: int) -> StageLayout:
    state = state_of(model)
    mesh = state.mesh
    pp = mesh.size("pp")
    if pp <= 1:
        return StageLayout(writes=rank == 0)
    coords = mesh.coords
    replica = coords.get("dp", 0) == 0 and coords.get("sp", 0) == 0
    # under ZeRO a whole tensor is assembled over dp (x sp) from every rank's piece, and under ep an expert
    # tensor over the ep ranks taken from dp (x sp): then every rank fetches (the plan decides, never the rank)
    sharded = state.plan.zero > 0 or state.plan.ep > 1
    return StageLayout(stages=pp, stage=coords["pp"], fetches=replica or sharded,
                       writes=replica and coords.get("tp", 0) == 0)


Description = List[Tuple[Tuple[str, ...], Tuple[Tuple[tuple, torch.dtype], ...]]]


def describe(sources: Sequence[Source]) -> Description:
    """The sources' names, shapes and dtypes (what planning needs), picklable."""
    return [(tuple(s.names), tuple((tuple(m.shape), m.dtype) for m in s.metas)) for s in sources]


def plan_stages(described: Sequence[Description], stem: str, max_shard_size: Size) -> Tuple[ShardPlan, Dict[str, int]]:
    """One plan over every stage's sources (``described[s]``): each stage's own files, numbered across
    stages; a name held by several stages is planned for the first. Returns the plan and file -> stage."""
    planned: set = set()
    per_stage: List[List[List[str]]] = []
    metas: Dict[str, torch.Tensor] = {}
    total = 0
    for s, desc in enumerate(described):
        mine = []
        for names, shapes in desc:
            held = [n in planned for n in names]
            if all(held):
                continue  # a tied tensor, planned for an earlier stage
            if any(held):
                raise CheckpointError(f"stage {s}: tensors {', '.join(names)} are fetched together but "
                                      "partly planned for an earlier stage")
            planned.update(names)
            mine.append(Source(names, tuple(meta(shape, dtype) for shape, dtype in shapes), lambda: ()))
        if not mine:
            per_stage.append([])
            continue
        sub = plan_shards(mine, stem, max_shard_size)
        metas.update(sub.metas)
        total += sub.total_size
        per_stage.append(list(sub.files.values()))
    count = sum(len(files) for files in per_stage)
    files: Dict[str, List[str]] = {}
    owner: Dict[str, int] = {}
    for s, stage_files in enumerate(per_stage):
        for names in stage_files:
            fname = f"{stem}-{len(files) + 1:05d}-of-{count:05d}.safetensors"
            files[fname], owner[fname] = names, s
    if not files:  # nothing to store: one empty file, as a save without stages writes
        fname = f"{stem}-00001-of-00001.safetensors"
        files[fname], owner[fname] = [], 0
    weight_map = {n: f for f, names in files.items() for n in names}
    return ShardPlan(files=files, weight_map=weight_map, total_size=total, metas=metas), owner


def stage_part(plan: ShardPlan, owner: Dict[str, int], stage: int) -> ShardPlan:
    """The files of ``plan`` that ``stage`` writes."""
    files = {f: names for f, names in plan.files.items() if owner[f] == stage}
    return ShardPlan(files=files, weight_map={n: f for f, ns in files.items() for n in ns},
                     total_size=plan.total_size, metas=plan.metas)


def merge_optimizer_info(infos: Sequence[Optional[dict]]) -> Optional[dict]:
    """One optimizer record from every stage's (``optimizer_sources``'s second value), in stage order.

    Param groups are matched by position; their params are the stages' names
    in stage order, a tied parameter once; hyperparameters must agree.
    """
    infos = [i for i in infos if i is not None]
    if not infos:
        return None
    first = infos[0]
    classes = {i["class"] for i in infos}
    if len(classes) > 1:
        raise CheckpointError(f"pipeline stages hold different optimizers: {', '.join(sorted(classes))}")
    counts = {len(i["param_groups"]) for i in infos}
    if len(counts) > 1:
        raise CheckpointError(f"pipeline stages' optimizers have different numbers of param groups: {sorted(counts)}")
    groups = []
    for gi, group in enumerate(first["param_groups"]):
        hyper = {k: v for k, v in group.items() if k != "params"}
        params: Dict[str, None] = {}  # ordered, each name once
        for s, info in enumerate(infos):
            other = info["param_groups"][gi]
            if {k: v for k, v in other.items() if k != "params"} != hyper:
                raise CheckpointError(f"param group {gi}: pipeline stage {s}'s hyperparameters differ from "
                                      "stage 0's")
            params.update(dict.fromkeys(other["params"]))
        groups.append({**hyper, "params": list(params)})
    state: Dict[str, dict] = {}
    tensors: Dict[str, list] = {}
    for info in infos:
        for name, v in info["state"].items():
            state.setdefault(name, v)
        for name, v in info["tensors"].items():
            tensors.setdefault(name, v)
    return {"class": first["class"], "param_groups": groups, "state": state, "tensors": tensors}
