"""Pairwise coverage of the generated plan test (test_plans.py): every (plan field value, family) and every
(plan field value, task) pair the worlds' plans allow is run somewhere.

The worlds turn families, tasks, key/value heads, heads, QLoRA, optimizers and steps by plan index; what that
rotation leaves out (a field value of a few plans of the 8-rank world on some family, a task on a tensor
grid), :func:`covering_runs` adds as runs of their own: for each missing pair the first plan of that world
(enumerated, then ready and extra) with the field value that takes it, on that family, or on a family that
takes that task. :func:`report` lists every pair with where it runs; the worlds assert none is missing.

A pair is *allowed* when some plan of a world with that field value validates on the family's config (the
overrides it runs with) and, for a task, when some family that plan runs takes the task (an LM task on a causal
LM head, ``reward`` on a one-output classifier).
"""
from __future__ import annotations

import dataclasses

from .plan_families import FAMILIES, LLAMA, family_options
from .plan_tasks import LM_TASKS

FIELDS = ("dp", "pp", "tp", "sp", "tp_mode", "depth", "sp_mode", "zero", "microbatches", "schedule",
          "tp_sequence", "checkpoint", "ep", "compile")  # the plan fields the worlds vary (dtype: fp32 here)
WORLDS = (2, 4, 8)
TASKS = ("model",) + tuple(t for t in LM_TASKS if t) + ("reward",)  # "model": the model's own loss


def values_of(plan) -> list:
    """The plan's (field, value) pairs over FIELDS."""
    return [(f, getattr(plan, f)) for f in FIELDS]


def task_options(name: str, task: str, plan, index: int):
    """The config overrides family ``name`` runs ``task`` with under ``plan`` (None: it cannot): the run's own
    (:func:`~.plan_families.family_options`) with the head the task needs, QLoRA left out."""
    from cuboid import zoo

    extra = {k: v for k, v in family_options(name, plan, index).items() if k not in ("quantize", "lora")}
    if task == "reward":
        if name not in LLAMA:
            return None
        extra.update(head="cls", num_labels=1)
    elif task != "model":
        if name.startswith(("bert", "vit")):
            return None
        extra.pop("num_labels", None)
        extra["head"] = "lm"
    try:
        plan.validate(zoo.config_of(name, **extra))
    except ValueError:
        return None
    return extra


def world_runs(world: int) -> list:
    """(plan, family, task) of every run the generated world of ``world`` ranks makes by its rotation (the
    dense families: the mixtures of experts' worlds are test_moe_plans')."""
    from .plan_tasks import task_of
    from .test_plans import FAMILIES as ALL, OPTIMIZERS, _runs, families_per_plan, generated

    plans, others = generated(world)
    out = []
    for group, per_plan in ((plans, families_per_plan(world, plans)), (others, len(ALL))):
        for index, _, plan, name, extra, *_ in _runs(group, OPTIMIZERS, True, per_plan, ALL, world):
            if name in FAMILIES:
                out.append((plan, name, task_of(index, name, extra, ALL) or "model"))
    return out


def _pairs(runs) -> tuple:
    fam, task = set(), set()
    for plan, name, t in runs:
        for v in values_of(plan):
            fam.add((v, name))
            task.add((v, t))
    return fam, task


@dataclasses.dataclass
class Cover:
    """What one world adds to the rotation: (plan index, spec, family, task, config overrides) runs (the index in
    the world's enumerated plans, then its ready and extra ones), and the pairs covered with them."""

    runs: list
    family_pairs: set
    task_pairs: set


def covering_runs(world: int, covered: tuple) -> Cover:
    """The runs world ``world`` adds for the allowed pairs missing from ``covered`` (the pairs every world's
    rotation reaches, and the smaller worlds' covering runs), each pair once."""
    from cuboid.zoo import READY_PLANS
    from cuboid.parallel import Plan

    from .test_plans import generated

    fam_done, task_done = (set(s) for s in covered)
    plans, others = generated(world)
    added = []
    for index, spec in enumerate(list(plans) + list(others)):
        plan = Plan.parse(spec, READY_PLANS)
        for v in values_of(plan):
            for name in FAMILIES:
                if (v, name) not in fam_done and task_options(name, "model", plan, index) is not None:
                    added.append((index, spec, name, "model", task_options(name, "model", plan, index)))
                    fam_done.update((u, name) for u in values_of(plan))
                    task_done.update((u, "model") for u in values_of(plan))
            for task in TASKS:
                if (v, task) in task_done:
                    continue
                for name in FAMILIES:
                    extra = task_options(name, task, plan, index)
                    if extra is not None:
                        added.append((index, spec, name, task, extra))
                        task_done.update((u, task) for u in values_of(plan))
                        fam_done.update((u, name) for u in values_of(plan))
                        break
    return Cover(added, fam_done, task_done)


def all_covers() -> dict:
    """world -> its :class:`Cover`, each world covering what the smaller ones left."""
    out, covered = {}, _pairs([r for world in WORLDS for r in world_runs(world)])
    for world in WORLDS:  # the smallest world first: its runs are the cheapest
        out[world] = covering_runs(world, covered)
        covered = (out[world].family_pairs, out[world].task_pairs)
    return out


def allowed_pairs() -> tuple:
    """Every allowed (value, family) and (value, task) pair over the worlds' plans (module docstring)."""
    from cuboid.zoo import READY_PLANS
    from cuboid.parallel import Plan

    from .test_plans import generated

    fam, task = set(), set()
    for world in WORLDS:
        plans, others = generated(world)
        for index, spec in enumerate(list(plans) + list(others)):
            plan = Plan.parse(spec, READY_PLANS)
            for name in FAMILIES:
                for t in TASKS:
                    if task_options(name, t, plan, index) is not None:
                        fam.update((v, name) for v in values_of(plan))
                        task.update((v, t) for v in values_of(plan))
    return fam, task


def report() -> str:
    """Every allowed pair and where it is covered: a table of values x families and values x tasks (the number
    of runs a pair has over the worlds, ``+`` for the covering runs that add it, ``-`` for none)."""
    covers = all_covers()
    runs = [r for w in WORLDS for r in world_runs(w)]
    added = [r for w in WORLDS for r in covers[w].runs]
    counts: dict = {}
    for plan, name, task in runs:
        for v in values_of(plan):
            counts[v, name] = counts.get((v, name), 0) + 1
            counts[v, task] = counts.get((v, task), 0) + 1
    fam_ok, task_ok = covers[WORLDS[-1]].family_pairs, covers[WORLDS[-1]].task_pairs
    allowed_f, allowed_t = allowed_pairs()
    values = sorted({v for v, _ in allowed_f}, key=lambda v: (FIELDS.index(v[0]), str(v[1])))
    cols = FAMILIES + TASKS
    lines = [f"{len(runs)} rotation runs + {len(added)} covering runs; pairs allowed: {len(allowed_f)} (value, family), "
             f"{len(allowed_t)} (value, task)",
             "value".ljust(24) + " ".join(c.replace("-debug", "")[:7].rjust(7) for c in cols)]
    for v in values:
        cells = []
        for c in cols:
            allowed = (v, c) in (allowed_f if c in FAMILIES else allowed_t)
            done = (v, c) in (fam_ok if c in FAMILIES else task_ok)
            cells.append(("." if not allowed else str(counts[v, c]) if (v, c) in counts else "+" if done else "-")
                         .rjust(7))
        lines.append(f"{v[0]}={v[1]}".ljust(24) + " ".join(cells))
    return "\n".join(lines)
