"""One optimizer step over a global batch, the same on one process and under data parallelism.

The global batch is split into micro-batches, each rank holding its own
share. The loss of every micro-batch is a mean over its label positions; to
take exactly the single-process step (the mean over *all* label positions of
the global batch), each micro-batch loss is weighted by its share of the
global count of positions before backward:

    backward(loss_i * n_i * dp / N)      N = sum of n_i over micro-batches and ranks

DDP then averages over the ``dp`` ranks, so the gradient is
``grad(sum_i loss_i * n_i) / N``, the single-process gradient. Micro-batches
but the last run under ``no_sync`` (one all-reduce per step).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cuboid.parallel import Mesh, unwrap
from cuboid.parallel.optim import clip_grad_norm_


@dataclass
class StepResult:
    loss: float          # mean over the global batch's label positions
    targets: int         # label positions in the global batch
    grad_norm: Optional[float]


def _all_reduce_sum(values: Sequence[float], mesh: Optional[Mesh], axis: str = "dp") -> list[float]:
    if mesh is None or mesh.size(axis) == 1:
        return list(values)
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, group=mesh.group(axis))
    return t.tolist()


def autocast_for(dtype: Optional[str], device: torch.device):
    """``torch.autocast`` for a plan dtype (``bf16`` / ``fp16``); a null context for fp32."""
    if dtype in (None, "fp32"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Sequence[dict],
               mesh: Optional[Mesh] = None, *, max_grad_norm: Optional[float] = None,
               dtype: Optional[str] = None, scaler: Optional[torch.amp.GradScaler] = None,
               norm_reducer=None, split_inputs=None) -> StepResult:
    """Forward/backward every micro-batch of this rank's share, then one optimizer step.

    ``norm_reducer`` (:func:`cuboid.parallel.norm_reducer`) makes the clipping
    norm the whole model's under tensor parallelism; ``split_inputs``
    (:func:`cuboid.parallel.input_splitter`) gives the 2D/2.5D/3D modes their
    batch blocks after the targets were counted on the whole share.
    """
    core = unwrap(model)
    counts = [core.num_targets(b) for b in micro_batches]
    local = sum(counts)
    total, = _all_reduce_sum([local], mesh)
    if total == 0:
        raise ValueError("the global batch has no labels to learn from (every label is -100)")
    dp = mesh.size("dp") if mesh is not None else 1
    device = next(core.parameters()).device
    loss_sum = 0.0
    for i, (batch, n) in enumerate(zip(micro_batches, counts)):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast_for(dtype, device):
                loss = model(**(split_inputs(batch) if split_inputs else batch)).loss
            if n == 0:
                loss = loss.nan_to_num(0.0) * 0.0  # keep every rank in the all-reduce
            weighted = loss.float() * (n * dp / total)
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
        loss_sum += float(loss.detach()) * n
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = None
    if max_grad_norm is not None:
        grad_norm = float(clip_grad_norm_([p for p in core.parameters() if p.grad is not None], max_grad_norm,
                                          norm_reducer=norm_reducer))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_total, = _all_reduce_sum([loss_sum], mesh)
    return StepResult(loss=loss_total / total, targets=int(total), grad_norm=grad_norm)


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Split a batch dict along dim 0 into ``parts`` equal micro-batches."""
    size = next(iter(batch.values())).shape[0]
    if size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal micro-batches")
    step = size // parts
    return [{k: v[i * step:(i + 1) * step] for k, v in batch.items()} for i in range(parts)]


def rank_share(batch: dict, mesh: Optional[Mesh]) -> dict:
    """This dp rank's contiguous share of a global batch."""
    if mesh is None or mesh.size("dp") == 1:
        return batch
    dp, r = mesh.size("dp"), mesh.coords["dp"]
    return split_batch(batch, dp)[r]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[dict], mesh: Optional[Mesh] = None,
             dtype: Optional[str] = None, split_inputs=None) -> dict:
    """Mean loss over label positions and, for classification, accuracy, reduced over dp."""
    core = unwrap(model)
    was_training = core.training
    core.eval()
    device = next(core.parameters()).device
    loss_sum = n_sum = correct = seen = 0.0
    for batch in batches:
        n = core.num_targets(batch)
        with autocast_for(dtype, device):
            out = core(**(split_inputs(batch) if split_inputs else batch))
        if n:
            loss_sum += float(out.loss) * n
            n_sum += n
        labels = batch.get("labels")
        if labels is not None and labels.dim() == 1:  # one label per example: accuracy
            correct += float((out.logits.argmax(-1) == labels).sum())
            seen += labels.numel()
    loss_sum, n_sum, correct, seen = _all_reduce_sum([loss_sum, n_sum, correct, seen], mesh)
    if was_training:
        core.train()
    metrics = {"eval_loss": loss_sum / max(n_sum, 1)}
    if seen:
        metrics["accuracy"] = correct / seen
    else:
        metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    return metrics
