"""One optimizer step over a global batch, the same on one process and under every plan.

Every rank passes the same global batch; :func:`train_step` takes this rank's
dp share (:func:`rank_share`) and splits it into micro-batches. Each
micro-batch's count ``n_i`` (its label positions, or what the task's
:meth:`~cuboid.tasks.Task.count` counts) is known before the forward, and
summed over micro-batches and ranks into the step's ``N``. The model's own
loss of a micro-batch is a mean over its label positions, so to take exactly
the single-process step (the mean over *all* label positions of the global
batch) it is weighted by its share of the global count before backward;
a task with a loss of its own (``own_loss``) returns a sum, weighted by
``dp / N`` alone:

    backward(loss_i * n_i * dp / N)      N = sum of n_i over micro-batches and ranks
    backward(sum_i * dp / N)             (a task's own summed loss)

The model (prepared by ``cuboid.load``) averages gradients over the ``dp``
ranks, so the gradient is ``grad(sum_i loss_i * n_i) / N``, the
single-process gradient. Micro-batches but the last run without the dp
all-reduce (one all-reduce per step). What the tensor modes split (batch
blocks under 2D/3D) the model splits itself.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cuboid.data.formats import Filler
from cuboid.parallel import Mesh, comm, set_gradient_sync, split_batch, state_of, unwrap, zero
from cuboid.parallel.optim import clip_grad_norm_
from cuboid.tasks import for_model, resolve
from cuboid.zoo import family_of


@dataclass
class StepResult:
    loss: float          # mean over the global batch's label positions (the task's counted units)
    targets: int         # label positions (counted units) in the global batch
    grad_norm: Optional[float]
    metrics: dict = field(default_factory=dict)  # a task's own metrics, each a mean over the counted units


def _count(task, core: nn.Module, batch: dict) -> int:
    """A micro-batch's count (the step's denominator): the task's, or the model's label positions."""
    return int(task.count(batch, core)) if task is not None else core.num_targets(batch)


def _own(task) -> bool:
    return task is not None and task.own_loss


def _device_of(model: nn.Module) -> torch.device:
    p = next(unwrap(model).parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def all_reduce_sum(values: Sequence[float], mesh: Optional[Mesh], device: torch.device,
                    axis: str = "dp") -> list[float]:
    """Sum ``values`` over ``axis``; the tensor lives on ``device`` (NCCL needs CUDA tensors)."""
    if mesh is None or mesh.size(axis) == 1:
        return list(values)
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    t = torch.tensor(list(values), dtype=dtype, device=device)
    comm.all_reduce_(t, mesh.group(axis))
    return t.tolist()


def _same_count(batches: list, mesh: Optional[Mesh], device: torch.device) -> list:
    """``batches`` padded with :class:`Filler` copies of the first to the most any dp rank has (one
    all-reduce, on every rank whatever its batches); a one-line ValueError on every rank when one has none."""
    if mesh is None or mesh.size("dp") == 1:
        return batches
    most, least = all_reduce_max([len(batches), -len(batches)], mesh, device)
    most, least = int(most), -int(least)
    if least == 0 and most > 0:
        raise ValueError(f"a data-parallel rank has no eval batch (the others have up to {most}): give every "
                         "rank one, as cuboid.data.formats.eval_batches deals them")
    return batches + [Filler(batches[0])] * (most - len(batches))


def all_reduce_max(values: Sequence[float], mesh: Optional[Mesh], device: torch.device,
                   axis: str = "dp") -> list[float]:
    """The largest of each of ``values`` over ``axis``."""
    if mesh is None or mesh.size(axis) == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    comm.all_reduce_(t, mesh.group(axis), op="max")
    return t.tolist()


def autocast_for(dtype: Optional[str], device: torch.device):
    """``torch.autocast`` for a plan dtype (``bf16`` / ``fp16``); a null context for fp32."""
    if dtype in (None, "fp32"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def sync_found_inf(scaler, optimizer, mesh: Optional[Mesh]) -> None:
    """Make an fp16 grad scaler's inf check agree on every rank (max over the world) after ``unscale_``.

    Under tensor parallelism each rank sees only its shards' gradients, under
    ZeRO only its pieces (:func:`cuboid.parallel.zero.unscale_`); an inf in
    one of them must make every rank skip the step, or the shards diverge.
    (torch's ``ShardedGradScaler`` does the same for FSDP.) One flag per rank
    travels, however many devices its gradients were on, so the collective
    never depends on what one rank holds.
    """
    if mesh is None or mesh.world_size == 1 or not dist.is_initialized():
        return
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer))
    if state is None or "found_inf_per_device" not in state:
        raise RuntimeError("sync_found_inf: call scaler.unscale_(optimizer) first")
    found = state["found_inf_per_device"]
    device = next(iter(found.values())).device if found else scaler._scale.device
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for f in found.values():
        flag = torch.maximum(flag, f.to(device))
    comm.all_reduce_(flag, dist.group.WORLD, "max")
    if not found:  # scaler.step needs a flag to read
        found[device] = flag
    for f in found.values():
        f.copy_(flag)


def _mesh_of(model: nn.Module, mesh: Optional[Mesh]) -> Mesh:
    return mesh if mesh is not None else state_of(unwrap(model)).mesh


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, global_batch: dict, *,
               microbatches: Optional[int] = None, max_grad_norm: Optional[float] = None,
               dtype: Optional[str] = None, scaler: Optional[torch.amp.GradScaler] = None,
               mesh: Optional[Mesh] = None, share: bool = False, task=None) -> StepResult:
    """This rank's share of ``global_batch`` forward and backward in ``microbatches`` parts, then one step.

    ``mesh`` and ``dtype`` default to the model's (``model.parallel.mesh``,
    ``model.parallel.plan.dtype``); ``microbatches`` to the plan's. Clipping reduces the
    norm over every shard of every parameter (their placements say how). ``share=True``: the batch
    is already this rank's share (a stream read per dp rank, :mod:`cuboid.data.streaming`); every rank of a
    dp group passes the same one, and the loss is weighted by the step's targets over all ranks as ever.
    ``task``: a :class:`cuboid.tasks.Task` whose count, model inputs and (``own_loss``) summed loss the step
    takes (or what :func:`cuboid.tasks.resolve` makes one of: a task class, a name with options); None: the
    model's own loss over its label positions.
    """
    task = resolve(task) if task is not None else None
    core = unwrap(model)
    state = state_of(core)
    mesh = mesh if mesh is not None else state.mesh
    dtype = dtype if dtype is not None else state.plan.dtype
    parts = microbatches or state.plan.microbatches or 1
    mine = global_batch if share else rank_share(global_batch, mesh)
    if state.pipeline is not None:
        return _pipeline_step(core, state.pipeline, optimizer, mine, mesh, parts, max_grad_norm, dtype, scaler, task)
    micro_batches = split_batch(mine, parts) if parts > 1 else [mine]
    device = _device_of(model)
    counts, globals_, total = _global_counts(task, core, micro_batches, mesh, device)
    dp = mesh.size("dp") if mesh is not None else 1
    loss_sum, metric_sums = 0.0, {}
    try:
        for i, (batch, n) in enumerate(zip(micro_batches, counts)):
            last = i == len(micro_batches) - 1
            set_gradient_sync(model, last)
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                batch = _to(batch, device)
                with autocast_for(dtype, device):
                    out = model(**(task.inputs(batch) if task is not None else batch))
                if _own(task):
                    summed, metrics = task.loss(out, batch)
                    weighted = _weighted(core, out, dp / total, globals_[i] / total, summed)
                    loss_sum += float(summed.detach())
                    for k, v in metrics.items():
                        metric_sums[k] = metric_sums.get(k, 0.0) + float(v)
                else:
                    weighted = _weighted(core, out, n * dp / total, globals_[i] / total)
                    loss_sum += float(out.loss.detach()) * n if n else 0.0  # (a mean over no target is NaN)
                (scaler.scale(weighted) if scaler is not None else weighted).backward()
    finally:
        set_gradient_sync(model, True)
    grad_norm = _update(core, optimizer, mesh, max_grad_norm, scaler)
    keys = sorted(metric_sums)  # the task's, the same names on every rank
    loss_total, *metric_totals = all_reduce_sum([loss_sum] + [metric_sums[k] for k in keys], mesh, device)
    return StepResult(loss=loss_total / total, targets=int(total), grad_norm=grad_norm,
                      metrics={k: v / total for k, v in zip(keys, metric_totals)})


def _weighted(core: nn.Module, out, share: float, global_share: float,
              summed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What one micro-batch backpropagates: its loss (the model's mean, or a task's ``summed`` loss) times
    this rank's ``share`` of the step's targets; a mixture-of-experts auxiliary loss (``output_router_logits``:
    in the model's loss, beside a task's) is the whole global micro-batch's
    (:class:`cuboid.parallel.experts.BalanceReduce`), so it is weighed by that micro-batch's ``global_share``
    instead, whatever this rank's targets (none: the rank still joins every collective)."""
    loss = out.loss.float() if summed is None else summed.float()
    aux = getattr(out, "aux_loss", None)
    if aux is None or getattr(out, "router_logits", None) is None:  # no auxiliary loss in ``loss``
        return (loss.nan_to_num(0.0) * 0.0) if share == 0 else loss * share
    aux = core.config.router_aux_loss_coef * aux.float()
    lm = loss - aux if summed is None else loss
    lm = lm.nan_to_num(0.0) * 0.0 if share == 0 else lm * share
    return lm + aux * global_share


