"""Pipeline parallelism: stages cut from the sharding spec, run by ``torch.distributed.pipelining``.

Work in progress: this module holds the pieces that are built and tested —
the cost-balanced stage cut, the per-stage model (only the stage's own
layers are kept, so a rank allocates only them), the stage module that runs
a zoo model's ``embed`` / blocks / ``head`` with the stream between stages
as plain tensors, and one training step under torch's ``ScheduleGPipe`` /
``Schedule1F1B``. Plans with ``pp > 1`` are still refused by
``Plan.require_implemented`` until data, tensor and interleaved compositions,
evaluation and checkpoints are in (issue 11).

**Stage cut.** A spec names the blocks (``spec.blocks``), the modules the
first stage owns (``spec.first``: embeddings) and those the last owns
(``spec.last``: final norm, pooler, heads). A module in both (GPT's tied
token embedding) lives on both stages, and its gradient is summed over the
two (Megatron's embedding group) so that both copies take the single-device
step. :func:`cut_stages` balances the blocks by cost, counting the first
stage's embedding and the last stage's head (an LM head is several blocks
of work at GPT-2's vocabulary); a stage may hold no block.

**The stream between stages** is ``(x, residual, attention_mask, labels)``:
the residual of pre-LN models starts as zeros (``norm(x + 0)`` is
``norm(x)`` exactly), post-LN models pass zeros through, a model without an
attention mask passes a (B, 1) mask of ones (no key is masked). Labels
travel with their micro-batch to the last stage, which returns the
micro-batch's loss weighted by its share of the global batch's label count.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from . import comm


def cut_stages(block_costs: Sequence[float], stages: int, first_cost: float = 0.0,
               last_cost: float = 0.0) -> list[range]:
    """Contiguous block ranges for ``stages`` stages minimising the costliest stage.

    The first stage also pays ``first_cost`` (embeddings), the last
    ``last_cost`` (norm, head, loss). Exact (dynamic programming over the cut
    points); ties go to the earlier cut. A stage may get no block when the
    costs say so (a head worth more than the blocks).
    """
    n = len(block_costs)
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got {stages}")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + float(c))

    def cost(s: int, a: int, b: int) -> float:
        extra = (first_cost if s == 0 else 0.0) + (last_cost if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    INF = float("inf")
    # best[s][b]: the least max-cost of stages 0..s covering blocks [0, b)
    best = [[INF] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for b in range(n + 1):
        best[0][b] = cost(0, 0, b)
    for s in range(1, stages):
        for b in range(n + 1):
            for a in range(b + 1):
                v = max(best[s - 1][a], cost(s, a, b))
                if v < best[s][b] - 1e-12 * max(1.0, abs(v)):
                    best[s][b], cut[s][b] = v, a
    bounds, b = [], n
    for s in range(stages - 1, 0, -1):
        a = cut[s][b]
        bounds.append(range(a, b))
        b = a
    bounds.append(range(0, b))
    return bounds[::-1]


def zoo_costs(config, seq_len: Optional[int] = None) -> tuple[list[float], float, float]:
    """(per-block, embedding, head) forward costs in multiply-adds per token of a zoo config.

    A block: QKV, projection and MLP matmuls plus attention over ``seq_len``
    keys; the embedding: a lookup (GPT, BERT) or the patch matmul (ViT); the
    head: the vocabulary matmul of an LM head, or the classifier.
    """
    h = config.dim
    t = seq_len or getattr(config, "n_positions", None) or getattr(config, "n_patches", 0) + 1
    block = 4 * h * h + 2 * h * config.hidden + 2 * t * h
    if hasattr(config, "patch_size"):
        embed = config.channels * config.patch_size ** 2 * h
    else:
        embed = 3 * h
    head = h * getattr(config, "vocab_size", 0) if getattr(config, "head", "") in ("lm", "mlm") else \
        h * (getattr(config, "num_labels", 0) or 0) + h * h
    return [float(block)] * config.n_layers, float(embed), float(head)


class Elsewhere(nn.Module):
    """Stands where a module of another stage was: no parameters, calling it is an error."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.where = f"{name} (not on pipeline stage {stage})"

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.where} was called")

    def extra_repr(self) -> str:
        return self.where


def keep_stage(model: nn.Module, spec, blocks: range, stage: int, stages: int) -> nn.Module:
    """Drop from ``model`` (in place; meta or not) what stage ``stage`` does not own; returns it.

    Blocks outside ``blocks`` and top-level modules of the other end are
    replaced by :class:`Elsewhere`, so the kept ones keep their names (a
    checkpoint written from a stage uses the single-device names).
    """
    seq = getattr(model, spec.blocks)
    for i in range(len(seq)):
        if i not in blocks:
            seq[i] = Elsewhere(f"{spec.blocks}.{i}", stage)
    owned = set()
    if stage == 0:
        owned |= set(spec.first)
    if stage == stages - 1:
        owned |= set(spec.last)
    for name, child in list(model.named_children()):
        if name != spec.blocks and name not in owned and (name in spec.first or name in spec.last):
            setattr(model, name, Elsewhere(name, stage))
    return model


@dataclass
class StageInfo:
    stage: int
    stages: int
    blocks: range
    input_keys: tuple = ()    # the batch keys the first stage takes, in order


