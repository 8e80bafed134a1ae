"""Which plan for this model on this cluster: ``cuboid plans --model M --gpus N`` and ``plan="auto"``.

:func:`candidate_plans` lists every plan this build runs on ``N`` ranks (the one
enumeration, :func:`cuboid.parallel.cost.space.enumerate_plans`, with the batch's filters);
:func:`search_space` adds what a plan leaves open: micro-batch counts (``pp``,
``2 pp``, ``4 pp``, ... up to one sequence per micro-batch) and checkpointing
(none, selective, full). :func:`rank_plans` builds each structure's shards on
the meta device for the few ranks whose shapes differ (first, last and fullest
pipeline stage; first and last tensor rank), in the layout the run trains in,
so the bytes held are those of the real layers, and asks
:func:`cuboid.parallel.cost.predict` for the rest. Plans that do not fit the
device memory (less the headroom) say why.

:func:`auto_plan` resolves ``"auto"`` (``"auto,tp=2"``: fields that constrain
the search; ``batch=``, ``seq=``, ``hardware=``, ``memory=``, ``headroom=`` set
what it plans for): the fastest plan that fits the world size, the detected
hardware and free memory, with a one-line account (:func:`choice_line`).

What it plans for, ``model`` below, is a model builder: a callable ``build(plan, mesh)`` that returns
the meta model ``mesh.rank`` holds under ``plan`` and has the model's ``config`` and ``name``
(:class:`cuboid.loading.builder.ModelBuilder`); a preset name, a model folder or a zoo config is wrapped
into one (:func:`builder_of`). The planner builds meta models only through it.
"""
from __future__ import annotations

import bisect
import os
import re
import sys
from typing import Any, Iterable, Optional

from cuboid.parallel.cost import DEFAULT_HEADROOM, Estimate, Hardware, predict
from cuboid.parallel.plan import Plan, default_microbatches
from cuboid.parallel.cost.space import enumerate_plans, refusal

CHECKPOINTS = ("none", "selective", "full")
SEARCH_TOP = 24  # structures whose micro-batch counts and checkpointing the search tries
AUTO_KEYS = ("batch", "seq", "hardware", "memory", "headroom", "layout")  # what "auto,..." sets beside plan fields


def candidate_plans(config, world: int, batch: int, *, dtype: str = "fp32") -> list[Plan]:
    """Every plan of ``world`` ranks that this build runs for ``config`` (the one enumeration,
    :func:`cuboid.parallel.cost.space.enumerate_plans`) that a global ``batch`` divides over: dp shares of whole
    tensor-grid blocks and, under pp, 4, 2 or 1 micro-batches per stage (the most that divide)."""
    return enumerate_plans(config, world, batch=batch, per_stage=(4, 2, 1), dtype=dtype)


