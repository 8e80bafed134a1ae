"""The one parallel state a model carries (``model.parallel``): set in one place, read through ``state_of``."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_a_model_never_planned_is_on_one_device():
    from cuboid import zoo
    from cuboid.parallel import Plan, planned, state_of

    model = zoo.build("gpt-debug")
    assert planned(model) is None
    state = state_of(model)
    assert state.plan == Plan() and state.mesh.world_size == 1 and not state.prepared
    assert state.pipeline is state.zero is state.sequence_split is state.batch_split is None
    state.set_gradient_sync(False)  # nothing to switch: a no-op


def test_prepare_attaches_one_state():
    import cuboid
    from cuboid.parallel import ParallelState, Plan, planned

    model = cuboid.load("gpt-debug", "checkpoint=selective")
    state = planned(model)
    assert isinstance(state, ParallelState) and state.prepared and model.parallel is state
    assert state.plan == Plan(checkpoint="selective") and state.spec is not None
    assert "parallel" not in dict(model.named_modules()) and "parallel" not in model.state_dict()
    assert all(b._cuboid_checkpointed == "selective" for b in model.blocks)


def test_attach_checks_its_argument_and_keeps_the_cut():
    from cuboid import zoo
    from cuboid.parallel import Mesh, ParallelState, Plan, state_of
    from cuboid.parallel.state import attach

    model = zoo.build("gpt-debug")
    with pytest.raises(TypeError, match="ParallelState"):
        attach(model, {"plan": Plan()})
    plan = Plan(pp=2, microbatches=2)
    mesh = Mesh.layout(plan)
    cut = [range(0, 1), range(1, 2)]
    attach(model, ParallelState(plan=plan, mesh=mesh, stages=cut))
    attach(model, ParallelState(plan=plan, mesh=mesh))  # the same plan: the cut is the model's structure
    assert state_of(model).stages == cut
    attach(model, ParallelState(plan=Plan(), mesh=Mesh.layout(Plan())))  # another plan: no cut carried over
    assert state_of(model).stages is None
    model.__dict__["parallel"] = "not a state"
    with pytest.raises(TypeError, match="not a ParallelState"):
        state_of(model)


def test_gradient_sync_goes_through_the_state():
    from cuboid import zoo
    from cuboid.parallel import Mesh, ParallelState, Plan, set_gradient_sync
    from cuboid.parallel.state import attach

    model = zoo.build("gpt-debug")
    calls = []
    attach(model, ParallelState(plan=Plan(), mesh=Mesh.layout(Plan()), gradient_sync=calls.append))
    set_gradient_sync(model, False)
    set_gradient_sync(model, True)
    assert calls == [False, True]


def test_install_forward_prefers_the_pipeline():
    from cuboid.parallel import Mesh, ParallelState, Plan

    class Split:
        def forward(self, **batch):
            return "split"

    class Pipe:
        def model_forward(self, **batch):
            return "pipeline"

    model = torch.nn.Linear(2, 2)
    state = ParallelState(plan=Plan(), mesh=Mesh.layout(Plan()), sequence_split=Split())
    state.install_forward(model)
    assert model() == "split"
    state.pipeline = Pipe()
    state.install_forward(model)
    assert model() == "pipeline"


PROBE = re.compile(r"""getattr\([^,()]+,\s*["'](plan|mesh|pipeline|zero|sequence_split|pipeline_blocks|_cuboid_prepared)["']""")


def test_no_attribute_probes_for_the_parallel_state():
    """Readers go through ``state_of`` / ``planned``; a ``getattr(model, "mesh", None)`` probe is a regression."""
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for folder in ("cuboid", "parallel", "zoo", "tests", "bench")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if PROBE.search(line)
             and path.name != "test_state.py"]
    assert not found, "\n".join(found)
