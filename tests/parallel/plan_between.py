"""The between-steps axis of the generated plan test (test_plans.py): what users do around their training steps.

A run on this axis does, through the public path, what a user's program does besides stepping:

- an evaluation before the optimizer is built (``with torch.no_grad(): model(**batch)``, the model still in
  training mode, as a user reports the starting loss), and only then ``Opt(model.parameters())``;
- after the first step, an evaluation under ``model.eval()`` and ``no_grad``, and a greedy generation where
  the model generates (a causal LM head, no sequence split), then ``model.train()`` and the next steps;
- a save read back on one device (the reliability checks' ``save_and_reload_check``) after the steps.

One device's run does the same at the same points, so the baseline and the mid-run evaluation, the generated
tokens and every later step are compared with it; and ``model.parameters()`` must be the same objects after
each of those calls as after the load (the contract: no forward, generation, evaluation or save swaps them).

Every enumerated ZeRO-3 plan of the dense worlds is on the axis, and runs a tied and an untied causal LM beside
the families it would run anyway (:func:`between_families`); the other plans (the mixtures of experts' worlds'
too) take the axis every BETWEEN_EVERY-th index.
"""
from __future__ import annotations

import torch

# every how many plan indices a plan other than ZeRO-3 takes the axis, per world size (turned apart from the
# families (3), key/value heads (3), tasks (4), steps (5) and reliability checks (4, 12))
BETWEEN_EVERY = {2: 2, 4: 7, 8: 11}
TIED = ("gpt-debug", "gemma3-debug")       # token embedding and LM head one tensor
UNTIED = ("llama-debug", "qwen3-debug")    # an LM head of its own
NEW_TOKENS = 4  # a generation's new tokens: the prompt's forward and three cached decode steps


def between_steps(index: int, plan, world: int, every_zero3: bool = True) -> bool:
    """Whether plan number ``index`` of a ``world``-rank world takes the between-steps axis: every ZeRO-3 plan
    (``every_zero3``; the dense enumeration) and every BETWEEN_EVERY-th index."""
    return (every_zero3 and plan.zero == 3) or index % BETWEEN_EVERY.get(world, 7) == 1


def between_families(index: int, plan, families: tuple) -> tuple:
    """``families`` and, for a ZeRO-3 plan, a tied and an untied causal LM (each turned by the index) where
    ``families`` holds none of that kind."""
    if plan.zero != 3:
        return families
    extra = tuple(kind[index % len(kind)] for kind in (TIED, UNTIED) if not set(kind) & set(families))
    return families + extra


def generates(plan, model) -> bool:
    """Whether the run generates: a causal LM head, no sequence split (generation refuses sp)."""
    from cuboid.parallel import unwrap

    return getattr(unwrap(model).config, "head", None) == "lm" and plan.sp == 1


def prompts(batch: dict) -> tuple:
    """Two left-padded prompts of six tokens from a global batch's input ids: ``(ids, mask)``."""
    ids = batch["input_ids"][:2, :6].clone()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


def baseline(model, odd: dict):
    """The evaluation before the optimizer: ``model(**odd)`` under ``no_grad`` in training mode."""
    with torch.no_grad():
        return model(**odd)


def midway(model, odd: dict, generate: bool) -> tuple:
    """The evaluation between steps (``model.eval()``, ``no_grad``) and, where ``generate``, a greedy generation
    of NEW_TOKENS from :func:`prompts`; the model back in training mode. ``(output, tokens or None)``."""
    model.eval()
    try:
        with torch.no_grad():
            out = model(**odd)
        tokens = model.generate(*prompts(odd), max_new_tokens=NEW_TOKENS) if generate else None
    finally:
        model.train()
    return out, tokens


def same_parameters(model, before: list) -> bool:
    """Whether ``model.parameters()`` are the objects ``before`` holds (ids), in the same order."""
    return [id(p) for p in model.parameters()] == before