def microbatch_counts(plan: Plan, batch: int, most: int = 6) -> list[int]:
    """Micro-batch counts to try for ``plan`` (1 without a pipeline): ``pp * 2^i`` and one sequence per
    micro-batch, those that cut each dp share into whole tensor-grid blocks, at most ``most`` of them."""
    if plan.pp == 1:
        return [1]
    rows = batch // plan.dp
    counts, m = [], plan.pp
    while m <= rows:
        counts.append(m)
        m *= 2
    counts.append(rows // plan.batch_parts)
    ok = sorted({m for m in counts if m >= 1 and rows % (m * plan.batch_parts) == 0
                 and (m >= plan.pp or plan.schedule == "gpipe")})
    if len(ok) > most:  # keep the ends and the middle
        ok = sorted({ok[0], ok[-1], *ok[1:-1][:: max(1, (len(ok) - 2) // (most - 2))]})
    return ok


def search_space(config, plans: Iterable[Plan], batch: int, world: int) -> list[Plan]:
    """Each plan with every micro-batch count and checkpointing the search tries (those that validate)."""
    out = []
    for plan in plans:
        for m in microbatch_counts(plan, batch):
            for ck in CHECKPOINTS:
                p = plan.replace(microbatches=m, checkpoint=ck)
                if m == plan.microbatches or refusal(p.to_dict(), config, world) is None:
                    out.append(p)
    return out


def builder_of(model: Any, dtype=None):
    """``model`` as a model builder: a :class:`~cuboid.loading.builder.ModelBuilder` (in ``dtype`` when one is
    given), any other callable with ``config`` and ``name`` as it is, a preset name, a model folder or a zoo
    config wrapped into a builder of parameters in ``dtype``."""
    from dataclasses import replace

    from torch import nn

    from cuboid.loading.builder import ModelBuilder

    if isinstance(model, ModelBuilder):
        return model if dtype is None else replace(model, dtype=dtype)
    if callable(model) and hasattr(model, "config") and not isinstance(model, nn.Module):
        return model
    return ModelBuilder(model, dtype=dtype)


class _Shards:
    """Meta models of a plan's ranks, shared between plans whose shards are the same (dp, sp, ZeRO,
    checkpointing and micro-batches do not change what a rank holds of the tensor, pipeline and expert split:
    each of ``ep`` ranks holds ``E / ep`` experts, the same shapes whichever they are).
    ``model``: a model builder, or what :func:`builder_of` turns into one (then built in ``dtype``).

    :meth:`params` reads a rank's parameters off one model per tensor and expert split (built without a
    pipeline): the pipeline cut only drops whole blocks and end modules, so a stage's parameters are those
    of its blocks and ends there, in the same order (a :class:`~cuboid.loading.builder.ModelBuilder` of a
    preset or config; any other builder is built per stage, :meth:`of`). The models are only read."""

    def __init__(self, model, dtype=None) -> None:
        self.build = builder_of(model, dtype)
        self.cache: dict = {}
        self.wholes: dict = {}  # (tp, tp_mode, depth, ep, tensor rank) -> _Whole
        self.cut_cache: dict = {}  # (stages, stage_blocks) -> every stage's block range

    def of(self, plan: Plan, rank: int):
        """The meta model ``rank`` of ``plan`` holds: built once per tensor and pipeline split and position."""
        from cuboid.parallel import Mesh

        coords = Mesh.layout(plan, rank).coords
        split = Plan(pp=plan.pp, tp=plan.tp, tp_mode=plan.tp_mode, depth=plan.depth, dp=plan.ep, ep=plan.ep,
                     microbatches=default_microbatches(plan.pp, plan.schedule),
                     schedule=plan.schedule, stage_blocks=plan.stage_blocks)
        same = coords.get("pp", 0) * plan.ep * plan.tp + coords.get("tp", 0)  # that rank without dp and sp
        if (split, same) not in self.cache:
            self.cache[split, same] = self.build(split, Mesh.layout(split, same))
        return self.cache[split, same]

    def cuttable(self) -> bool:
        """Whether :meth:`params` reads ranks off the unsplit pipeline's model (see the class)."""
        from cuboid.loading.builder import ModelBuilder, is_folder

        return type(self.build) is ModelBuilder and not is_folder(self.build.source)

    def layout(self, plan: Plan) -> tuple:
        """(config, sharding spec, every pipeline stage's block range or ()) of ``plan``'s model."""
        if not self.cuttable():
            from cuboid.parallel.state import state_of
            from cuboid.zoo import spec_of

            first = self.of(plan, 0)
            return first.config, spec_of(first), state_of(first).stages or ()
        whole = self._whole(plan, 0)
        return whole.config, whole.spec, self._cuts(plan, whole) if plan.pp > 1 else ()

    def params(self, plan: Plan, rank: int) -> dict:
        """``{name: parameter}`` of the meta model ``rank`` of ``plan`` holds (a new dict; the parameters
        are shared with other plans and ranks, to be read only)."""
        if not self.cuttable():
            return dict(self.of(plan, rank).named_parameters())
        from cuboid.parallel import Mesh
        from cuboid.parallel.stages import dropped_ends, stage_ids

        coords = Mesh.layout(plan, rank).coords
        whole = self._whole(plan, coords.get("tp", 0))
        if plan.pp == 1:
            return whole.params_of(None, set())
        cuts = self._cuts(plan, whole)
        ids = stage_ids(plan.schedule, coords["pp"], plan.pp)
        return whole.params_of({i for s in ids for i in cuts[s]}, dropped_ends(whole.spec, 0 in ids,
                                                                                len(cuts) - 1 in ids))

    def _whole(self, plan: Plan, tensor_rank: int) -> "_Whole":
        """The model of ``plan``'s tensor and expert split at tensor rank ``tensor_rank``, without a pipeline
        (expert rank 0: every expert rank holds the same shapes)."""
        from cuboid.parallel import Mesh

        key = (plan.tp, plan.tp_mode, plan.depth, plan.ep, tensor_rank)
        if key not in self.wholes:
            base = Plan(tp=plan.tp, tp_mode=plan.tp_mode, depth=plan.depth, dp=plan.ep, ep=plan.ep)
            self.wholes[key] = _Whole(self.build(base, Mesh.layout(base, tensor_rank)))
        return self.wholes[key]

    def _cuts(self, plan: Plan, whole: "_Whole") -> list:
        """Every pipeline stage's block range, as :func:`cuboid.parallel.stages.cut_model` cuts them
        (:func:`~cuboid.parallel.stages.stage_ranges`), once per stage count and ``stage_blocks``."""
        from cuboid.parallel.stages import stage_count, stage_ranges
        from cuboid.zoo.plans import stage_costs

        key = (stage_count(plan), plan.stage_blocks)
        if key not in self.cut_cache:
            self.cut_cache[key] = stage_ranges(plan, stage_costs(whole.config))
        return list(self.cut_cache[key])


class _Whole:
    """A meta model without a pipeline, its parameters listed with the top-level module and block each
    belongs to (tied ones under every name), for :meth:`_Shards.params` to keep a stage's."""

    def __init__(self, model) -> None:
        from cuboid.zoo import spec_of

        self.config, self.spec = model.config, spec_of(model)
        blocks = self.spec.blocks if self.spec is not None else None
        self.entries = []
        for name, p in model.named_parameters(remove_duplicate=False):
            top, _, rest = name.partition(".")
            block = int(rest.partition(".")[0]) if top == blocks and rest else None
            self.entries.append((top if rest else "", block, name, p))

    def params_of(self, blocks: Optional[set], dropped: set) -> dict:
        """``{name: parameter}`` as the model cut to the blocks ``blocks`` (None: all) without the top-level
        modules ``dropped``: each parameter once, under its first name (as ``named_parameters`` lists them)."""
        out, seen = {}, set()
        for top, block, name, p in self.entries:
            if blocks is not None and (block not in blocks if block is not None else top in dropped):
                continue
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
        return out


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
             name: str = "", headroom: float = DEFAULT_HEADROOM) -> Estimate:
    """The :class:`~cuboid.parallel.cost.Estimate` of one plan for ``model`` (a model builder, preset name,
    folder or config)."""
    shards = shards or _Shards(model)
    config, spec, cuts = shards.layout(plan)  # cuts, under pp: every stage's block range
    ranks = _ranks_to_look_at(plan, cuts)
    rank_params = {r: shards.params(plan, r) for r in ranks}
    quantized = None
    if getattr(shards.build, "quantize", None):  # a 4-bit base: its bytes beside the parameters
        from cuboid.parallel.quant import quantized_bytes

        quantized = {r: quantized_bytes(shards.of(plan, r)) for r in ranks}
    return predict(config, plan, rank_params, hw, batch, seq, spec=spec, block_cuts=cuts,
                   name=name, headroom=headroom, quantized=quantized)


def rank_plans(model, world: int, hw: Hardware, batch: int, seq: int, *, dtype: str = "fp32",
               plans: Optional[Iterable[Plan]] = None, progress: bool = False, layout: str = "autocast",
               headroom: float = DEFAULT_HEADROOM, search: bool = True, quantize: Optional[str] = None,
               lora: Any = None, keep: Optional[int] = None, skipped: Optional[dict] = None) -> list[Estimate]:
    """Estimates of every candidate plan (or ``plans``), fastest first; those that do not fit last, fullest
    last. A plan that does not fit is tried once more fully checkpointed; ``search``: then the
    :data:`SEARCH_TOP` best with every micro-batch count and checkpointing (:func:`search_space`). ``layout``: ``autocast``
    (fp32 weights) or ``half`` (weights in ``dtype`` with fp32 masters; fp32 training has one layout).
    ``quantize="nf4"``: the blocks' linears a frozen 4-bit base (QLoRA, priced at its real bytes) trained through
    LoRA adapters (``lora``, default cuboid's LoRA defaults); the 2D/2.5D/3D grids, which do not build a 4-bit
    base, and tensor cuts through its blocks of 64, which the load refuses, are not candidates. ``lora``
    alone: adapters on the full-precision base.

    ``keep``: price only what can change the first ``keep`` plans that fit (:func:`_pruned`): plans whose model
    states alone pass the usable memory are not priced, the rest are priced cheapest floor first until the next
    floor passes the ``keep``-th fitting step time; None (the default) prices every plan. ``skipped`` (a dict) receives how
    many plans each rule left out, ``memory`` and ``slower``."""
    import torch

    half = layout == "half" and dtype != "fp32"
    shards = _Shards(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype] if half else None)
    if quantize or lora is not None:
        from cuboid.loading.quantize import AdaptedBuilder

        shards.build = AdaptedBuilder(shards.build, quantize, lora)
    model = shards.build
    config = model.config
    todo = list(plans) if plans is not None else candidate_plans(config, world, batch, dtype=dtype)
    if quantize and plans is None:
        todo = [p for p in todo if p.tp == 1 or p.tp_mode == "1d"]
    floors, skip, too_big = _pruned(shards, todo, hw, batch, seq, headroom, keep)
    out, seen, fitting, index = [], set(), [], {}
    listed = {}
    for k, plan in enumerate(todo):
        listed.setdefault(plan, k)
    bar = _bar(len(floors), progress)
    for i, (floor, plan) in enumerate(floors):  # each plan as given; one that does not fit, checkpointed
        if floor is None and fitting:
            break  # the plans past the memory only matter when none fits: the smallest of them then
        if floor is not None and keep is not None and len(fitting) >= keep and floor > fitting[keep - 1]:
            skip["slower"] = sum(f is not None for f, _ in floors[i:])
            break  # every plan left takes longer than the keep-th that fits
        if quantize and plans is None and _cuts_blocks(shards, plan):
            bar.update(1)
            continue
        est = estimate(model, plan, hw, batch, seq, shards=shards, headroom=headroom)
        if not est.fits and plan.checkpoint != "full":
            est = estimate(model, plan.replace(checkpoint="full"), hw, batch, seq, shards=shards, headroom=headroom)
        out.append(est)
        index[id(est)] = listed[plan]
        seen.add(est.plan)
        if est.fits:
            bisect.insort(fitting, est.step_s)
        if floor is None:
            skip["memory"] -= 1
        bar.update(1)
    bar.close()
    out.sort(key=lambda e: index[id(e)])  # as listed: ties rank as a full pricing ranks them
    if search:  # the best structures again with every micro-batch count and checkpointing
        out.sort(key=_rank_key)
        best = [e.plan for e in out[:SEARCH_TOP]]
        for plan in search_space(config, best, batch, world):
            if plan not in seen:
                seen.add(plan)
                if too_big(plan):
                    skip["memory"] += 1
                    continue
                out.append(estimate(model, plan, hw, batch, seq, shards=shards, headroom=headroom))
    out.sort(key=_rank_key)
    if skipped is not None:
        skipped.update(skip)
    return out


def _pruned(shards: _Shards, todo: list, hw: Hardware, batch: int, seq: int, headroom: float,
            keep: Optional[int]) -> tuple:
    """([(step floor, plan)] to price, in order, ``{"memory": n, "slower": 0}`` and whether a plan cannot fit)
    of ``todo``: without ``keep``
    every plan as listed (floors 0). With it, a plan whose model states' floor passes the usable memory
    (:func:`cuboid.parallel.cost.bound.memory_floor`: its states counted on one unsplit meta model, and the
    activations it keeps) cannot fit under any checkpointing: the ``keep`` smallest of those come last with floor None (priced only when no plan fits, so
    that the smallest misfit still says why) and the others are left out (``n``). The rest come cheapest step
    floor first (:func:`~cuboid.parallel.cost.bound.step_floor`), ties as listed."""
    if keep is None or not todo:
        return [(0.0, p) for p in todo], {"memory": 0, "slower": 0}, lambda plan: False
    from cuboid.parallel import Mesh
    from cuboid.parallel.cost import layout_of
    from cuboid.parallel.cost.bound import ModelCounts, memory_floor, step_floor
    from cuboid.zoo import spec_of

    whole = shards.build(Plan(), Mesh.layout(Plan(), 0))
    counts = ModelCounts.of(whole, spec_of(whole))
    ps = list(whole.parameters())
    dtype = next((p.dtype for p in ps if p.requires_grad), ps[0].dtype if ps else None)
    room = hw.memory_bytes * (1 - headroom)
    def need(plan):
        return memory_floor(counts, whole.config, plan, batch, seq, layout_of(plan, dtype))

    states = [need(p) for p in todo]
    fit = [i for i, b in enumerate(states) if b <= room]
    floors = sorted((step_floor(whole.config, todo[i], hw, batch, seq, dtype, counts), i) for i in fit)
    over = sorted((b, i) for i, b in enumerate(states) if b > room)
    return ([(f, todo[i]) for f, i in floors] + [(None, todo[i]) for _, i in over[:keep]],
            {"memory": len(over), "slower": 0}, lambda plan: need(plan) > room)


def skipped_line(skipped: dict, room: float) -> str:
    """One line of what :func:`rank_plans` left unpriced and why, or '' when it priced every plan."""
    parts = []
    if skipped.get("memory"):
        parts.append(f"{skipped['memory']} whose model states or activations alone need more than the "
                     f"{room / 1e9:.1f} GB usable")
    if skipped.get("slower"):
        parts.append(f"{skipped['slower']} whose step-time floor (compute, bubble, tensor/sequence/expert "
                     f"collectives) is past the last plan ranked here")
    return ("not priced: " + "; ".join(parts) + " (--exhaustive prices them)") if parts else ""


def _cuts_blocks(shards: _Shards, plan: Plan) -> bool:
    """Whether a rank of ``plan`` would cut a 4-bit base's blocks of 64 (a plan ``cuboid.load`` refuses)."""
    from cuboid.parallel.quant import BlockCutError

    try:
        for r in range(plan.world_size):  # built once per tensor and pipeline position (_Shards caches them)
            shards.of(plan, r)
    except BlockCutError:
        return True
    return False


def _rank_key(e: Estimate) -> tuple:
    return (not e.fits, e.step_s if e.fits else e.memory)


def config_of(model):
    """The config of a model builder, a preset name, a model folder or a config (no weights read)."""
    return builder_of(model).config


def _bar(total: int, on: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="plans", unit="plan", disable=not on, leave=False)


# ----------------------------------------------------------------------------- plan="auto"


def is_auto(spec) -> bool:
    """Whether a plan spec asks for the search: ``"auto"`` or ``"auto,field=value,..."``."""
    return isinstance(spec, str) and re.fullmatch(r"\s*auto\s*(,.*)?", spec) is not None


def parse_auto(spec: str) -> tuple[dict, dict]:
    """(plan fields that constrain the search, planning options: ``batch``, ``seq``, ``hardware``, ``memory``,
    ``headroom``, ``layout``) of ``"auto,tp=2,batch=16"``."""
    fields, options = {}, {}
    for part in [p.strip() for p in spec.split(",")[1:] if p.strip()]:
        if "=" not in part:
            raise ValueError(f"plan part {part!r} of {spec!r} is not of the form field=value")
        key, raw = (s.strip() for s in part.split("=", 1))
        if key == "activation_checkpoint":  # Plan.parse's other spelling of checkpoint=full|none
            key, raw = "checkpoint", Plan.parse(part).checkpoint
        if key in AUTO_KEYS:
            options[key] = raw
        else:
            fields[key] = Plan.parse(f"{key}={raw}").to_dict()[key] if key in Plan().to_dict() else None
            if fields[key] is None:
                raise ValueError(f"{key!r} in {spec!r} is neither a plan field ({', '.join(Plan().to_dict())}) nor "
                                 f"a planning option ({', '.join(AUTO_KEYS)})")
    return fields, options


def _matches(plan: Plan, fields: dict) -> bool:
    d = plan.to_dict()
    return all(d.get(k) == v for k, v in fields.items())


def auto_plan(model, spec: str = "auto", *, world: int, batch: int, seq: int, dtype: Optional[str] = None,
              hw: Optional[Hardware] = None, memory: Optional[float] = None, ranks_here: Optional[int] = None,
              progress: bool = False) -> tuple[Plan, list[Estimate]]:
    """The fastest plan of ``world`` ranks that fits, for ``model`` on a ``batch`` x ``seq`` global batch, and
    the ranking it came from. ``hw``: the profile (default: detected, :func:`cuboid.parallel.cost.detect_hardware`);
    ``memory``: bytes a rank may use (default: detected free memory, shared by ``ranks_here`` ranks on CPU).
    ``spec``'s fields constrain the search and its options override these."""
    from dataclasses import replace

    from cuboid.parallel import cost

    fields, options = parse_auto(spec)
    batch = int(options.get("batch", batch))
    seq = int(options.get("seq", seq))
    if "hardware" in options:
        hw = cost.load_hardware(options["hardware"])
    hw = hw or cost.detect_hardware()
    if "memory" in options:
        memory = parse_size(options["memory"])
    if memory is None:
        memory = cost.free_memory_bytes(ranks_here or min(world, hw.gpus_per_node))
    hw = replace(hw, memory_bytes=float(memory))
    headroom = float(options.get("headroom", DEFAULT_HEADROOM))
    dtype = fields.get("dtype") or dtype or "fp32"
    model = builder_of(model)
    config = model.config
    check_batch(config, batch, seq)
    plans = [p for p in candidate_plans(config, world, batch, dtype=dtype) if _matches(p.replace(**{
        k: v for k, v in fields.items() if k in ("microbatches", "checkpoint")}), fields)]
    if not plans:
        raise ValueError(f"no plan of {world} ranks runs {model.name} with {spec!r} for a batch of {batch}: "
                         f"see `cuboid plans --model {model.name} --gpus {world} --batch {batch}`")
    ests = [e for e in rank_plans(model, world, hw, batch, seq, dtype=dtype, plans=plans, progress=progress,
                                  layout=options.get("layout", "autocast"), headroom=headroom)
            if _matches(e.plan, fields)]
    fits = [e for e in ests if e.fits]
    if not fits:
        e = ests[0] if ests else None
        raise ValueError(f"no plan of {world} ranks fits {model.name} for a batch of {batch} x {seq}"
                         + (f": the smallest, {e.plan.describe()}, {e.why}" if e else ""))
    return fits[0].plan, ests


def runner_up(ests: list[Estimate]) -> Optional[Estimate]:
    """The best fitting plan of another shape than the first (sizes, modes, ZeRO; not checkpointing or
    micro-batches), else the second."""
    fits = [e for e in ests if e.fits]
    if len(fits) < 2:
        return None
    key = lambda p: p.replace(microbatches=1 if p.pp == 1 else p.pp, checkpoint="none").describe()  # noqa: E731
    first = key(fits[0].plan)
    return next((e for e in fits[1:] if key(e.plan) != first), fits[1])


def choice_line(ests: list[Estimate], world: int, hw: Hardware, batch: int, seq: int) -> str:
    """``plan auto: dp=4 (0.31 s/step, peak 2.1 GB) over tp=2,dp=2 (...)``, one line."""
    best, second = ests[0], runner_up(ests)

    def one(e):
        return f"{e.plan.describe()} ({e.step_s:.3g} s/step, peak {human_bytes(e.memory)})"

    other = f", runner-up {one(second)}" if second else ", the only plan that fits"
    return (f"plan auto: {one(best)}{other}; predicted for {world} x {hw.name} with {human_bytes(hw.memory_bytes)} "
            f"each, batch {batch} x {seq}, {best.layout} layout")


def human_bytes(n: float) -> str:
    """``1.23 GB`` or ``45.6 MB``."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def resolve(spec, model, *, batch: Optional[int] = None, seq: Optional[int] = None, dtype: Optional[str] = None,
            world: Optional[int] = None, say=None) -> Plan:
    """``spec`` as a :class:`Plan`: an ``auto`` spec searched (:func:`auto_plan`) for ``world`` ranks (default:
    ``WORLD_SIZE``), decided on rank 0 and sent to the others when a process group runs, its choice said in
    one line (``say``, default stderr on rank 0); any other spec as :meth:`Plan.parse` reads it."""
    from cuboid.zoo import READY_PLANS

    if not is_auto(spec):
        return Plan.parse(spec, READY_PLANS)
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    model = builder_of(model)
    config = model.config
    batch = batch or max(8, 4 * world)
    seq = seq or default_seq(config)
    rank = 0
    if world > 1 and "WORLD_SIZE" in os.environ:
        from cuboid.parallel.mesh import init_distributed

        rank, _ = init_distributed()
    chosen = [None]
    if rank == 0:
        from cuboid.parallel import cost

        hw = cost.detect_hardware()
        _, options = parse_auto(spec)
        if "hardware" in options:
            hw = cost.load_hardware(options["hardware"])
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", min(world, hw.gpus_per_node)))
        memory = parse_size(options["memory"]) if "memory" in options else cost.free_memory_bytes(ranks_here)
        plan, ests = auto_plan(model, spec, world=world, batch=batch, seq=seq, dtype=dtype, hw=hw, memory=memory)
        from dataclasses import replace

        line = choice_line(ests, world, replace(hw, memory_bytes=memory), int(options.get("batch", batch)),
                           int(options.get("seq", seq)))
        (say or (lambda m: print(m, file=sys.stderr, flush=True)))(line)
        chosen[0] = plan.to_dict()
    if world > 1 and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        dist.broadcast_object_list(chosen, src=0)
    return Plan.from_dict(chosen[0])


def default_seq(config) -> int:
    """The sequence length planned for when none is given: the model's positions (ViT: its patches + 1),
    at most 2048."""
    if hasattr(config, "patch_size"):
        return config.n_patches + 1
    return min(getattr(config, "n_positions", 0) or 2048, 2048)


def check_batch(config, batch: int, seq: int) -> None:
    """A one-sentence ValueError for a batch or sequence length the model cannot train on."""
    if batch < 1:
        raise ValueError(f"--batch {batch}: give a global batch of at least 1 sequence")
    positions = getattr(config, "n_positions", None)
    if hasattr(config, "patch_size"):
        if seq != config.n_patches + 1:
            raise ValueError(f"--seq {seq}: a ViT of {config.n_patches} patches sees {config.n_patches + 1} tokens")
    elif seq < 1 or (positions and seq > positions):
        raise ValueError(f"--seq {seq}: this model takes 1 to {positions} positions")


def parse_size(text) -> float:
    """Bytes of ``80GB``, ``80G``, ``80 GiB``, ``512MB``, ``1.5T`` or a plain number of GB."""
    if isinstance(text, (int, float)):
        return float(text) * 1e9
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|G|TB|TiB|T|MB|MiB|M)?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"memory takes a size like 80GB, 80G or 512MiB, got {text!r}")
    unit = (m.group(2) or "GB").lower()
    return float(m.group(1)) * {"gb": 1e9, "g": 1e9, "gib": 2 ** 30, "tb": 1e12, "t": 1e12, "tib": 2 ** 40,
                                "mb": 1e6, "m": 1e6, "mib": 2 ** 20}[unit]
