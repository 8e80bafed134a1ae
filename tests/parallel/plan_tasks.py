"""The training objectives the generated plan test turns by plan index (test_plans.py), each on a batch built
by hand as a user or a test builds one.

:func:`task_of` picks one per run; :func:`task_batch` adds what its loss reads beyond a model's inputs (fixed
numbers, the same for one device and every plan, added to the global batch before any split); and
:func:`task_step` is ``cuboid.train_step(..., task=...)``. The tasks:

- ``weighted``: :class:`WeightedLM`, a user's task (a per-token weighted causal-LM loss with a target tensor of
  its own, ``weights`` (B, T), on the per-token log-probs ``logprobs=True`` gives);
- ``dpo``: ``cuboid.tasks.get("dpo")`` (sigmoid, beta 0.1) on interleaved pairs (row 2i chosen, 2i + 1
  rejected) with fixed reference log-probs ``ref_logps`` (2P,), as the prepared data carries them;
- ``grpo``: the GRPO loss on fixed rollouts (the sampler is not what a plan changes): the first tokens of each
  row are the prompt (labels -100), ``advantages`` (B,), ``old_logps`` and ``ref_logps`` (B, T) near a random
  model's (so the clipped ratio and the KL term are both live), beta 0.04, ``dapo`` with token-level ratios
  or ``grpo`` with sequence-level ones (GSPO), turned by the index;
- ``reward``: ``cuboid.tasks.get("reward")`` on interleaved pairs, a classification head with one output, the
  score read at each row's last real token, with a ``margin`` per pair.

A pair task's batch holds two rows per pair in every dp share and pipeline micro-batch (:func:`pair_rows`).
"""
from __future__ import annotations

import torch

from cuboid import tasks

LM_TASKS = ("", "weighted", "dpo", "grpo")  # a dense causal LM's, turned by the plan's index
PAIR_TASKS = ("dpo", "reward")


class WeightedLM(tasks.Task):
    """A user's task, as a test writes one: a per-token weighted causal-LM loss with a target tensor of its own
    (``weights`` (B, T), not a model input), on the model's per-token log-probs (``logprobs=True``). Its loss is
    ``sum(-log p(label) * weight)`` over label positions, its count those positions."""

    heads = ("lm",)
    targets = ("weights",)
    forward_kwargs = {"logprobs": True}

    def count(self, batch, model=None):
        return int((batch["labels"][:, 1:] != -100).sum())

    def loss(self, out, batch):
        trained = batch["labels"][:, 1:] != -100
        weights = batch["weights"][:, 1:].to(out.token_logps.dtype) * trained
        return -(out.token_logps * weights).sum(), {"weight": weights.sum()}


def task_of(index: int, name: str, extra: dict, dense: tuple) -> str:
    """The objective of the plan's ``train_step`` steps on family ``name`` with config overrides ``extra``:
    ``reward`` on a one-output classification head, one of LM_TASKS on a causal LM of ``dense`` (turned by
    the index; the mixtures of experts' enumerations keep the model's loss: their 8-rank world is the
    suite's largest, and test_pipeline_task runs a task on a routed MoE under pp), else "" (the model's)."""
    if extra.get("head") == "cls":
        return "reward" if extra.get("num_labels") == 1 else ""
    lm = name in dense and not name.startswith(("bert", "vit")) and extra.get("head", "lm") == "lm"
    return LM_TASKS[index % len(LM_TASKS)] if lm else ""


def pair_rows(size: int, dp: int, micro: int) -> int:
    """Rows of a pair task's batch: at least ``size``, two per pair in each of the ``dp`` shares' ``micro``
    micro-batches."""
    unit = 2 * dp * micro
    return max(size, unit) // unit * unit


def task_batch(task: str, batch: dict, index: int = 0) -> dict:
    """``batch`` with what ``task``'s loss reads beyond the model's inputs (module docstring); a batch that has
    them keeps its own (one device's reference reorders rows after drawing them)."""
    if not task:
        return batch
    B, T = batch["input_ids"].shape
    rows, cols = torch.arange(B).unsqueeze(1), torch.arange(T).unsqueeze(0)
    if task == "weighted" and "weights" not in batch:
        return dict(batch, weights=0.25 + ((rows * 7 + cols) % 5) / 4)
    if task == "dpo" and "ref_logps" not in batch:
        return dict(batch, ref_logps=-30.0 - (torch.arange(B) * 5 % 7).float())
    if task == "reward" and "margin" not in batch:
        return dict(batch, margin=(torch.arange(B) // 2 % 3).float() * 0.25)
    if task == "grpo" and "advantages" not in batch:
        near = -6.2 + ((rows * 3 + cols) % 7 - 3).float() * 0.05  # about log(1 / 510), a random model's
        labels = batch["labels"].masked_fill(cols < 3, -100)  # three prompt tokens a row
        # advantages off zero-sum: a loss of cancelling terms near 0 makes its relative error rounding's
        return dict(batch, labels=labels, advantages=torch.linspace(-0.5, 1.5, B), old_logps=near,
                    ref_logps=near.flip(1))
    return batch


def task_object(task: str, index: int = 0):
    """The task object ``task`` names (None: the model's loss)."""
    if task == "weighted":
        return WeightedLM()
    if task == "grpo":
        sequence = index // len(LM_TASKS) % 2 == 1
        return tasks.get("grpo")(beta=0.04, loss_type="grpo" if sequence else "dapo",
                                 importance_sampling_level="sequence" if sequence else "token")
    return tasks.get(task)() if task else None


def task_step(model, opt, batch, task: str, index: int = 0, **options):
    """``cuboid.train_step`` of ``batch`` with ``task`` (its targets added: :func:`task_batch`)."""
    import cuboid

    if not task:
        return cuboid.train_step(model, opt, batch, **options)
    return cuboid.train_step(model, opt, task_batch(task, batch, index), task=task_object(task, index), **options)
