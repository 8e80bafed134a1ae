"""Reward modelling: the ``reward`` task (TRL 1.16's ``RewardTrainer``: Bradley-Terry on preference pairs).

Data: the same records as DPO's (``prompt``, ``chosen``, ``rejected``,
strings or conversations; :mod:`cuboid.data.pairs`), tokenized as TRL's
RewardTrainer does: each answer joined to its prompt as one sequence (plain
text: EOS appended to an answer that lacks it), and a pair whose longer
sequence passes ``max_length`` is dropped (TRL filters, it does not cut). An
optional ``margin`` column (a number per pair) is kept beside the tokens.
Prepared as (P, 2, L) tensors ``input_ids`` and ``attention_mask`` (and
``margin`` (P, 2), the pair's margin on both of its rows), made rows for a
step by :func:`cuboid.data.pairs.flatten`: chosen and rejected interleaved,
row ``2i`` pair ``i``'s chosen, ``2i + 1`` its rejected, so no split of a
step cuts a pair.

The model is a sequence classifier with one output (``head="cls"``,
``num_labels=1``: ``*ForSequenceClassification``), its score read at each
row's last token that is not the pad id (the task gives the model the
tokenizer's pad id, as TRL does). Per pair, with ``r`` the scores:

    loss = -logsigmoid(r_chosen - r_rejected - margin)
           + center_rewards_coefficient * (r_chosen + r_rejected) ** 2

summed over the micro-batch's pairs; the step divides by the step's pairs
(``unit`` "pairs"), so a step is TRL's mean over the batch. Metrics (TRL's
names, means over pairs): ``accuracy`` (chosen scored above rejected) and
``margin`` (``r_chosen - r_rejected``); evaluation adds the ``eval_`` prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from cuboid.data import formats
from cuboid.data.pairs import PairStats, flatten, pairs_of_rows, pair_tensors, record_where, whole_pairs

from .base import Task, TaskError, register

METRICS = ("accuracy", "margin")
INPUTS = ("input_ids", "attention_mask", "position_ids")  # what the model reads of a reward batch


@dataclass(frozen=True)
class RewardOptions:
    """The options of task ``reward`` (``--task reward,center_rewards_coefficient=0.01``)."""

    center_rewards_coefficient: Optional[float] = field(default=None, metadata={
        "help": "weight of the mean squared sum of a pair's rewards in the loss, centring them on 0 (TRL's)"})
    chat_template: Optional[str] = field(default=None, metadata={
        "help": "a Jinja chat template file used instead of the tokenizer's"})


def margins(ds, source=None) -> list:
    """The ``margin`` column as floats; a one-line DataError naming the record whose margin is not a number."""
    out = []
    for i, m in enumerate(ds["margin"]):
        try:
            out.append(float(m))
        except (TypeError, ValueError):
            raise formats.DataError(f"{record_where(ds, i, source)}: margin {m!r} is not a number (a pair's margin "
                                    "is a number; leave the column out for none)") from None
    return out


@register
class Reward(Task):
    """A reward model on prompt/chosen/rejected pairs: a one-output score, Bradley-Terry loss (TRL's RewardTrainer)."""

    name = "reward"
    heads = ("cls",)
    families = ("gpt", "llama")
    unit = "pairs"
    metric = "eval_accuracy"
    eval_keys = METRICS + ("pairs",)
    targets = ("margin",)  # optional: a batch without margins is scored as with zeros
    own_loss = True
    Options = RewardOptions

    # ------------------------------------------------------------ the model

    def model_config(self, config, tokenizer) -> dict:
        """One output, and the pad id the rows are padded with (the head reads each row's last other token)."""
        return {"num_labels": 1, "pad_token_id": formats.pad_id(tokenizer) if tokenizer is not None
                else config.pad_token_id}

    # ------------------------------------------------------------ data

    def rows(self, ds, *, config, tokenizer=None, seq_len=None, stats: Optional[PairStats] = None, source=None,
             **_) -> dict:
        formats.check_split(ds)
        formats.need_tokenizer(tokenizer, self.name)
        stats = stats if stats is not None else PairStats()
        length = min(seq_len or 1024, config.n_positions)
        seqs, kept = whole_pairs(ds, tokenizer, length, self.options.chat_template, source)  # TRL drops a longer pair
        keep = torch.tensor(kept, dtype=torch.bool)  # (P,) of the records
        stats.examples += len(kept)
        if not bool(keep.any()):
            raise formats.DataError(f"no preference pair fits --max-length {length} (all {len(keep)} are longer)")
        rows = pair_tensors(seqs, formats.pad_id(tokenizer))  # (kept pairs, 2, L <= length)
        out = {k: rows[k] for k in ("input_ids", "attention_mask")}
        if "margin" in ds.column_names:
            margin = torch.tensor(margins(ds, source), dtype=torch.float32)
            if len(margin) != len(keep):
                raise TaskError("task reward: the margin column has another length than the pairs")
            out["margin"] = margin[keep].unsqueeze(1).expand(-1, 2).contiguous()
        stats.dropped += int((~keep).sum())
        return formats.trim_padding(out)

    def before_step(self, batch: dict, step: int, *, tokenizer=None, seed: int = 0) -> dict:
        """Pairs (P, 2, ...) made interleaved rows (2P, ...) (:func:`cuboid.data.pairs.flatten`)."""
        return flatten(batch)

    # ------------------------------------------------------------ the step

    def inputs(self, batch: dict) -> dict:
        """The model reads the tokens only (``margin`` is the loss's; labels, if any, are not a reward model's)."""
        return {k: v for k, v in flatten(batch).items() if k in INPUTS}

    def count(self, batch: dict, model=None) -> int:
        """The pairs of the batch (rows / 2; an odd number of rows, a pair cut by a split, is refused)."""
        return pairs_of_rows(int(flatten(batch)["input_ids"].shape[0]), "a reward batch")

    def rewards(self, out, batch: dict) -> tuple:
        """(chosen, rejected, margin) (P,) float32: the scores of the interleaved rows, and the pairs' margins
        (zeros where the batch has none)."""
        logits = out.logits
        if logits.dim() != 2 or logits.shape[-1] != 1:
            raise TaskError(f"task reward needs a sequence classifier with one output (num_labels=1); its "
                            f"logits are {tuple(logits.shape)}")
        scores = logits[:, 0].float()
        chosen, rejected = scores[0::2], scores[1::2]
        margin = flatten(batch).get("margin")
        margin = margin.to(scores.device, torch.float32).reshape(-1)[0::2] if margin is not None \
            else torch.zeros_like(chosen)
        return chosen, rejected, margin

    def loss(self, out, batch: dict) -> tuple:
        chosen, rejected, margin = self.rewards(out, batch)
        loss = -F.logsigmoid(chosen - rejected - margin)
        coef = self.options.center_rewards_coefficient
        if coef is not None:
            loss = loss + float(coef) * (chosen + rejected) ** 2
        return loss.sum(), self._metric_sums(chosen, rejected)

    @staticmethod
    def _metric_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
        with torch.no_grad():
            return {"accuracy": (chosen > rejected).float().sum(), "margin": (chosen - rejected).sum()}

    # ------------------------------------------------------------ evaluation

    def eval_sums(self, out, batch: dict) -> dict:
        chosen, rejected, _ = self.rewards(out, batch)
        return {**{k: float(v) for k, v in self._metric_sums(chosen, rejected).items()},
                "pairs": float(chosen.shape[0])}

    def eval_metrics(self, loss: float, sums: dict) -> dict:
        """``eval_loss`` (the mean over pairs) and ``eval_accuracy``, ``eval_margin`` as TRL's ``evaluate``."""
        n = max(sums.get("pairs", 0.0), 1.0)
        return {"eval_loss": loss, **{f"eval_{k}": sums.get(k, 0.0) / n for k in METRICS}}
