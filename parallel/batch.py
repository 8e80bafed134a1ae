"""Batch helpers: pad a batch with rows that weigh nothing, split it into equal micro-batches.

Used by the training step (dp shares, micro-batches), the 2D/3D batch split
(:mod:`.apply`) and the pipeline (micro-batches of a schedule); they sit
below all three.
"""
from __future__ import annotations

import torch


def pad_rows(key, x: torch.Tensor, pad: int) -> torch.Tensor:
    """``x`` with ``pad`` rows added on dim 0 that weigh nothing: labels -100, other inputs the last row again."""
    if not pad:
        return x
    fill = torch.full_like(x[:1], -100) if key == "labels" else x[-1:]
    return torch.cat([x, fill.expand(pad, *x.shape[1:])])


def pad_batch(batch: dict, multiple: int) -> dict:
    """``batch`` padded on dim 0 to a multiple of ``multiple`` with rows that weigh nothing (:func:`pad_rows`)."""
    size = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0]
    pad = (-size) % multiple
    return {k: pad_rows(k, v, pad) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} if pad else batch


def split_batch(batch: dict, parts: int) -> list[dict]:
    """Split a batch dict along dim 0 into ``parts`` equal micro-batches."""
    size = next(iter(batch.values())).shape[0]
    if size % parts:
        raise ValueError(f"a batch of {size} does not split into {parts} equal micro-batches")
    step = size // parts
    return [{k: v[i * step:(i + 1) * step] for k, v in batch.items()} for i in range(parts)]
