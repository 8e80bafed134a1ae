"""The one enumeration of plans (``cuboid.parallel.cost.space``) and Plan's refusals agree by construction.

For 2, 4 and 8 ranks and each debug family: every enumerated plan validates
and is implemented, and every combination of the raw product of the
structural fields (sizes over the divisors of the world, each layout field,
sp_mode, zero, schedule, tp_sequence) that is not enumerated is refused by
``Plan(...)``, ``validate`` or ``require_implemented`` with a one-sentence
error, unless it is an enumerated plan spelled with fields that mean nothing
in it (a tensor layout without tp, sp_mode without sp, a schedule without
pp, ZeRO without dp).
"""
from itertools import product

import pytest

from cuboid import zoo
from cuboid.parallel import Plan
from cuboid.parallel.plan import SCHEDULES, SP_MODES, TP_MODES
from cuboid.parallel.cost.space import canonical, divisors, enumerate_plans, microbatches_for

FAMILIES = ("gpt-debug", "bert-debug", "vit-debug")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("family", FAMILIES)
def test_enumeration_is_exactly_what_plan_accepts(world, family):
    config = zoo.config_of(family)
    plans = enumerate_plans(config, world)
    assert plans and len(set(plans)) == len(plans)
    for plan in plans:
        assert plan.validate(config, world).require_implemented() == plan
    enumerated = set(plans)
    sizes = divisors(world)
    accepted = refused = 0
    for dp, pp, tp, sp, tp_mode, depth, sp_mode, zero, schedule, tp_sequence in product(
            sizes, sizes, sizes, sizes, TP_MODES, sizes, SP_MODES, range(4), SCHEDULES, (False, True)):
        fields = dict(dp=dp, pp=pp, tp=tp, sp=sp, tp_mode=tp_mode, depth=depth, sp_mode=sp_mode, zero=zero,
                      schedule=schedule, tp_sequence=tp_sequence)
        try:
            plan = Plan(**fields)
            plan = plan.replace(microbatches=microbatches_for(plan))
            plan.validate(config, world).require_implemented()
        except (ValueError, NotImplementedError) as e:
            assert str(e) and "\n" not in str(e), fields
            refused += 1
            continue
        accepted += 1
        assert Plan(**canonical(plan.to_dict())) in enumerated, f"{plan.describe()} runs but is not enumerated"
    assert accepted >= len(plans) and refused
    # every structural field takes more than one value somewhere, so the walk is not trivially small
    for field in ("dp", "tp", "zero"):
        assert len({getattr(p, field) for p in plans}) > 1, field
    if world >= 4:
        assert {p.tp_mode for p in plans} >= {"1d", "2d"}
        assert {p.schedule for p in plans if p.pp > 1} == set(SCHEDULES)  # 2 layers: 2 stages a rank fit
    assert any(p.sp > 1 for p in plans) and any(p.pp > 1 for p in plans)


def test_sequence_parallelism_over_a_tensor_grid_is_refused_as_meaningless():
    for plan in (Plan(sp=2, tp=4, tp_mode="2d"), Plan(sp=2, tp=8, tp_mode="2.5d", depth=2),
                 Plan(sp=2, tp=8, tp_mode="3d")):
        with pytest.raises(ValueError, match="sequence parallelism .* grid"):
            plan.validate(zoo.config_of("gpt-debug"))
        assert all(p.sp == 1 for p in enumerate_plans(zoo.config_of("gpt-debug"), plan.world_size)
                   if p.tp_mode != "1d")


def test_batch_filters_are_explicit():
    config = zoo.config_of("gpt-debug")
    every = enumerate_plans(config, 8)
    for batch in (8, 6):
        plans = enumerate_plans(config, 8, batch=batch, per_stage=(4, 2, 1))
        assert plans and set(p.replace(microbatches=1) for p in plans) <= set(p.replace(microbatches=1) for p in every)
        for p in plans:
            rows = batch // p.dp
            assert batch % p.dp == 0 and rows % (p.microbatches * p.batch_parts) == 0
            assert p.pp == 1 or p.microbatches // p.pp in (4, 2, 1)
    assert not any(p.dp == 4 for p in enumerate_plans(config, 8, batch=6))
    assert all(p.dtype == "bf16" and p.checkpoint == "full"
               for p in enumerate_plans(config, 4, dtype="bf16", activation_checkpoint=True))


@pytest.mark.parametrize("world", [2, 4, 8])
def test_ep_plans_for_mixture_of_experts_models_only(world):
    """The enumeration walks ep over the divisors of dp x sp for a model with experts, and never for a dense one:
    ep=2 and ep=4 sit beside every dp x sp plan they divide, each accepted by validate; 2D/3D and tp_sequence
    are refused for a mixture-of-experts model in one sentence."""
    moe = zoo.config_of("qwen3-moe-debug")
    plans = enumerate_plans(moe, world)
    dense = enumerate_plans(zoo.config_of("llama-debug"), world)
    assert all(p.ep == 1 for p in dense)
    with_ep = [p for p in plans if p.ep > 1]
    assert with_ep and all((p.dp * p.sp) % p.ep == 0 and moe.n_experts % p.ep == 0 for p in with_ep)
    for p in plans:
        if p.dp * p.sp > 1 and p.ep == 1:  # every ep the data ranks allow is there too
            assert {q.ep for q in plans if q.replace(ep=1) == p} == set(d for d in divisors(p.dp * p.sp)
                                                                          if moe.n_experts % d == 0)
    assert all(p.tp_mode == "1d" and not p.tp_sequence for p in plans)
    for fields in (dict(tp=4, tp_mode="2d"), dict(tp=2, tp_sequence=True)):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            Plan(**fields).validate(moe)
    with pytest.raises(ValueError, match="has none"):
        Plan(dp=2, ep=2).validate(zoo.config_of("llama-debug"))