def _key_mask(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """A (B, T) attention mask (1 = token) as the attention kernel's bool key mask; None when all are kept."""
    m = mask.to(torch.bool)
    return None if bool(m.all()) else m


class StageModule(nn.Module):
    """One pipeline stage of a zoo model: ``embed`` (first), its blocks, ``head`` and loss (last).

    ``forward`` takes the batch tensors in ``info.input_keys`` order on the
    first stage and the stream ``(x, residual, mask, labels)`` on the others;
    the last stage returns the micro-batch's mean loss.
    """

    def __init__(self, model: nn.Module, spec, info: StageInfo) -> None:
        super().__init__()
        self.model, self.spec, self.info = model, spec, info
        self._embed_args = tuple(inspect.signature(model.embed).parameters)
        self._seen = False

    def forward(self, *inputs):
        info, model = self.info, self.model
        if info.stage == 0:
            batch = dict(zip(info.input_keys, inputs))
            x = model.embed(**{k: batch[k] for k in self._embed_args if k in batch})
            residual = torch.zeros_like(x)
            mask = batch.get("attention_mask")
            if mask is None:  # no key is masked
                mask = torch.ones(x.shape[0], 1, dtype=torch.long, device=x.device)
            labels = batch["labels"]
        else:
            x, residual, mask, labels = inputs
            if not self._seen:
                # torch's stage first runs every non-first stage once on uninitialised tensors to infer
                # output shapes; labels and masks there are noise, so that pass ignores and keeps all
                labels, mask = torch.full_like(labels, -100), torch.ones_like(mask)
            self._seen = True
        key_mask = _key_mask(mask)
        seq = getattr(model, self.spec.blocks)
        for i in info.blocks:
            x, r = seq[i](x, residual, key_mask)
            residual = r if r is not None else torch.zeros_like(x)
        if info.stage < info.stages - 1:
            return x, residual, mask, labels
        return model.head(x, residual, labels).loss


def _weighted(loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The pipeline's loss function: a micro-batch's mean loss times its weight (its share of the labels)."""
    return loss * weight.reshape(())


class Pipeline:
    """Runs one training step of a stage model under a ``torch.distributed.pipelining`` schedule.

    ``schedule``: ``gpipe`` or ``1f1b``. Tied parameters (held by the first
    and the last stage) get their gradients summed over the embedding group
    after the schedule's backward passes.
    """

    SCHEDULES = ("gpipe", "1f1b")

    def __init__(self, model: nn.Module, spec, mesh, blocks: Sequence[range], *, schedule: str = "1f1b",
                 microbatches: int = 1) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if schedule not in self.SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; schedules: {', '.join(self.SCHEDULES)}")
        stages = mesh.size("pp")
        if schedule == "1f1b" and microbatches < stages:
            raise ValueError(f"1F1B needs at least as many micro-batches as stages ({stages}), got {microbatches}; "
                             f"use more micro-batches or the gpipe schedule")
        self.mesh, self.stage, self.stages = mesh, mesh.coords["pp"], stages
        self.microbatches = microbatches
        self.info = StageInfo(self.stage, stages, blocks[self.stage])
        self.module = StageModule(model, spec, self.info)
        device = next(model.parameters()).device
        self._stage = PipelineStage(self.module, self.stage, stages, device, group=mesh.group("pp"))
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self._schedule = kind(self._stage, microbatches, loss_fn=_weighted, scale_grads=False)
        tied = [n for n in spec.first if n in spec.last]
        self.tied = [p for n in tied for p in getattr(model, n).parameters()] \
            if self.stage in (0, stages - 1) else []
        self.embedding_group = embedding_group(mesh) if tied else None

    def run(self, batch: dict, weights: torch.Tensor) -> Optional[torch.Tensor]:
        """Forward and backward of ``batch`` (this dp rank's share) in micro-batches; the last stage
        returns the sum of the weighted micro-batch losses, the others None."""
        if not self.info.input_keys:
            self.info.input_keys = tuple(k for k, v in batch.items() if isinstance(v, torch.Tensor))
        args = tuple(batch[k] for k in self.info.input_keys) if self.stage == 0 else ()
        last = self.stage == self.stages - 1
        losses: list = []
        if last:
            self._schedule.step(*args, target=weights, losses=losses, return_outputs=False)
        else:
            self._schedule.step(*args)
        for p in self.tied:
            if p.grad is not None:
                comm.all_reduce_(p.grad, self.embedding_group)
        return torch.stack([l.reshape(()) for l in losses]).sum() if last else None


def embedding_group(mesh):
    """The group of the first and last pipeline stage ranks with this rank's other coordinates
    (None elsewhere); every such group of the world is made, in one order, on every rank."""
    import torch.distributed as dist

    plan = mesh.plan
    if plan.pp == 1:
        return None
    grid = torch.arange(plan.world_size).reshape(plan.pp, -1)
    mine = None
    for col in range(grid.shape[1]):
        ranks = [int(grid[0, col]), int(grid[-1, col])]
        group = dist.new_group(ranks)
        if mesh.rank in ranks:
            mine = group
            comm.name_group(group, "pp_embed")
    return mine
