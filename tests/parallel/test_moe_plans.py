"""Plan parity for mixtures of experts: the MoE preset's own enumeration (ep plans included) on 2, 4 and 8 ranks,
through :func:`test_plans.plan_parity_worker` (the public path, one device's run with the plan's micro-batches
as the reference: the auxiliary loss is per micro-batch), and the other two MoE families on a few plans each.

The enumerations' plans (qwen3-moe-debug's, 2, 4 and 8 ranks) turn three families by index
(plan_families.moe_family): qwen3-moe-debug (a dense layer before the sparse one, 8 experts top 2, its
load-balancing loss trained: ``output_router_logits``), gpt-oss-debug (sinks, alternating windows, biased router
and experts; 8 experts here) and deepseek-v3-debug (latent attention, group-limited routing with a correction
bias, a shared expert), each world asserting all three ran; Mixtral (fp32 routing weights, every layer sparse) and OLMoE (q/k norms over all heads' width,
no renormalised top-k) run dp x ep, sp x ep and pp on 2 ranks.
"""
from .launch import run_world
from .plan_families import MOE, MOE_OTHERS, MOE_ROTATION
from .test_plans import check, plan_parity_worker, record_seconds


def moe_plans(world: int, pipeline: bool = True) -> list:
    """The plans of the mixture-of-experts preset's enumeration on ``world`` ranks (ep plans included); with
    ``pipeline`` False, those without pp."""
    from cuboid import zoo
    from cuboid.parallel.cost.space import enumerate_plans

    return [p for p in enumerate_plans(zoo.config_of(MOE[0]), world, batch=8) if pipeline or p.pp == 1]


# recompute with the experts' all-to-alls inside the recomputed blocks, beside the enumeration's plans
MOE_EXTRA = {2: ["dp=2,ep=2,checkpoint=full", "dp=2,ep=2,checkpoint=selective", "sp=2,ep=2,checkpoint=full",
                 "pp=2,microbatches=2,checkpoint=selective"]}


def record(world: int, reports: list) -> None:
    """Writes each run's seconds (the slowest rank's) to /tmp/cuboid-plan-parity/moe{N}.json and prints the
    world's count, total and slowest runs (``pytest -s``), as test_plans.run_generated does for its worlds."""
    seconds = record_seconds(f"moe{world}", reports, world=world)
    slow = sorted(seconds, key=seconds.get)[-3:]
    print(f"\nMoE plan parity on {world} ranks: {len(seconds)} runs, {sum(seconds.values()):.0f} s in runs; slowest "
          + ", ".join(f"{k} {seconds[k]:.1f} s" for k in slow))


def moe_worker(world: int):
    return plan_parity_worker(moe_plans(world) + MOE_EXTRA.get(world, []), rotate=True, families=MOE_ROTATION)


def test_moe_plans_on_2_ranks():
    """qwen3-moe-debug with its auxiliary loss under every 2-rank plan of its enumeration (dp with ep=1 and 2,
    ZeRO 0-3, tp1d with the experts whole on both ranks, sp ring and all-to-all with ep over the sequence
    ranks, pp=2 under each schedule) and MOE_EXTRA (recompute, full and selective): one device's losses,
    outputs and parameters, as every plan above (one device with the plan's micro-batches, :func:`micro_order`)."""
    plans = moe_plans(2)
    assert {p.ep for p in plans} == {1, 2} and any(p.tp == 2 for p in plans) and any(p.sp == 2 for p in plans)
    assert any(p.pp == 2 for p in plans)
    reports = run_world(moe_worker, 2, 2, timeout=900)
    record(2, reports)
    check(reports)
    assert {k.split("/")[0] for k in reports[0]} == {p.describe() for p in plans} | set(MOE_EXTRA[2])
    assert {k.split("/")[1] for k in reports[0]} == set(MOE_ROTATION)


def test_moe_plans_on_4_ranks():
    """As :func:`test_moe_plans_on_2_ranks` on 4 ranks: ep 2 and 4 beside dp, sp, ZeRO, tp1d and pp."""
    plans = moe_plans(4)
    assert {p.ep for p in plans} == {1, 2, 4} and any(p.pp > 1 and p.ep > 1 for p in plans)
    reports = run_world(moe_worker, 4, 4, timeout=1500)
    record(4, reports)
    check(reports)
    assert {k.split("/")[0] for k in reports[0]} == {p.describe() for p in plans}
    assert {k.split("/")[1] for k in reports[0]} == set(MOE_ROTATION)


def test_moe_plans_on_8_ranks():
    """As :func:`test_moe_plans_on_2_ranks` on 8 ranks: ep 2, 4 and 8 beside dp, sp, ZeRO, tp1d and pp."""
    plans = moe_plans(8)
    assert {p.ep for p in plans} == {1, 2, 4, 8} and any(p.pp > 1 and p.ep > 1 for p in plans)
    reports = run_world(moe_worker, 8, 8, timeout=1800)
    record(8, reports)
    check(reports)
    assert {k.split("/")[0] for k in reports[0]} == {p.describe() for p in plans}
    assert {k.split("/")[1] for k in reports[0]} == set(MOE_ROTATION)


OTHER_PLANS = ["dp=2,ep=2", "sp=2,sp_mode=all_to_all,ep=2", "pp=2,microbatches=2"]


def moe_others_worker(world: int):
    return plan_parity_worker(OTHER_PLANS, rotate=True, families=MOE_OTHERS)


def test_other_moe_families_on_2_ranks():
    """Mixtral and OLMoE with their auxiliary loss under dp x ep, all-to-all sp x ep and pp=2: one device's
    losses, outputs and parameters."""
    reports = run_world(moe_others_worker, 2, 2, timeout=900)
    check(reports)
    assert {k.split("/")[0] for k in reports[0]} == set(OTHER_PLANS)
