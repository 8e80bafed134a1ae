"""Every plan this build runs on ``N`` ranks for a model: the one enumeration.

:func:`enumerate_plans` walks the structural fields of a :class:`Plan`
(``dp x pp x tp x sp`` over the divisors of ``N``, ``tp_mode`` and
``depth``, ``sp_mode``, ``zero``, the pipeline ``schedule``,
``tp_sequence`` and, for a mixture-of-experts config (``n_experts``), ``ep``
over the divisors of ``dp x sp``: a raw product, nothing pre-filtered) and keeps exactly the plans that
``Plan(...).validate(config, N)`` accepts and ``plan.unimplemented()`` does
not name. Nothing else decides: a combination this walk leaves out is one that
``validate`` refuses (``ValueError``) or ``require_implemented`` refuses
(``NotImplementedError``), each with a sentence that says why, and a clause
removed from :meth:`Plan.unimplemented` when a composition is built shows up
here with no edit. Spellings of one plan with fields that mean nothing in it
(``sp_mode`` without sp, ``zero`` without dp, ...) are enumerated once
(:func:`canonical`). ``cuboid plans --gpus N`` (:func:`cuboid.loading.planner.candidate_plans`)
lists this enumeration, and ``tests/parallel/test_plan_space.py`` and
``tests/parallel/test_plans.py`` walk it.

Orthogonal toggles (``checkpoint``, ``dtype``, ``stage_blocks``)
are the caller's: :func:`enumerate_plans` leaves them at their defaults
unless given. What depends on the batch is explicit: with ``batch`` (global
rows), ``dp`` must divide it and each dp share must cut into
``microbatches x batch_parts`` (the pipeline's micro-batches of the tensor
grid's blocks); ``per_stage`` says how many micro-batches per pipeline stage
to try, the first that divides wins.
"""
from __future__ import annotations

from itertools import product
from typing import Any, Iterator, Optional, Sequence

from ..plan import SCHEDULES, SP_MODES, TP_MODES, Plan


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatches_for(plan: Plan, batch: Optional[int] = None, per_stage: Sequence[int] = (1,)) -> Optional[int]:
    """Micro-batches for ``plan`` (1 without a pipeline): the first ``k * pp`` of ``per_stage`` that cuts each dp
    share of ``batch`` rows into micro-batches of whole tensor-grid blocks; None when none does or dp does not
    divide ``batch``. Without ``batch``: ``per_stage[0] * pp``."""
    if batch is not None and batch % plan.dp:
        return None
    if plan.pp == 1:
        return 1 if batch is None or (batch // plan.dp) % plan.batch_parts == 0 else None
    for k in per_stage:
        m = k * plan.pp
        if batch is None or (batch // plan.dp) % (m * plan.batch_parts) == 0:
            return m
    return None


def structural(world: int, experts: bool = False) -> Iterator[dict]:
    """Every combination of the structural fields whose sizes multiply to ``world``: sizes, ``tp_mode`` and
    ``depth``, ``sp_mode``, ``zero``, ``schedule``, ``tp_sequence`` and, for a mixture-of-experts model
    (``experts``), ``ep`` over the divisors of ``dp x sp``. Whether a combination is a plan is not decided
    here."""
    for dp, pp, sp in product(divisors(world), repeat=3):
        if world % (dp * pp * sp):
            continue
        tp = world // (dp * pp * sp)
        for tp_mode, depth, sp_mode, zero, schedule, tp_sequence, ep in product(
                TP_MODES, divisors(tp), SP_MODES, range(4), SCHEDULES, (False, True),
                divisors(dp * sp) if experts else (1,)):
            yield dict(dp=dp, pp=pp, tp=tp, sp=sp, tp_mode=tp_mode, depth=depth, sp_mode=sp_mode, zero=zero,
                       schedule=schedule, tp_sequence=tp_sequence, ep=ep)


def refusal(fields: dict, config: Any, world: int) -> Optional[str]:
    """Why ``Plan(**fields)`` does not run on ``world`` ranks for ``config`` (the sentence of the ``ValueError`` or
    ``NotImplementedError`` it raises), or None when it runs."""
    try:
        Plan(**fields).validate(config, world).require_implemented()
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return None


def enumerate_plans(config: Any, world: int, *, batch: Optional[int] = None, per_stage: Sequence[int] = (1,),
                    **toggles) -> list[Plan]:
    """Every plan of ``world`` ranks this build runs for ``config`` (see the module docstring), one per
    combination of the structural fields, in a fixed order. ``batch``/``per_stage`` choose micro-batches
    (:func:`microbatches_for`) and drop plans the batch does not divide over; ``toggles`` (such as
    ``dtype="bf16"`` or ``checkpoint="full"``) are set on every plan."""
    plans, seen = [], set()
    for fields in structural(world, experts=bool(getattr(config, "n_experts", 0))):
        fields = canonical(fields)
        key = tuple(sorted(fields.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            plan = Plan(**fields)
        except ValueError:
            continue
        try:
            m = microbatches_for(plan, batch, per_stage)
        except ValueError:  # a tensor grid tp does not form: validate says so
            continue
        if m is None:
            continue
        plan = plan.replace(microbatches=m, **toggles)
        if refusal(plan.to_dict(), config, world) is None:
            plans.append(plan)
    return plans


def canonical(fields: dict) -> dict:
    """The fields without those that mean nothing in this combination (a tensor layout without tp, sp_mode
    without sp, a schedule without pp, ZeRO without dp), set to their defaults: such spellings are one plan,
    enumerated once."""
    out = dict(fields)
    for field, size, default in (("tp_mode", "tp", "1d"), ("depth", "tp", 1), ("sp_mode", "sp", SP_MODES[0]),
                                 ("schedule", "pp", Plan.schedule), ("zero", "dp", 0)):
        if out.get(size, 1) == 1 and field in out:
            out[field] = default
    return out
