"""Which plan for this model on this cluster: ``cuboid plans --model M --gpus N``.

:func:`candidate_plans` lists every plan this build runs on ``N`` ranks (the one
enumeration, :func:`cuboid.parallel.plan_space.enumerate_plans`, with the batch's filters);
:func:`rank_plans` builds each one's shards on the meta device for the few
ranks whose shapes differ (first, last and fullest pipeline stage; first and
last tensor rank), so the bytes held are those of the real layers, and asks
:func:`cuboid.parallel.cost.predict` for the rest. Plans that do not fit the
device memory (even with activation checkpointing) say why.
"""
from __future__ import annotations

from typing import Iterable, Optional

from cuboid.parallel.cost import Estimate, Hardware, predict
from cuboid.parallel.plan import Plan
from cuboid.parallel.plan_space import enumerate_plans


def candidate_plans(config, world: int, batch: int, *, dtype: str = "fp32") -> list[Plan]:
    """Every plan of ``world`` ranks that this build runs for ``config`` (the one enumeration,
    :func:`cuboid.parallel.plan_space.enumerate_plans`) that a global ``batch`` divides over: dp shares of whole
    tensor-grid blocks and, under pp, 4, 2 or 1 micro-batches per stage (the most that divide)."""
    return enumerate_plans(config, world, batch=batch, per_stage=(4, 2, 1), dtype=dtype)


class _Shards:
    """Meta models of a plan's ranks, shared between plans whose shards are the same (dp, sp, ZeRO and
    the dtype do not change what a rank holds of the tensor and pipeline split)."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache: dict = {}

    def of(self, plan: Plan, rank: int):
        """The meta model ``rank`` of ``plan`` holds: built once per tensor and pipeline split and position."""
        from cuboid.parallel import Mesh

        coords = Mesh.layout(plan, rank).coords
        split = Plan(pp=plan.pp, tp=plan.tp, tp_mode=plan.tp_mode, depth=plan.depth, microbatches=plan.microbatches,
                     schedule=plan.schedule, stage_blocks=plan.stage_blocks)
        same = coords.get("pp", 0) * plan.tp + coords.get("tp", 0)  # that rank without dp and sp
        if (split, same) not in self.cache:
            import cuboid

            self.cache[split, same] = cuboid.load(self.model, plan=split, device="meta", mesh=Mesh.layout(split, same))
        return self.cache[split, same]


def meta_shards(model, plan: Plan, rank: int):
    """The meta model (its parameters: shapes of the shards and stages) that ``rank`` of ``plan`` holds."""
    return _Shards(model).of(plan, rank)


def _ranks_to_look_at(plan: Plan, block_cuts) -> list[int]:
    """First and last tensor rank of the first, last and fullest pipeline stage (dp = sp = 0)."""
    stages = {0, plan.pp - 1}
    if plan.pp > 2 and block_cuts:
        from cuboid.parallel.cost import stages_of

        stages.add(max(stages_of(plan, block_cuts, 0), key=lambda s: s.blocks).index)
    per_pp = plan.world_size // plan.pp
    return sorted({s * per_pp + t for s in stages for t in {0, plan.tp - 1}})


def estimate(model, plan: Plan, hw: Hardware, batch: int, seq: int, *, shards: Optional[_Shards] = None,
             name: str = "") -> Estimate:
    """The :class:`~cuboid.parallel.cost.Estimate` of one plan for ``model`` (a preset name or folder)."""
    from cuboid import zoo

    shards = shards or _Shards(model)
    first = shards.of(plan, 0)
    cuts = getattr(first, "pipeline_blocks", ())
    rank_params = {}
    for r in _ranks_to_look_at(plan, cuts):
        m = shards.of(plan, r)
        rank_params[r] = dict(m.named_parameters())
    return predict(first.config, plan, rank_params, hw, batch, seq, spec=zoo.spec_of(first), block_cuts=cuts,
                   name=name)


def rank_plans(model, world: int, hw: Hardware, batch: int, seq: int, *, dtype: str = "fp32",
               plans: Optional[Iterable[Plan]] = None, progress: bool = False) -> list[Estimate]:
    """Estimates of every candidate plan (or ``plans``), fastest first; those that do not fit last. A plan
    that does not fit as it is is listed with activation checkpointing on (its misfit reason then says
    that even checkpointed activations leave too little room)."""
    config = config_of(model)
    todo = list(plans) if plans is not None else candidate_plans(config, world, batch, dtype=dtype)
    shards = _Shards(model)
    out = []
    bar = _bar(len(todo), progress)
    for plan in todo:
        est = estimate(model, plan, hw, batch, seq, shards=shards)
        if not est.fits and not plan.activation_checkpoint:  # checkpointed: fits, or at least says so
            est = estimate(model, plan.replace(activation_checkpoint=True), hw, batch, seq, shards=shards)
        out.append(est)
        bar.update(1)
    bar.close()
    out.sort(key=lambda e: (not e.fits, e.step_s if e.fits else e.memory))
    return out


def config_of(model):
    """The config of a preset name, a model folder or a config (read on the meta device: no weights)."""
    import cuboid

    return cuboid.load(model, device="meta").config


def _bar(total: int, on: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="plans", unit="plan", disable=not on, leave=False)
