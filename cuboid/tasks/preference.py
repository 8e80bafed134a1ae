"""Preference optimization: the ``dpo`` task (TRL 1.16's ``DPOTrainer``: its losses, options and metrics).

Data: preference pairs (:mod:`cuboid.data.pairs`), prepared as (P, 2, L)
tensors, drawn along the pair dimension and made rows for a step by
:func:`cuboid.data.pairs.flatten` (chosen and rejected interleaved: row ``2i``
chosen, ``2i + 1`` rejected), so no split of a step cuts a pair.

The reference policy's sequence log-probabilities are computed once, before
training or evaluation (TRL's ``precompute_ref_log_probs``), and kept with the
prepared data as the target ``ref_logps`` (P, 2) (a step's rows: (2P,)):
from ``ref_model`` (a folder, loaded under the same plan and dropped after the
pass), else from the policy as it starts (under LoRA its base, through
:func:`cuboid.parallel.adapters_off`). No second model is held while training.

The step (``forward_kwargs`` ``logprobs=True``): the fused head returns the
per-token log-probabilities of ``labels[:, 1:]`` (0 on the prompt and the
padding, which are -100), never whole logits; each answer's log-probability is
their sum. The loss is a sum over the micro-batch's pairs, and the step
divides by the step's pairs (``unit`` "pairs"), so a step is one device's.

Metrics (TRL's names, means over pairs): ``rewards/chosen``,
``rewards/rejected`` (beta x the log-ratio against the reference),
``rewards/accuracies`` (chosen reward above rejected), ``rewards/margins``,
``logps/chosen``, ``logps/rejected``; evaluation adds the ``eval_`` prefix.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from cuboid.data import formats
from cuboid.data.pairs import PairStats, flatten, pair_dataset, pair_rows, pairs_of_rows, prepared_pairs

from . import dpo_loss
from .base import Task, TaskError, register

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def _option(default, text: str, **meta):
    """A task option; ``flag=True``: also a flag of its own on ``cuboid finetune`` / ``cuboid eval``
    (:func:`cuboid.train.config.task_flags`), ``choices``: the values it takes (for the help)."""
    return field(default=default, metadata={"help": text, **meta})


@dataclass(frozen=True)
class DPOOptions:
    """The options of task ``dpo`` (``--task dpo,beta=0.1,loss_type=ipo``, or as flags of their own)."""

    beta: float = _option(0.1, "the deviation from the reference: rewards are beta x log(policy / reference) "
                               "(ipo: its regularization tau)", flag=True)
    loss_type: str = _option("sigmoid", "the loss, or several joined by + (with loss_weights; MPO: "
                                        "sigmoid+bco_pair+sft)", flag=True, choices=dpo_loss.LOSS_TYPES)
    loss_weights: Optional[str] = _option(None, "weights of the loss types joined by + (default 1 each)",
                                          flag=True)
    label_smoothing: float = _option(0.0, "robust, exo_pair, aot: the probability that a pair's preference is "
                                          "flipped", flag=True)
    discopop_tau: float = _option(0.05, "discopop: the temperature of its blend", flag=True)
    ref_model: Optional[str] = _option(None, "a model folder whose log-probabilities are the reference "
                                             "(default: the policy's starting weights; under LoRA its base)",
                                       flag=True)
    chat_template: Optional[str] = _option(None, "a Jinja chat template file used instead of the tokenizer's")


def _autocast(dtype: Optional[str], device: torch.device):
    if dtype in (None, "fp32"):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if dtype == "bf16" else torch.float16)


@register
class DPO(Task):
    """Direct preference optimization on prompt/chosen/rejected pairs (TRL's DPOTrainer, its loss family)."""

    name = "dpo"
    heads = ("lm",)
    unit = "pairs"
    metric = "eval_rewards/accuracies"
    targets = ("ref_logps",)
    forward_kwargs = {"logprobs": True}
    own_loss = True
    eval_keys = METRICS + ("pairs",)
    Options = DPOOptions

    def __init__(self, options=None, **fields) -> None:
        super().__init__(options, **fields)
        o = self.options
        self.loss_types = tuple(k.strip() for k in str(o.loss_type).split("+") if k.strip())
        try:
            weights = [float(w) for w in str(o.loss_weights).split("+")] if o.loss_weights is not None else None
        except ValueError:
            raise TaskError(f"task dpo: loss_weights takes numbers joined by +, not {o.loss_weights!r}") from None
        self.loss_weights = tuple(weights) if weights is not None else (1.0,) * len(self.loss_types)
        try:
            dpo_loss.check(self.loss_types, self.loss_weights, float(o.beta), float(o.label_smoothing))
        except ValueError as e:
            raise TaskError(f"task dpo: {e}") from None

    # ------------------------------------------------------------ data

    def row_length(self, prep: dict) -> int:
        return min(prep.get("seq_len") or 1024, prep["config"].n_positions)  # (TRL's max_length: 1024)

    def rows(self, ds, *, config, tokenizer=None, seq_len=None, stats: Optional[PairStats] = None, source=None,
             **_) -> dict:
        formats.check_split(ds)
        length = self.row_length({"seq_len": seq_len, "config": config})
        if formats.pretokenized(ds):  # a cuboid prepare folder: interleaved rows
            return prepared_pairs(ds, formats.pad_id(tokenizer), length)
        formats.need_tokenizer(tokenizer, self.name)
        return pair_rows(ds, tokenizer, length, self.options.chat_template, formats.pad_id(tokenizer), stats,
                         source)

    def dataset_rows(self, ds, tokenizer, max_length: int, *, text_column: Optional[str] = None,
                     packing: bool = False):
        """(rows as a ``datasets.Dataset``, counts) for ``cuboid prepare``: each pair's chosen and rejected
        sequences as two rows (row 2i chosen, 2i + 1 rejected), the answers' tokens trained."""
        stats = PairStats()
        rows = pair_dataset(ds, tokenizer, max_length, self.options.chat_template, stats)
        return rows, {"format": "preference pairs", "examples": stats.examples, "dropped": stats.dropped,
                      "truncated": stats.truncated}

    def with_model(self, model, splits: list, *, device=None, dtype=None, lora: bool = False, **_) -> list:
        """Each split's tensors with ``ref_logps`` (P, 2): the reference's (module docstring), one pass."""
        from cuboid.parallel import adapters_off

        todo = [s for s in splits if s is not None and "ref_logps" not in s]  # (None: no eval split)
        if not todo:
            return splits
        if self.options.ref_model is not None:
            from cuboid.loading.model import load
            from cuboid.parallel import state_of, unwrap

            state = state_of(unwrap(model))
            ref = load(self.options.ref_model, state.plan, device=device, mesh=state.mesh)
            logps = [reference_logps(ref, s, dtype=dtype) for s in todo]
            del ref
        else:
            off = adapters_off(model) if lora else contextlib.nullcontext()
            with off:
                logps = [reference_logps(model, s, dtype=dtype) for s in todo]
        done = iter(logps)
        return [s if s is None or "ref_logps" in s else {**s, "ref_logps": next(done)} for s in splits]

    def before_step(self, batch: dict, step: int, *, tokenizer=None, seed: int = 0) -> dict:
        """Pairs (P, 2, ...) made interleaved rows (2P, ...) (:func:`cuboid.data.pairs.flatten`)."""
        return flatten(batch)

    # ------------------------------------------------------------ the step

    def inputs(self, batch: dict) -> dict:
        return super().inputs(flatten(batch))

    def count(self, batch: dict, model=None) -> int:
        """The pairs of the batch (rows / 2; an odd number of rows, a pair cut by a split, is refused)."""
        return pairs_of_rows(int(flatten(batch)["input_ids"].shape[0]))

    def pairs(self, out, batch: dict) -> dpo_loss.PairLogps:
        """The micro-batch's :class:`~cuboid.tasks.dpo_loss.PairLogps` from the model's ``token_logps``."""
        rows = flatten(batch)
        if "ref_logps" not in rows:
            raise TaskError("task dpo: the batch has no ref_logps (the reference's sequence log-probabilities, "
                            "(P, 2) or (2P,)): compute them first (DPO.with_model)")
        logps = out.token_logps.float().sum(-1)  # (2P,) each answer's log-probability
        ref = rows["ref_logps"].to(logps.device, torch.float32).reshape(-1)
        labels = rows["labels"].to(logps.device)
        tokens = (labels != -100).sum(-1).float()          # TRL's completion mask
        targets = (labels[:, 1:] != -100).sum(-1).float()  # the positions the log-prob sums over
        return dpo_loss.PairLogps(chosen=logps[0::2], rejected=logps[1::2], ref_chosen=ref[0::2],
                                  ref_rejected=ref[1::2], chosen_tokens=tokens[0::2], rejected_tokens=tokens[1::2],
                                  chosen_targets=targets[0::2])

    def loss(self, out, batch: dict) -> tuple:
        o = self.options
        p = self.pairs(out, batch)
        losses = dpo_loss.pair_losses(p, self.loss_types, self.loss_weights, float(o.beta), float(o.label_smoothing),
                                      float(o.discopop_tau))
        return losses.sum(), self._metric_sums(p)

    def _metric_sums(self, p: dpo_loss.PairLogps) -> dict:
        beta = float(self.options.beta)
        with torch.no_grad():
            chosen, rejected = beta * p.chosen_ratio, beta * p.rejected_ratio
            return {"rewards/chosen": chosen.sum(), "rewards/rejected": rejected.sum(),
                    "rewards/accuracies": (chosen > rejected).float().sum(),
                    "rewards/margins": (chosen - rejected).sum(), "logps/chosen": p.chosen.detach().sum(),
                    "logps/rejected": p.rejected.detach().sum()}

    # ------------------------------------------------------------ evaluation

    def eval_sums(self, out, batch: dict) -> dict:
        p = self.pairs(out, batch)
        return {**{k: float(v) for k, v in self._metric_sums(p).items()}, "pairs": float(p.chosen.shape[0])}

    def eval_metrics(self, loss: float, sums: dict) -> dict:
        """``eval_loss`` (the mean over pairs) and the metrics as TRL's ``evaluate`` names them (``eval_``)."""
        n = max(sums.get("pairs", 0.0), 1.0)
        return {"eval_loss": loss, **{f"eval_{k}": sums.get(k, 0.0) / n for k in METRICS}}


@torch.no_grad()
def reference_logps(model, tensors: dict, pairs_per_batch: int = 8, dtype: Optional[str] = None) -> torch.Tensor:
    """The sequence log-probabilities (P, 2) float32 of prepared pairs (:func:`cuboid.data.pairs.pair_rows`)
    under ``model`` (any plan: every rank runs the same forwards over every pair and gets every value),
    in batches of ``pairs_per_batch`` pairs cut to their longest row."""
    from cuboid.parallel import state_of, unwrap, zero

    core = unwrap(model)
    state = state_of(core)
    plan = state.plan
    dtype = dtype if dtype is not None else plan.dtype
    multiple = math.lcm(8, 2 * plan.sp * plan.tp)  # whole pieces for the sequence and tensor splits
    device = next(core.parameters()).device
    was_training = core.training
    core.eval()
    keys = ("input_ids", "attention_mask", "labels")
    P = tensors["input_ids"].shape[0]
    out = []
    for s in range(0, P, pairs_per_batch):
        batch = formats.trim_padding({k: tensors[k][s:s + pairs_per_batch] for k in keys}, multiple)
        rows = {k: v.to(device) for k, v in flatten(batch).items()}
        with _autocast(dtype, device):
            logps = core(**rows, logprobs=True).token_logps
        out.append(logps.float().sum(-1).reshape(-1, 2).cpu())
    zero.reshard(core)
    if was_training:
        core.train()
    return torch.cat(out)
