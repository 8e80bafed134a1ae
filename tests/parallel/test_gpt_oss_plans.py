"""Plan parity for gpt-oss (sinks, alternating windows, YaRN, biased q/k/v/o, a biased router and biased experts
with the clamped SwiGLU, trained with its load-balancing loss): gpt-oss-debug on 2 ranks under dp x ep with
ZeRO-3, tp=2 (1D: the sinks cut with the heads), ring sp (the sink joins the merged denominator once),
all-to-all sp x ep (each rank its heads' sinks) and pp=2, through
:func:`test_plans.plan_parity_worker` (the public path against one device's run)."""
from .launch import run_world
from .test_plans import check, plan_parity_worker

GPT_OSS = ("gpt-oss-debug",)
PLANS = ["dp=2,ep=2,zero=3", "tp=2", "sp=2", "sp=2,sp_mode=all_to_all,ep=2", "pp=2,microbatches=2"]


def gpt_oss_worker(world: int):
    return plan_parity_worker(PLANS, rotate=True, families=GPT_OSS)


def test_gpt_oss_plans_on_2_ranks():
    """dp x ep with ZeRO-3, tp1d, ring sp, all-to-all sp x ep and pp=2: one device's losses, outputs and parameters."""
    reports = run_world(gpt_oss_worker, 2, 2, timeout=900)
    check(reports)
    assert {k.split("/")[0] for k in reports[0]} == set(PLANS)
