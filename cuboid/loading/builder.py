"""A zoo model on the meta device, cut for a plan: what :func:`cuboid.load` builds before it allocates,
and what the planner (:mod:`cuboid.loading.planner`) prices for each rank without allocating anything.

:func:`cut` shards a meta model for a plan's tensor mode and, under pipeline parallelism, keeps only the
rank's stages. :class:`ModelBuilder` wraps a preset name, a model folder or a zoo config into the callable
the planner takes: ``builder(plan, mesh)`` is the meta model that ``mesh.rank`` holds under ``plan``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import torch
from torch import nn

from cuboid.zoo import PRESETS, build, config_of, from_hf
import cuboid.zoo as zoo  # zoo.spec_of looked up at call time (a test swaps it)
from cuboid.zoo.plans import stage_costs
from cuboid.parallel import Mesh, Plan, shard
from cuboid.parallel.state import ParallelState, attach


def is_folder(source: Any) -> bool:
    """Whether ``source`` names a model folder (a local HF or cuboid checkpoint) rather than a preset."""
    return isinstance(source, (str, os.PathLike)) and os.path.isdir(source)


FOLDER_OVERRIDES = ("head", "num_labels")  # what a folder may be read with beside its own (cuboid.zoo.heads)


def check_source(source: Any, overrides: dict) -> None:
    """A one-sentence error for a path that is not there, or preset overrides given to a folder (beyond a new
    head: :data:`FOLDER_OVERRIDES`)."""
    if is_folder(source):
        foreign = sorted(set(overrides) - set(FOLDER_OVERRIDES))
        if foreign:
            raise ValueError(f"overrides {foreign} apply to presets, not to a checkpoint folder (a folder takes "
                             f"{' and '.join(FOLDER_OVERRIDES)}: a new classification head)")
    elif isinstance(source, str) and source not in PRESETS and (os.sep in source or source.startswith(".")):
        raise FileNotFoundError(f"{source}: no such model folder")


def cut(model: nn.Module, plan: Plan, mesh: Mesh) -> nn.Module:
    """``model`` (on meta) sharded for ``plan``'s tensor mode and, under pp, cut to ``mesh.rank``'s stages
    (blocks balanced with the embedding and head costs)."""
    model = shard(model, plan, mesh, zoo.spec_of(model))
    if plan.pp > 1:
        from cuboid.parallel.stages import cut_model

        cut_model(model, zoo.spec_of(model), mesh, stage_costs(model.config))
    return model


@dataclass
class ModelBuilder:
    """Builds ``source`` (a preset name, a model folder or a zoo config) on the meta device for a plan.

    ``builder(plan, mesh)`` returns the meta model rank ``mesh.rank`` of ``plan`` holds (default mesh:
    rank 0's layout, no process group), carrying its parallel state; parameters are cast to ``dtype``.
    ``overrides`` change preset fields. ``config`` is the model's config, read without weights.
    """

    source: Any
    dtype: Optional[torch.dtype] = None
    overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from cuboid.loading.hub import locate

        self.source = locate(self.source)  # a hub id: its folder in the Hugging Face cache
        check_source(self.source, self.overrides)

    @property
    def name(self) -> str:
        """How messages name the model: the preset or folder, or the config's class."""
        return os.fspath(self.source) if isinstance(self.source, (str, os.PathLike)) else type(self.source).__name__

    @cached_property
    def config(self):
        if is_folder(self.source):
            return from_hf(self.source, device="meta", **self.overrides).config
        return config_of(self.source, **self.overrides)

    def __call__(self, plan: Plan, mesh: Optional[Mesh] = None) -> nn.Module:
        mesh = mesh if mesh is not None else Mesh.layout(plan)
        if is_folder(self.source):
            model = from_hf(self.source, dtype=self.dtype, device="meta", transform=lambda m: cut(m, plan, mesh),
                            **self.overrides)
        else:
            model = cut(build(self.source, **self.overrides), plan, mesh)
            if self.dtype is not None:
                model = model.to(self.dtype)
        attach(model, ParallelState(plan=plan, mesh=mesh, spec=zoo.spec_of(model)))
        return model
