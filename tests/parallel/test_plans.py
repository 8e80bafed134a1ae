"""Plan parity through the public path: every plan the enumeration yields, every zoo family, as a user writes it.

One world per size (2, 4, 8 ranks) runs every plan
:func:`cuboid.parallel.plan_space.enumerate_plans` yields for that world (the
same set for gpt-debug, bert-debug with its MLM head, vit-debug and the Llama
family's llama-debug, qwen3-debug and gemma3-debug with as many key/value heads
as query heads: asserted),
then the ready plans of that size the enumeration does not hold (a toggle
on, such as ``dp2-ckpt``), EXTRA, and COMPILED (plans with ``compile=true``,
each on one family: every block compiled, with ``aot_eager``). A plan the enumeration gains (a
composition built, a clause gone from ``Plan.unimplemented``) is tested here
with no edit. For each plan and family, ``cuboid.load(name, plan, seed=0,
mesh=mesh)`` is compared with one device's run of the same seed (computed
once per world for each family, optimizer and path, each by one rank, since every plan is
held to the same run), with one optimizer built the plain way
(``Opt(model.parameters(), ...)``) and turned over AdamW, LAMB, LARS and Muon by
the plan's index, so each plan meets all four over its families (Muon with fp32 Newton-Schulz). Two
steps on fixed global batches (three on every fifth plan: :func:`steps_of`),
alternating the two public ways to train:

- the natural loop: ``share = cuboid.rank_share(model, batch)``,
  ``model(**share).loss.backward()``, ``clip_grad_norm_``, ``opt.step()``
  (on a batch whose dp shares hold equal label counts, as the contract asks);
- ``cuboid.train_step(model, opt, batch, max_grad_norm=1.0)`` (on a batch
  whose shares hold different label counts); step 1's is packed
  (:func:`packed_batch`: ``position_ids`` restarting at each of two or three
  documents a row, as Hugging Face packs, and a causal LM's labels -100 but
  answer spans, rows holding 0 to 9 trained tokens: :func:`sft_labels`), so
  every plan trains on packed SFT rows once (ViT has no packing: its batch
  stays as it is).

A pipeline plan trains through ``train_step`` only (its forward with
gradients is refused, as the contract says). Checked: initial parameters
equal one device's exactly; every step's loss, the logits, hidden states and
pooled output of the first share (single-device shapes and values, logits
read lazily), and an odd-sized batch under no_grad with labels and without
them (``model(**{k: v for k, v in batch.items() if k != "labels"})``, under
every schedule: logits, hidden states and pooled output), and every
parameter after the steps (gathered). Tolerances: loss and outputs 1e-5
relative, parameters 1e-6, NaN always fails. Parameters are compared with
one norm over all of them, dropping the largest 0.1% of element differences:
with Adam-type steps a few elements whose exact gradient is zero move by
rounding noise on any plan (a systematic error, such as an unreduced LAMB
trust ratio, moves every element and is caught). AdamW and LAMB run with
eps=1e-3 for the same reason (see test_data_parallel.py).

Budget: each world writes its count and per-run seconds to
``/tmp/cuboid-plan-parity/world{N}.json`` and prints them (``pytest -s``).
When a world's enumeration times the 6 families passes RUN_BUDGET runs, each
enumerated plan runs on one Llama-family preset (llama-debug, qwen3-debug,
gemma3-debug) and one other family, each turned by its index, and past twice
the budget on one family turned by ``index // 3`` (:func:`families_of`; the
CI machine has 2 cores; the suite must stay under 40 minutes); the ready and
EXTRA plans run on all six. The Llama family runs
with 1, 2 or 4 key/value heads for its 4 query heads, turned by the plan's
index (:func:`family_options`): multi-query, grouped (under tp=4 1D each rank
then holds a copy of one key/value head) and plain.
The 8-rank world also runs test_cost's 2.5D/3D cost check and the
groups-made-once check (200 loads, threads and groups unchanged).
"""
from types import SimpleNamespace
from typing import NamedTuple, Optional

import torch

from .launch import run_world
from .plan_families import FAMILIES, LLAMA, MOE_FAMILIES, OTHERS, families_of, family_options, global_batch
from .plan_between import baseline, between_families, between_steps, generates, midway, same_parameters
from .plan_reliability import checks_reliability, reliability, whole_rows
from .plan_tasks import PAIR_TASKS, pair_rows, task_batch, task_of, task_step

STEPS = 3  # a run's steps on every THIRD_STEP_EVERY-th plan index; the other runs take the first two
THIRD_STEP_EVERY = 5


def steps_of(index: int) -> int:
    """The steps plan number ``index`` runs: 3 every THIRD_STEP_EVERY-th index, else 2 (the natural loop, then
    ``train_step`` on packed rows). Turned by 5, apart from the families (3), key/value heads (3), tasks (4) and
    reliability checks (4, 12) that other fields turn by."""
    return STEPS if index % THIRD_STEP_EVERY == 0 else 2