def _pipeline_step(core, pipe, optimizer, share: dict, mesh: Mesh, parts: int, max_grad_norm, dtype,
                   scaler, task=None) -> StepResult:
    """:func:`train_step` under pipeline parallelism: the schedule (``pipe``) runs the micro-batches; a task
    with its own loss has it called on the last stage (:func:`_task_objective`)."""
    if parts != pipe.microbatches:
        raise ValueError(f"this pipeline runs {pipe.microbatches} micro-batches per step (the plan's "
                         f"microbatches), not {parts}")
    if pipe.parts > 1:  # 2D/3D: every micro-batch must split into the batch blocks; padded rows weigh nothing
        _check_unpadded(task, share, pipe)
        share = pipe.pad(share)
    micro = split_batch(share, parts)  # also says when the share does not split
    device = _device_of(core)
    counts, globals_, total = _global_counts(task, core, micro, mesh, device)
    dp = mesh.size("dp")
    # the model's mean loss weighs n_i dp / N; a task's summed loss dp / N
    weights = torch.tensor([(1 if _own(task) else n) * dp / total for n in counts], dtype=torch.float32,
                           device=device)
    # a mixture of experts' auxiliary loss is the global micro-batch's: weighed by its share (see _weighted)
    aux_weights = torch.tensor([g / total for g in globals_], dtype=torch.float32, device=device)
    scale = 1.0
    if scaler is not None:  # the schedule's loss function scales each micro-batch's loss through its weight
        scale_t = scaler.scale(torch.ones((), dtype=torch.float32, device=device))
        weights, aux_weights, scale = weights * scale_t, aux_weights * scale_t, float(scale_t)
    sums: dict = {}  # a task's summed loss and metrics, recorded on the last stage
    objective = _task_objective(task, sums, share) if _own(task) else {}
    batch = _to(share if _own(task) or task is None else {k: v for k, v in share.items() if k not in task.targets},
                device)
    with autocast_for(dtype, device):
        local = pipe.run(batch, weights, aux_weights, **objective)
    if _own(task):  # the task's loss (the aux loss apart, as on one device) and metrics, means over N
        loss, metrics = _last_stage_sums(sums, pipe, mesh, device)
        loss, metrics = loss / total, {k: v / total for k, v in metrics.items()}
    else:  # the last stage's sum of weighted losses is dp / N * sum(n_i loss_i): sum over dp, share over pp
        loss = torch.zeros(1, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
        if local is not None:
            loss += float(local.detach()) / dp / scale
        comm.all_reduce_(loss, mesh.group("dp"))
        comm.broadcast_(loss, mesh.group("pp"), pipe.last_rank)
        loss, metrics = float(loss), {}
    grad_norm = _update(core, optimizer, mesh, max_grad_norm, scaler, sum_group=mesh.group("pp"),
                        exclude={id(p) for p in pipe.counted_elsewhere})
    return StepResult(loss=loss, targets=int(total), grad_norm=grad_norm, metrics=metrics)


def _update(core, optimizer, mesh: Mesh, max_grad_norm, scaler, **clip) -> Optional[float]:
    """The optimizer step after the backward passes (fp16: the inf checks agreed over the world, all skip or
    none; ZeRO: unscaled and clipped on the pieces the optimizer steps); returns the gradient norm before
    clipping (None: no clipping). ``clip``: :func:`clip_grad_norm_`'s pipeline arguments."""
    if scaler is not None:
        zero.unscale_(scaler, optimizer)
        sync_found_inf(scaler, optimizer, mesh)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(clip_grad_norm_(list(core.parameters()), max_grad_norm, **clip))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def _global_counts(task, core: nn.Module, micro_batches: list, mesh: Optional[Mesh], device) -> tuple:
    """(each micro-batch's count here, each one's count over the dp ranks, the step's total N); a
    ValueError when N is 0."""
    counts = [_count(task, core, b) for b in micro_batches]
    globals_ = all_reduce_sum(counts, mesh, device)
    total = sum(globals_)
    if total == 0:
        raise ValueError("the global batch has no labels to learn from (every label is -100)")
    return counts, globals_, total


def _check_unpadded(task, share: dict, pipe) -> None:
    """Refuse a task's own loss on a dp share that 2D/3D batch blocks would pad under pp: the padded rows
    would reach the task's loss and count (the model's own loss ignores them by their labels)."""
    rows = next(v for v in share.values() if isinstance(v, torch.Tensor)).shape[0]
    if _own(task) and rows % (pipe.microbatches * pipe.parts):
        raise ValueError(f"task {task.label} under pp with batch blocks needs a dp share of a multiple of "
                         f"{pipe.microbatches * pipe.parts} rows (micro-batches x blocks), got {rows}")


def _task_objective(task, sums: dict, batch: dict) -> dict:
    """:meth:`~cuboid.parallel.pipeline.Pipeline.run`'s objective for a task with its own loss: its
    targets (those ``batch`` holds), its forward's keyword arguments as the head's, and a loss of the outputs
    and the micro-batch (one device's) that records the summed loss (key None) and metrics in ``sums`` on the
    last stage (called once per micro-batch there)."""
    def loss(out, micro_batch: dict) -> torch.Tensor:
        summed, metrics = task.loss(out, micro_batch)
        for key, value in ((None, summed), *metrics.items()):
            sums[key] = sums.get(key, 0.0) + float(value.detach() if isinstance(value, torch.Tensor) else value)
        return summed

    targets = tuple(k for k in task.targets if k in batch)  # an optional target (GRPO's old_logps) may be absent
    return dict(loss=loss, targets=targets, head_kwargs=dict(task.forward_kwargs))


def _last_stage_sums(sums: dict, pipe, mesh: Mesh, device) -> tuple:
    """``(loss sum, {metric: sum})`` of the last stage's recorded ``sums`` (:func:`_task_objective`) summed
    over dp, on every rank: the metric names travel from the last stage's rank with the values."""
    group, src = mesh.group("pp"), pipe.last_rank
    names = "\n".join(sorted(k for k in sums if k is not None)).encode() if pipe.has_last else b""
    size = comm.broadcast_(torch.tensor([len(names)], dtype=torch.int64, device=device), group, src)
    text = torch.tensor(list(names), dtype=torch.uint8, device=device) if pipe.has_last else \
        torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        text = comm.broadcast_(text, group, src)
    keys = bytes(text.tolist()).decode().split("\n") if int(size.item()) else []
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    values = torch.tensor([sums.get(None, 0.0)] + [sums.get(k, 0.0) for k in keys], dtype=dtype, device=device)
    comm.all_reduce_(values, mesh.group("dp"))
    values = comm.broadcast_(values, group, src).tolist()
    return values[0], dict(zip(keys, values[1:]))


def rank_share(batch: dict, mesh: Optional[Mesh]) -> dict:
    """This dp rank's contiguous share of a global batch."""
    if mesh is None or mesh.size("dp") == 1:
        return batch
    dp, r = mesh.size("dp"), mesh.coords["dp"]
    size = next(iter(batch.values())).shape[0]
    if size % dp:
        raise ValueError(f"a global batch of {size} does not split into {dp} equal data-parallel shares")
    return split_batch(batch, dp)[r]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], mesh: Optional[Mesh] = None,
             dtype: Optional[str] = None, task=None) -> dict:
    """``eval_loss`` (the mean over counted units) and the task's metric (perplexity, accuracy), reduced
    over dp. ``task``: a :class:`cuboid.tasks.Task` (default: the task of the model's head).

    ``batches`` are this rank's own (any size: the model pads what its plan
    splits); every rank of a tensor-parallel group must see the same ones.
    Every dp rank runs the same number of forwards (a forward may hold
    collectives over dp: ZeRO-3's gathers, the experts' all-to-alls): the
    ranks agree on the most batches any of them has, and a rank with fewer
    runs its first batch again with weight 0 (:func:`cuboid.data.formats.eval_batches`
    deals them so already, marking its fillers). Every dp rank needs at least
    one batch. The sums reduced are the task's declared ``eval_keys``.
    """
    core = unwrap(model)
    mesh = _mesh_of(model, mesh)
    dtype = dtype if dtype is not None else state_of(core).plan.dtype
    task = task if task is not None else for_model(family_of(core).name, core.config.head)
    was_training = core.training
    core.eval()
    device = _device_of(model)
    loss_sum = n_sum = 0.0
    sums = dict.fromkeys(task.eval_keys, 0.0)
    for batch in _same_count(list(batches), mesh, device):
        filler = isinstance(batch, Filler)
        batch = _to(batch, device)
        n = _count(task, core, batch)
        with autocast_for(dtype, device):
            out = core(**task.inputs(batch))
        if filler:  # run for the collectives only
            continue
        if task.own_loss:
            loss_sum += float(task.loss(out, batch)[0])
        elif n:
            loss_sum += float(out.loss) * n
        n_sum += n
        for k, v in task.eval_sums(out, batch).items():
            sums[k] += float(v)
    loss_sum, n_sum, *values = all_reduce_sum([loss_sum, n_sum, *(sums[k] for k in task.eval_keys)], mesh, device)
    zero.reshard(core)  # ZeRO-3: free the gathered root unit a forward without backward leaves behind
    if was_training:
        core.train()
    return task.eval_metrics(loss_sum / max(n_sum, 1), dict(zip(task.eval_keys, values)))
