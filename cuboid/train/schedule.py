"""Learning-rate recipe of the fine-tune loop: scaling with the global batch, warmup, decay.

The large-batch recipe of the LAMB and LARS papers (You et al., arXiv
1904.00962 and 1708.03888; Goyal et al., arXiv 1706.02677 for the linear
rule) in three pieces, each a pure function so tests can check the numbers:

- :func:`scaled_lr`: the peak rate for a global batch ``B`` from one tuned at
  a reference batch ``B0``: ``none`` keeps it, ``linear`` multiplies by
  ``B / B0`` (Goyal et al.), ``sqrt`` by ``sqrt(B / B0)`` (the LAMB paper's
  rule: the gradient's noise falls as ``1 / sqrt(B)``);
- :func:`warmup_steps`: warmup given as a fraction of the run (< 1, rounded up
  to whole steps) or a step count (>= 1);
- :func:`lr_lambda`: the multiplier of the peak rate at each step, for
  ``torch.optim.lr_scheduler.LambdaLR``: a linear ramp ``(t + 1) / W`` over
  the ``W`` warmup steps, then ``cosine``, ``linear``, ``constant`` or
  ``poly``: ``(1 - p) ** power`` with ``p`` the fraction of the post-warmup
  steps done (the papers' polynomial decay: power 1 in LAMB's BERT runs, 2 in
  LARS's ImageNet runs; ``linear`` is ``poly`` with power 1).
"""
from __future__ import annotations

import math

__all__ = ["LR_SCALINGS", "SCHEDULES", "scaled_lr", "warmup_steps", "lr_lambda"]

LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULES = ("cosine", "linear", "constant", "poly")


def scaled_lr(lr: float, batch: int, reference_batch: int, scaling: str = "none") -> float:
    """``lr`` (tuned at ``reference_batch``) scaled to the global ``batch`` by ``scaling``."""
    if scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {scaling!r}; scalings: {', '.join(LR_SCALINGS)}")
    if scaling == "none":
        return float(lr)
    if not (isinstance(reference_batch, int) and reference_batch > 0):
        raise ValueError(f"--reference-batch {reference_batch!r}: give the positive batch size the lr was tuned at")
    ratio = batch / reference_batch
    return float(lr) * (ratio if scaling == "linear" else math.sqrt(ratio))


def warmup_steps(warmup: float, steps: int) -> int:
    """Warmup steps of a ``steps``-step run: a fraction rounded up (the HF Trainer's ``warmup_ratio``:
    ``ceil(warmup * steps)``, so warmup asked for is at least one step), else ``int(warmup)``."""
    if warmup < 0:
        raise ValueError(f"--warmup {warmup}: give a fraction of the steps (< 1) or a step count (>= 1)")
    if warmup < 1:
        return math.ceil(round(warmup * steps, 9))  # (0.1 x 30 is 3.0000000000000004 in floats: 3 steps)
    return int(warmup)


def lr_lambda(schedule: str, warmup_steps: int, total: int, power: float = 1.0):
    """``f(step) -> multiplier`` of the peak lr for step ``step`` (0-based), ``total`` steps in all."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if not power > 0:
        raise ValueError(f"--decay-power {power}: the polynomial decay's power must be positive")

    def f(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        if schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        return (1.0 - progress) ** (power if schedule == "poly" else 1.0)
    return f