def even_batch(name, model, size=8):
    """A global batch whose dp shares (2 or 4 of them) hold equal label counts."""
    batch = global_batch(name, model, size)
    if "labels" in batch and batch["labels"].dim() == 2:
        pads = torch.arange(size) % 2 * 3  # rows alternate 0 and 3 padded positions
        cols = torch.arange(batch["input_ids"].shape[1])
        mask = (cols.unsqueeze(0) < batch["input_ids"].shape[1] - pads.unsqueeze(1)).long()
        labels = batch["input_ids"].masked_fill(mask == 0, -100)
        if name.startswith("bert"):
            keep = torch.rand(1, labels.shape[1], generator=torch.Generator().manual_seed(3)) < 0.4
            keep[0, 0] = True
            labels = labels.masked_fill(~keep, -100)
        batch.update(attention_mask=mask, labels=labels)
    return batch


def packed_batch(name, model, size=8):
    """:func:`global_batch` with its rows packed (Hugging Face's convention): ``position_ids`` restart at 0 where
    a document starts (two or three documents a row, boundaries turned by the row), a causal LM's label of a
    document's first token -100; the rows keep their right padding. A causal LM's labels carry SFT masks
    (:func:`sft_labels`). ViT's batch is returned as it is."""
    batch = global_batch(name, model, size)
    if name.startswith("vit"):
        return batch
    T = batch["input_ids"].shape[1]
    positions = torch.empty(size, T, dtype=torch.long)
    for row in range(size):
        starts = sorted({0, 2 + row % 4, 7 + row % 3})
        positions[row] = torch.cat([torch.arange(b - a) for a, b in zip(starts, starts[1:] + [T])])
    labels = batch["labels"]
    if labels.dim() == 2 and not name.startswith("bert"):  # a document's first token is never a target
        labels = sft_labels(labels.masked_fill(positions == 0, -100), batch["attention_mask"])
    return dict(batch, position_ids=positions, labels=labels)


