"""What a plan made of a model: one typed object, ``model.parallel``.

:func:`~cuboid.parallel.prepare` (and ``cuboid.load`` for a meta model that
only carries its plan) sets it in one place, :func:`attach`; every reader
goes through :func:`state_of`, which also answers for a model cuboid never
prepared (a plain ``zoo.build`` model, a user's own module): one device.

Fields hold only what the plan built: ``stages`` once a pp plan cut the
model, ``pipeline`` under pp, ``zero`` for the flat ZeRO-1/2 buckets,
``sequence_split`` under sp or ``tp_sequence``, ``batch_split`` under the
tensor modes that cut the batch (2D, 2.5D, 3D). The state also replaces the
model's ``forward`` where the plan runs it another way (:meth:`ParallelState.install_forward`)
and turns the dp gradient reduction on and off (:meth:`ParallelState.set_gradient_sync`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from .mesh import Mesh
from .plan import Plan

ATTRIBUTE = "parallel"  # the one attribute a prepared model carries


@dataclass
class ParallelState:
    """A model's plan, mesh and the parallel parts its plan built (None where the plan has none)."""

    plan: Plan
    mesh: Mesh
    spec: Any = None            # the model's ShardingSpec (None for models without one)
    prepared: bool = False      # prepare ran: the model trains under the plan (False: shapes only, meta)
    stages: Any = None          # pp: the block range of every pipeline stage (parallel.stages.cut_model)
    pipeline: Any = None        # parallel.pipeline.Pipeline under pp
    zero: Any = None            # parallel.zero.FlatShards under ZeRO-1/2
    expert_zero: Any = None     # ep under ZeRO-1/2: the experts' FlatShards over edp
    expert_grads: Any = None    # ep under plain dp: parallel.experts.ExpertGrads (their edp reduction)
    sequence_split: Any = None  # parallel.sequence_split.SequenceSplit / TensorSequenceSplit
    batch_split: Any = None     # parallel.batch.BatchSplit under 2D / 2.5D / 3D
    gradient_sync: Optional[Callable[[bool], None]] = None  # turns the dp gradient reduction on / off
    # mixture of experts under dp: the router statistics of a forward summed over dp x sp (experts.BalanceReduce)
    balance_reduce: Optional[Callable] = None

    @classmethod
    def single(cls) -> "ParallelState":
        """One device: the default plan and a mesh without process groups."""
        plan = Plan()
        return cls(plan=plan, mesh=Mesh.layout(plan))

    def install_forward(self, model: nn.Module) -> None:
        """Make ``model(**batch)`` run the way the plan built: through the pipeline (pp: a forward without
        gradients, :meth:`~cuboid.parallel.pipeline.Pipeline.model_forward`) or the sequence split (sp,
        ``tp_sequence``); the model's own ``forward`` otherwise. Set on the instance, so the model keeps
        its class, its hooks and its parameter names."""
        if self.pipeline is not None:
            model.forward = self.pipeline.model_forward
        elif self.sequence_split is not None:
            model.forward = self.sequence_split.forward

    def set_gradient_sync(self, enabled: bool) -> None:
        """Turn the dp gradient reduction of the next backward on or off (a no-op without one)."""
        if self.gradient_sync is not None:
            self.gradient_sync(enabled)


def attach(model: nn.Module, state: ParallelState) -> ParallelState:
    """Give ``model`` its state (replacing any earlier one); returns it.

    A pipeline cut is part of the model's structure: a state for the same plan
    that names no ``stages`` keeps those of the state it replaces.
    """
    if not isinstance(state, ParallelState):
        raise TypeError(f"a model's parallel state is a ParallelState, got {type(state).__name__}")
    before = planned(model)
    if state.stages is None and before is not None and before.plan == state.plan:
        state.stages = before.stages
    object.__setattr__(model, ATTRIBUTE, state)  # a plain attribute: never a submodule or a parameter
    return state


def state_of(model: nn.Module) -> ParallelState:
    """``model``'s parallel state; a model cuboid never planned is on one device."""
    state = model.__dict__.get(ATTRIBUTE)
    if state is None:
        return ParallelState.single()
    if not isinstance(state, ParallelState):
        raise TypeError(f"{type(model).__name__}.{ATTRIBUTE} is a {type(state).__name__}, not a ParallelState")
    return state


def planned(model: nn.Module) -> Optional[ParallelState]:
    """``model``'s state if a plan was given to it (load / prepare), else None."""
    state = model.__dict__.get(ATTRIBUTE)
    return state if isinstance(state, ParallelState) else None


def balance_reduce_of(model: nn.Module) -> Optional[Callable]:
    """The plan's reduction of a mixture of experts' router statistics (:attr:`ParallelState.balance_reduce`),
    or None: unplanned, or each forward's tokens on one rank."""
    state = planned(model)
    return state.balance_reduce if state is not None else None