def sft_labels(labels, attention_mask):
    """SFT masks on packed causal-LM labels, rows of very different trained counts: the first half of the rows
    train every document's answer (all but its first token), the second half one answer token each (the row's
    last real token; the rest -100). So dp shares and micro-batches hold from 0 or 1 to 30 trained tokens, and a
    step weighted per share or per micro-batch instead of per trained token fails every plan."""
    size = labels.shape[0]
    last = attention_mask.sum(1, keepdim=True) - 1  # each row's last real token
    answer = torch.arange(labels.shape[1]).unsqueeze(0) == last
    answer[: size // 2] = True
    return labels.masked_fill(~answer, -100)


SP_PACKED = True  # sequence-parallel plans train on packed rows too (False: their train_step batch stays padded)


def packs(plan) -> bool:
    """Whether ``plan``'s train_step batch of step 1 is packed (:func:`step_batch`)."""
    return plan.sp == 1 or SP_PACKED


def step_batch(name, model, step, packed, size=8):
    """The batch ``cuboid.train_step`` takes at ``step``: step 1's packed (:func:`packed_batch`) when ``packed``,
    the others :func:`global_batch` (a pipeline trains on both: its stream changes shape between steps)."""
    return packed_batch(name, model, size) if packed and step == 1 else global_batch(name, model, size)


def rel_norm(a: torch.Tensor, b: torch.Tensor, drop: float = 0.001) -> float:
    """||a - b|| / ||b|| over flattened tensors, without the largest ``drop`` fraction of |a - b|."""
    d = (a.double() - b.double()).abs().flatten()
    keep = d.numel() - int(d.numel() * drop)
    d = d.sort().values[:keep]
    return (d.norm() / b.double().norm().clamp(min=1e-30)).item()


def worst(*errors: float) -> float:
    """The largest error, NaN counting as infinite (``max(x, nan)`` would keep ``x``)."""
    return max(float("inf") if e != e else e for e in errors)


def rel(a: float, b: float) -> float:
    """|a - b| / |b|; |a| where b is 0 (a one-output classifier's cross-entropy: exactly 0)."""
    return abs(a - b) / abs(b) if b else abs(a)


def rel_max(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def gathered(model):
    """(full name, full tensor) of every parameter of a (sharded) zoo model; a collective."""
    from cuboid import zoo

    return [(full, mod.full_tensor(local)) for full, mod, local, _ in zoo.common.sharded_parameters(model)]


def params_err(model, ref) -> float:
    refs = dict(ref.named_parameters())
    pairs = gathered(model)
    a = torch.cat([t.flatten() for _, t in pairs])
    b = torch.cat([refs[n].detach().flatten() for n, _ in pairs])
    return rel_norm(a, b)


def outputs_err(out, ref_out, rows=None, fields=("logits", "last_hidden_state", "pooler_output")) -> float:
    """Largest relative error of logits / hidden states / pooled output; shapes must match one device's."""
    err = 0.0
    for field in fields:
        a, b = getattr(out, field), getattr(ref_out, field)
        if b is None:
            assert a is None, field
            continue
        b = b if rows is None else b[rows]
        assert tuple(a.shape) == tuple(b.shape), (field, tuple(a.shape), tuple(b.shape))
        err = worst(err, rel_max(a.detach(), b.detach()))
    return err


def make_optimizer(kind, params):
    from cuboid.parallel.optim import LAMB, LARS, AdamW

    if kind == "adamw":
        return AdamW(params, lr=1e-2, eps=1e-3)
    if kind == "lamb":
        return LAMB(params, lr=1e-2, eps=1e-3, weight_decay=0.01)
    # Muon: fp32 Newton-Schulz (bf16's would round plan-to-plan noise in the gradients into whole steps), and a
    # smaller lr than the others': at 1e-2 a MoE run's parameters matched one device's to 1e-7 (2-10x AdamW's
    # rounding: the orthogonalisation spreads it over the whole matrix) and its eval loss, through the routers'
    # top-k, to 1.1e-5 (pp=4 x sp=2 a2a gpipe, 8 ranks)
    if kind == "muon":
        from cuboid.parallel.muon import Muon

        return Muon(params, lr=3e-3, weight_decay=0.01, ns_dtype="fp32", adamw_lr=1e-2, adamw_eps=1e-3)
    return LARS(params, lr=0.5, momentum=0.9, weight_decay=1e-3)


OPTIMIZERS = ("adamw", "lamb", "lars", "muon")
_REFS: dict = {}  # one device's run, per RefArgs, computed once per world (share_references)
_WHOLE_FOR: set = set()  # the RefArgs keys whose runs check reliability: their reference evaluates whole_rows too


def _batch_size(dp: int) -> int:
    return max(8, 2 * dp)  # even_batch's dp shares of 2+ rows, alternating 0 and 3 padded positions


def micro_order(size: int, dp: int, micro: int) -> torch.Tensor:
    """The rows of a global batch reordered so that one device's micro-batch i is every dp share's i-th
    micro-batch: the global micro-batch a plan's forward sees (a mixture of experts' auxiliary loss is per
    global micro-batch)."""
    return torch.arange(size).reshape(dp, micro, -1).transpose(0, 1).reshape(-1)


class RefArgs(NamedTuple):
    """What one device's run (:func:`reference`) depends on."""
    name: str
    kind: str
    pipelined: bool
    size: int
    extra: dict
    packed: bool = True
    micro: int = 1
    dp: int = 1
    task: str = ""  # the objective of the train_step steps (plan_tasks.task_of; "" the model's loss)
    index: int = 0  # the plan's index (a task's options are turned by it)
    steps: int = STEPS  # (:func:`steps_of`)
    between: bool = False  # the between-steps axis (plan_between): evaluations and a generation around the steps


def _ref_key(*args) -> tuple:
    a = RefArgs(*args)
    return a._replace(extra=tuple(sorted(a.extra.items())))


def _cached(key) -> bool:
    """Whether one device's run of ``key`` is in _REFS with all it needs (a warm world may hold it without the
    evaluations a later world's checks need)."""
    return key in _REFS and (key not in _WHOLE_FOR or _REFS[key]["whole"] is not None)


def reference(name, kind, pipelined, size, extra, packed=True, micro=1, dp=1, task="", index=0, steps=STEPS,
              between=False):
    """One device's run of ``name`` with optimizer ``kind``: the steps a plan's run takes (the natural loop and
    ``train_step`` alternating, or ``train_step`` only for a pipeline), its losses, the outputs of the first
    step's batch, the parameters before and after, and the outputs of an odd-sized batch with and without
    labels (and, for a key in _WHOLE_FOR, :func:`whole_rows`' evaluations); with ``between``, what
    plan_between's axis does around the steps (``baseline``, ``midway``: its output and generated tokens). Every
    plan of this family, optimizer and path is compared with the same run."""
    import cuboid
    from cuboid.parallel.optim import clip_grad_norm_

    key = _ref_key(name, kind, pipelined, size, extra, packed, micro, dp, task, index, steps, between)
    if _cached(key):
        return _REFS[key]
    ref = cuboid.load(name, seed=0, **extra).train()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    odd = {k: v[:5] for k, v in global_batch(name, ref).items()}
    before = _plain(baseline(ref, odd)) if between else None
    mid = None
    opt = make_optimizer(kind, ref.parameters())
    losses, first = [], None
    for step in range(steps):
        if not pipelined and step % 2 == 0:  # the natural loop
            out = ref(**even_batch(name, ref, size))
            out.loss.backward()
            clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
            first = out if first is None else first
        else:
            batch = step_batch(name, ref, step, packed, size)
            batch = task_batch(task, batch, index)  # (drawn by row before the reordering)
            if micro > 1:  # (a mixture of experts: the plan's global micro-batches)
                batch = {k: v[micro_order(size, dp, micro)] for k, v in batch.items()}
            losses.append(task_step(ref, opt, batch, task, index, max_grad_norm=1.0, microbatches=micro).loss)
        if between and step == 0:
            out, tokens = midway(ref, odd, getattr(ref.config, "head", None) == "lm")
            mid = dict(out=_plain(out), tokens=tokens)
    ref.eval()
    with torch.no_grad():
        evaluated = ref(**odd)
        free = ref(**{k: v for k, v in odd.items() if k != "labels"})
    whole = whole_rows(ref, name, dp) if key in _WHOLE_FOR else None
    _REFS[key] = dict(init=init, params={n: p.detach().clone() for n, p in ref.named_parameters()}, losses=losses,
                      first=_plain(first), eval=_plain(evaluated), free=_plain(free), odd=odd, whole=whole,
                      baseline=before, midway=mid)
    return _REFS[key]


def _plain(out) -> Optional[SimpleNamespace]:
    """A model output's fields, detached (a reference crosses processes: see :func:`share_references`); None
    for None (a pipeline's reference has no natural-loop output)."""
    from cuboid.zoo.common import Output

    if out is None:
        return None
    return SimpleNamespace(**{f: None if getattr(out, f) is None else getattr(out, f).detach() for f in Output.FIELDS})


def share_references(keys: list) -> None:
    """One device's runs of ``keys`` (:func:`reference`'s arguments) not yet cached, each computed by one rank
    and read by all: the ranks share a machine's cores, so each computing every run would take world-size
    times the CPU for the same numbers (the runs are deterministic). Each rank writes its runs to one file
    (memory, /dev/shm, where the machine has it) that the others read, rather than ``all_gather_object``, which
    unpickles every tensor through a nested ``torch.load`` on every rank."""
    import os
    import shutil

    import torch.distributed as dist

    from cuboid.parallel.mesh import init_distributed

    from .reliability_checks import save_folder

    todo = list({_ref_key(*k): k for k in keys if not _cached(_ref_key(*k))}.values())
    if not todo:
        return
    rank, world = init_distributed()
    folder = save_folder(f"cuboid-plan-refs-{os.getppid()}-{world}")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{rank}.pt")
    torch.save({i: reference(*todo[i]) for i in range(rank, len(todo), world)}, path)
    dist.barrier()
    for other in range(world):  # this test's own files, written just now by its ranks
        for i, value in torch.load(os.path.join(folder, f"{other}.pt"), weights_only=False, mmap=True).items():
            _REFS[_ref_key(*todo[i])] = value
    dist.barrier()  # every rank has read every file
    if rank == 0:
        shutil.rmtree(folder)


def _params_err(model, want, pairs=None) -> float:
    pairs = gathered(model) if pairs is None else pairs
    return rel_norm(torch.cat([t.flatten() for _, t in pairs]), torch.cat([want[n].flatten() for n, _ in pairs]))



def plan_parity_worker(plans, optimizers=OPTIMIZERS, rotate=False, per_plan=len(FAMILIES), families=FAMILIES,
                       cover=None):
    """Each plan (a ready name, a spec or a Plan) on each family, through the public path, against one device.

    ``optimizers``: each plan runs with every one, or (``rotate``) with one per family, turned by the plan's
    index, so each plan meets AdamW, LAMB, LARS and Muon over its families. ``per_plan``: the families each plan
    runs on (:func:`families_of`; the CI budget, see RUN_BUDGET). A pipeline plan trains through
    ``cuboid.train_step`` only (its forward with gradients is refused); the others alternate the natural loop
    and ``train_step``. Returns {key: errors} with each plan's seconds (load, steps, evaluation) under
    ``seconds``."""
    import time

    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, comm
    from cuboid.parallel.compile import compiled_blocks
    from cuboid.parallel.mesh import init_distributed
    from cuboid.parallel.optim import clip_grad_norm_
    from cuboid.parallel.spec import blocks_of

    report = {}
    world = init_distributed()[1]
    runs = list(_runs(plans, optimizers, rotate, per_plan, families, world) if cover is None else
                _cover_runs(cover, optimizers))
    _WHOLE_FOR.update(_ref_key(*args) for index, _, _, name, _, _, args in runs
                      if checks_reliability(index, name, world) or args.between)
    share_references([args for *_, args in runs])
    mesh_of = None  # (plan index, its mesh): one mesh for a plan's runs
    for index, label, plan, name, extra, kind, args in runs:
        if mesh_of is None or mesh_of[0] != index:
            mesh_of = (index, Mesh.build(plan))
        mesh = mesh_of[1]
        pipelined, size, dp = args.pipelined, args.size, args.dp
        want = reference(*args)
        dist.barrier()
        start = time.perf_counter()
        if plan.compile:  # each model's blocks compiled afresh, not left to Dynamo's recompile limit
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
        model = cuboid.load(name, plan, seed=0, mesh=mesh, **extra).train()
        assert model.parallel.plan == plan and model.parallel.mesh is mesh
        if plan.compile:
            assert all(compiled_blocks(model, blocks_of(model.parallel.spec))), (label, name)
        errs = {"init": _params_err(model, want["init"]), "loss": 0.0, "outputs": 0.0}
        loaded = [id(p) for p in model.parameters()]
        if args.between:  # a user's starting loss, before the optimizer exists
            out = baseline(model, want["odd"])
            errs["baseline"] = worst(outputs_err(out, want["baseline"]), rel(out.loss.item(), want["baseline"].loss.item()))
            assert same_parameters(model, loaded), (label, name, "parameters() changed by a no_grad forward")
        opt = make_optimizer(kind, model.parameters())
        for step in range(args.steps):
            if not pipelined and step % 2 == 0:  # the natural loop
                share = cuboid.rank_share(model, even_batch(name, model, size))
                out = model(**share)
                out.loss.backward()
                loss = out.loss.detach().clone().reshape(1)
                comm.all_reduce_(loss, mesh.group("dp"))
                loss = loss.item() / dp
                if step == 0:
                    start_row = mesh.coords["dp"] * len(share["labels"])
                    rows = slice(start_row, start_row + len(share["labels"]))
                    errs["outputs"] = outputs_err(out, want["first"], rows)
                clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            else:
                batch = step_batch(name, model, step, args.packed, size)
                loss = task_step(model, opt, batch, args.task, args.index, max_grad_norm=1.0).loss
            errs["loss"] = worst(errs["loss"], rel(loss, want["losses"][step]))
            if args.between and step == 0:  # an evaluation and a generation between the steps
                out, tokens = midway(model, want["odd"], generates(plan, model))
                errs["midway"] = worst(outputs_err(out, want["midway"]["out"]),
                                       rel(out.loss.item(), want["midway"]["out"].loss.item()))
                if tokens is not None:  # greedy tokens: one device's exactly
                    errs["generated"] = 0.0 if torch.equal(tokens, want["midway"]["tokens"]) else float("inf")
                assert same_parameters(model, loaded), (label, name, "parameters() changed by an evaluation")
        pairs = gathered(model)
        errs["params"] = _params_err(model, want["params"], pairs)
        if plan.compile:  # the steps ran Dynamo's graphs
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, (label, name)
        # an odd-sized batch, the same on every rank, without grad, with and without labels: one device's
        odd = want["odd"]
        model.eval()
        fields = ("logits", "last_hidden_state", "pooler_output")
        with torch.no_grad():  # every schedule (ZBV too) and every plan: one device's outputs
            out = model(**odd)
            errs["eval_outputs"] = outputs_err(out, want["eval"], fields=fields)
            errs["eval_loss"] = worst(rel(out.loss.item(), want["eval"].loss.item()))
            free = model(**{k: v for k, v in odd.items() if k != "labels"})
            assert free.loss is None, label
            errs["free_outputs"] = outputs_err(free, want["free"], fields=fields)
        if checks_reliability(index, name, mesh.world_size) or args.between:
            errs.update(reliability(model, name, index, mesh, want, pairs, extra))
        assert same_parameters(model, loaded), (label, name, "parameters() changed between the load and the end")
        dist.barrier()
        errs["seconds"] = time.perf_counter() - start
        report[f"{label}/{name}/{kind}" + (f"/{args.task}" if args.task else "")] = errs
    return report


def _runs(plans, optimizers, rotate, per_plan, families, world):
    """(plan index, label, Plan, family, config overrides, optimizer, :func:`reference`'s arguments) of each run
    of :func:`plan_parity_worker` in a world of ``world`` ranks, in order."""
    from cuboid.parallel import Plan
    from cuboid.zoo import READY_PLANS

    for index, spec in enumerate(plans):
        plan = Plan.parse(spec, READY_PLANS)
        label = spec if isinstance(spec, str) else plan.describe()
        between = between_steps(index, plan, world, every_zero3=families == FAMILIES)
        runs_on = families_of(index, per_plan, families, plan)
        if between and families == FAMILIES:
            runs_on = between_families(index, plan, runs_on)
        for f, name in enumerate(families):
            if name not in runs_on:
                continue
            extra = family_options(name, plan, index)
            kinds = (optimizers[(index + f) % len(optimizers)],) if rotate else optimizers
            for kind in kinds:
                micro = plan.microbatches if name in MOE_FAMILIES else 1  # the aux loss is per micro-batch
                task = task_of(index, name, extra, FAMILIES)
                size, packed = _batch_size(plan.dp), packs(plan)
                if task in PAIR_TASKS or task == "grpo":  # whole pairs in every split; rollouts are not packed
                    size, packed = pair_rows(size, plan.dp, plan.microbatches), False
                yield index, label, plan, name, extra, kind, RefArgs(name, kind, plan.pp > 1, size, extra, packed,
                                                                     micro, plan.dp, task, index if task else 0,
                                                                     steps_of(index), between)


def _cover_runs(cover, optimizers):
    """:func:`_runs`' tuples of plan_coverage's covering runs ``cover``: (plan index, spec, family, task, config
    overrides) each, the optimizer turned by the index as the rotation turns it."""
    from cuboid.parallel import Plan
    from cuboid.zoo import READY_PLANS

    for index, spec, name, task, extra in cover:
        plan = Plan.parse(spec, READY_PLANS)
        label = spec if isinstance(spec, str) else plan.describe()
        kind = optimizers[(index + FAMILIES.index(name)) % len(optimizers)]
        task = "" if task == "model" else task
        size, packed = _batch_size(plan.dp), packs(plan)
        if task in PAIR_TASKS or task == "grpo":
            size, packed = pair_rows(size, plan.dp, plan.microbatches), False
        yield index, label, plan, name, extra, kind, RefArgs(name, kind, plan.pp > 1, size, extra, packed, 1, plan.dp,
                                                             task, index if task else 0, steps_of(index))


# (plan, family) the generated test found wrong in this build, each with what goes wrong; checked to fail
KNOWN_BROKEN: dict = {}
TOLERANCE = {"loss": 1e-5, "outputs": 1e-5, "eval_outputs": 1e-5, "eval_loss": 1e-5, "free_outputs": 1e-5,
             "params": 1e-6, "uneven_eval": 1e-5, "save_reload": 1e-12, "baseline": 1e-5, "midway": 1e-5,
             "generated": 1e-12}


def check(reports):
    assert reports
    for rank, report in enumerate(reports):
        assert report
        for key, errs in report.items():
            assert errs["init"] == 0.0, (rank, key, "initialisation differs", errs)
            assert "free_outputs" in errs and "eval_outputs" in errs, (rank, key, errs)
            broken = KNOWN_BROKEN.get(tuple(key.split("/")[:2]))
            bad = [what for what, tol in TOLERANCE.items() if not worst(errs.get(what, 0.0)) < tol]
            if broken:  # strict: once it passes, take it off the list
                assert bad, (rank, key, f"passes now: remove it from KNOWN_BROKEN ({broken})")
                continue
            assert not bad, (rank, key, bad, errs)


# ------------------------------------------------------------------------- the generated test

# ready plans the enumeration does not hold (a toggle on, another spelling) run beside it, with these
EXTRA = {2: ["sp=2,activation_checkpoint=true",  # the ring recomputed in backward
            # selective recompute (checkpoint=selective): collectives replayed, not re-sent; ZBV recomputes twice
            "sp=2,checkpoint=selective", "tp=2,checkpoint=selective", "tp=2,tp_sequence=true,checkpoint=selective",
            "pp=2,microbatches=2,schedule=zbv,checkpoint=selective"],
         4: ["dp=2,pp=2,microbatches=2,checkpoint=selective", "tp=4,tp_mode=2d,checkpoint=selective",
             "dp=4,zero=3,checkpoint=selective", "pp=2,tp=2,microbatches=4,schedule=interleaved,checkpoint=selective",
             "dp=2,sp=2,sp_mode=all_to_all,zero=2,checkpoint=selective"],
         8: ["tp=8,tp_mode=3d,checkpoint=selective", "tp=8,tp_mode=2.5d,depth=2,checkpoint=selective",
             "dp=2,pp=2,tp=2,microbatches=2,checkpoint=selective",
             "pp=2,sp=2,tp=2,microbatches=2,schedule=gpipe,checkpoint=selective"]}


def generated(world: int):
    """The plans one world runs: every enumerated plan (each family's enumeration is the same set of plans
    for the debug configs: asserted), then the ready plans of this world size it does not hold, then EXTRA."""
    import os

    from cuboid import zoo
    from cuboid.parallel.cost.space import enumerate_plans

    per_family = [enumerate_plans(zoo.config_of(f), world, batch=8) for f in OTHERS]
    assert all(p == per_family[0] for p in per_family), "the families' enumerations differ"
    # with as many key/value heads as query heads, the Llama family's presets take the same plans
    for name in LLAMA:
        assert enumerate_plans(zoo.config_of(name, n_kv_heads=4), world, batch=8) == per_family[0], name
    plans = per_family[0]
    ready = [name for name, p in zoo.READY_PLANS.items() if p.world_size == world and p not in plans]
    ready = [n for i, n in enumerate(ready) if zoo.READY_PLANS[n] not in [zoo.READY_PLANS[m] for m in ready[:i]]]
    if not os.environ.get("CUBOID_PLAN_FIELDS"):
        return plans, ready + EXTRA.get(world, [])
    plans = list(dict.fromkeys(with_fields(plans)))  # a toggle can make two plans one (checkpoint over the old switch)
    return plans, [p for p in dict.fromkeys(with_fields(ready + EXTRA.get(world, []))) if p not in plans]


def with_fields(plans: list) -> list:
    """``plans`` with the fields of ``CUBOID_PLAN_FIELDS`` (e.g. ``checkpoint=selective``) set on each, as Plans:
    the whole generated test under one toggle, run by hand (CI runs it as is, with the toggles in EXTRA)."""
    import dataclasses
    import os

    from cuboid.parallel import Plan
    from cuboid.zoo import READY_PLANS

    given = Plan.parse(os.environ["CUBOID_PLAN_FIELDS"])
    fields = {f.name: getattr(given, f.name) for f in dataclasses.fields(Plan)
              if getattr(given, f.name) != getattr(Plan(), f.name)}
    return [dataclasses.replace(Plan.parse(p, READY_PLANS), **fields) for p in plans]


# runs (plan x family) a world's enumeration may take on all six families on CI's 2 cores (the suite's 40-minute
# bound; seconds per run in bench/RESULTS.md): above it each plan runs on two families, above twice it on one.
# The 2-rank enumeration runs on all six, the 4-rank one on two, the 8-rank one on one (the 8-rank world's
# time goes to test_moe_plans' whole MoE enumeration)
RUN_BUDGET = {2: 120, 4: 200, 8: 400}


def families_per_plan(world: int, plans) -> int:
    """6 (every family) within RUN_BUDGET[world] runs, 2 within twice it, else 1 (:func:`families_of`)."""
    runs = len(FAMILIES) * len(plans)
    return len(FAMILIES) if runs <= RUN_BUDGET[world] else 2 if runs <= 2 * RUN_BUDGET[world] else 1


# plans with compile=true, each on one family (a block's compile costs seconds a model on CI's cores), beside
# tests/test_compile_plans.py's (GPT-2 and Llama under dp, ZeRO-3, tp and pp): an encoder with its MLM head and a
# Llama-family preset with q/k norms through the public path, one device's eager run as the reference
COMPILED = {2: [("dp=2,compile=true", "bert-debug"), ("pp=2,microbatches=2,compile=true", "qwen3-debug")]}
# their backend: Dynamo and AOTAutograd trace as under inductor, without inductor's C++ code generation
COMPILE_BACKEND = "aot_eager"


def generated_worker(world: int, cover: list = ()):
    """One world's runs: its enumerated plans, its ready and extra ones (the rotation), the covering runs
    ``cover`` (plan_coverage: the pairs the rotation leaves out), the compiled plans."""
    from cuboid.parallel import compile as pc

    plans, others = generated(world)
    report = plan_parity_worker(plans, rotate=True, per_plan=families_per_plan(world, plans))
    report.update(plan_parity_worker(others, rotate=True))
    if cover:
        report.update(plan_parity_worker([], cover=list(cover)))
    pc.BACKEND = COMPILE_BACKEND
    for spec, family in COMPILED.get(world, []):
        report.update(plan_parity_worker([spec], rotate=True, families=(family,)))
    return report


def record_seconds(tag: str, reports: list, **info) -> dict:
    """Each run's seconds (the slowest rank's), written with ``info`` to /tmp/cuboid-plan-parity/{tag}.json (the
    worlds' budget figures); returned."""
    import json
    import os

    seconds = {k: max(r[k]["seconds"] for r in reports) for k in reports[0]}
    os.makedirs("/tmp/cuboid-plan-parity", exist_ok=True)
    with open(f"/tmp/cuboid-plan-parity/{tag}.json", "w") as fh:
        json.dump({**info, "runs": len(seconds), "per_run_s": seconds}, fh, indent=1)
    return seconds


def check_between(report: dict, plans: list) -> None:
    """Every enumerated ZeRO-3 plan ran the between-steps axis (a baseline evaluation, one between steps, a save
    read back) on a tied and on an untied causal LM (plan_between)."""
    from .plan_between import TIED, UNTIED

    for plan in (p for p in plans if p.zero == 3):
        label = plan.describe()
        ran = {k.split("/")[1] for k, errs in report.items()
               if k.split("/")[0] == label and {"baseline", "midway", "save_reload"} <= set(errs)}
        assert ran & set(TIED) and ran & set(UNTIED), (label, sorted(ran))


def run_generated(world: int, timeout: float, *extra_work):
    """Runs the generated parity test of ``world`` ranks; writes its per-plan times to
    /tmp/cuboid-plan-parity/world{N}.json and prints the count and time per N."""
    import time

    from .plan_coverage import all_covers

    plans, others = generated(world)
    cover = all_covers()[world].runs
    start = time.perf_counter()
    results = run_world(generated_worker if not extra_work else extra_work[0], world, world, cover, timeout=timeout)
    took = time.perf_counter() - start
    reports = [r if not extra_work else r[0] for r in results]
    seconds = record_seconds(f"world{world}", reports, world=world, plans=len(plans), ready_and_extra=len(others),
                             families_per_plan=families_per_plan(world, plans), wall_s=took, errors=reports[0])
    check(reports)
    families = families_per_plan(world, plans)
    added = sum(len(between_families(i, p, families_of(i, families))) - len(families_of(i, families))
                for i, p in enumerate(plans) if families < len(FAMILIES))  # the between-steps axis' LMs
    assert len(reports[0]) == families * len(plans) + added + len(FAMILIES) * len(others) + \
        len(COMPILED.get(world, [])) + len(cover)
    ran = {tuple(k.split("/")[:2]) + (k.split("/")[3] if k.count("/") == 3 else "model",) for k in reports[0]}
    assert {(s if isinstance(s, str) else s.describe(), name, task) for _, s, name, task, _ in cover} <= ran, \
        "plan_coverage's covering runs, by plan/family/task"
    assert {k.split("/")[0] for k in reports[0]} >= {p.describe() for p in plans}  # every enumerated plan ran
    check_between(reports[0], plans)
    ran = {k.split("/")[3] for k in reports[0] if k.count("/") == 3}
    assert ran == {"weighted", "dpo", "grpo", "reward"}, f"the tasks turned by index: {sorted(ran)}"
    assert {"/".join(k.split("/")[:2]) for k in reports[0]} >= {"/".join(c) for c in COMPILED.get(world, [])}
    print(f"\nplan parity on {world} ranks: {len(plans)} enumerated plans x {families} families + "
          f"{len(others)} ready/extra x {len(FAMILIES)} + {len(COMPILED.get(world, []))} compiled = {len(seconds)} "
          f"runs in {took:.0f} s "
          f"({sum(seconds.values()) / len(seconds):.2f} s a run)")
    return results


def test_the_worlds_cover_every_pair():
    """Every (plan field value, family) and (plan field value, task) pair a world's plans allow runs in some world,
    by the rotation or a covering run (plan_coverage); the report lists where."""
    from .plan_coverage import WORLDS, all_covers, allowed_pairs, report

    covers = all_covers()
    family_pairs, task_pairs = allowed_pairs()
    last = covers[WORLDS[-1]]
    assert not family_pairs - last.family_pairs, sorted(family_pairs - last.family_pairs, key=str)
    assert not task_pairs - last.task_pairs, sorted(task_pairs - last.task_pairs, key=str)
    assert all(len(c.runs) <= 24 for c in covers.values()), {w: len(c.runs) for w, c in covers.items()}  # CI time
    print("\n" + report())


def test_every_enumerated_plan_on_2_ranks():
    run_generated(2, 900)


def test_every_enumerated_plan_on_4_ranks():
    run_generated(4, 1200)


EIGHT_RANK_COST = ["tp2.5d", "tp=8,tp_mode=3d,activation_checkpoint=true"]  # the cost model, in this world


# groups made once: a hybrid plan with dp, pp, tp and the tied embedding's groups, on a small GPT
GROUPS_PLAN, GROUP_LOADS = "dp=2,pp=2,tp=2,microbatches=2", 200
SMALL = dict(vocab_size=64, n_positions=16, dim=32, n_heads=4, n_layers=2)


def groups_worker(loads: int = GROUP_LOADS) -> dict:
    """Threads of this process (``/proc/self/task``) and groups made, after the first of ``loads``
    ``cuboid.load`` calls under one plan and after the last, and the seconds the loads took."""
    import os
    import time

    import cuboid
    from cuboid.parallel import timeouts

    start = time.perf_counter()
    cuboid.load("gpt-debug", GROUPS_PLAN, seed=0, **SMALL)
    first = (len(os.listdir("/proc/self/task")), len(timeouts._MADE))
    for _ in range(loads - 1):
        cuboid.load("gpt-debug", GROUPS_PLAN, seed=0, **SMALL)
    last = (len(os.listdir("/proc/self/task")), len(timeouts._MADE))
    return {"threads": (first[0], last[0]), "groups": (first[1], last[1]), "seconds": time.perf_counter() - start}


def eight_rank_worker(world, cover=()):
    from .cost_checks import cost_worker

    return generated_worker(world, cover), cost_worker(EIGHT_RANK_COST), groups_worker()


def test_every_enumerated_plan_on_8_ranks():
    """Plan parity, and (test_cost's check, run here to share the world) bytes sent and held under 2.5D and
    3D equal the cost model's."""
    from .cost_checks import check_cost

    results = run_generated(8, 1800, eight_rank_worker)
    check_cost([c for _, c, _ in results])
    assert all(len(c) == len(EIGHT_RANK_COST) for _, c, _ in results)
    # groups made once per (ranks, name, timeout): 200 loads under a hybrid plan leave the threads (each gloo
    # group holds its own) and the groups where the first load left them
    for rank, (_, _, g) in enumerate(results):
        assert g["groups"][0] >= 4 and g["groups"][1] == g["groups"][0], (rank, g)
        assert g["threads"][1] == g["threads"][0], (rank, f"{GROUP_LOADS} loads", g)
    print(f"{GROUP_LOADS} loads under {GROUPS_PLAN}: threads {results[0][2]['threads']}, groups "
          f"{results[0][2]['groups']}, {max(g['seconds'] for _, _, g in results):.1f} s")
