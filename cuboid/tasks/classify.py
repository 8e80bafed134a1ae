"""Classification tasks: one label per example, of a text (``seqcls``) or an image (``imgcls``).

Both train a ``cls`` head on the model's own loss (the mean cross-entropy
over examples), count samples, and report accuracy beside the eval loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from cuboid.data import formats

from .base import Task, TaskError, register


@dataclass(frozen=True)
class SequenceClassificationOptions:
    """The options of task ``seqcls`` (``--task seqcls,num_labels=3``, or ``--num-labels 3``)."""

    num_labels: Optional[int] = field(default=None, metadata={
        "help": "classes of the head (default: the data's, or a classifier folder's own); a causal LM's folder "
                "gets a new score head of this many outputs", "flag": True})


class _Classification(Task):
    heads = ("cls",)
    default = True
    unit = "samples"
    metric = "accuracy"
    eval_keys = ("correct", "seen")
    own_loss = False
    classes = True

    def eval_sums(self, out, batch: dict) -> dict:
        labels = batch["labels"]
        return {"correct": float((out.logits.argmax(-1) == labels).sum()), "seen": float(labels.numel())}

    def eval_metrics(self, loss: float, sums: dict) -> dict:
        return {"eval_loss": loss, "accuracy": sums.get("correct", 0.0) / max(sums.get("seen", 0.0), 1.0)}


@register
class SequenceClassification(_Classification):
    """Text classification (GLUE-style): a class per text, the head on the first or last token."""

    name = "seqcls"
    families = ("bert", "gpt", "llama")
    Options = SequenceClassificationOptions

    def model_config(self, config, tokenizer) -> dict:
        """``num_labels`` when the option gives it, and a decoder's pad id from the tokenizer where its config
        names none (its head reads each row's last token that is not padding, as transformers' does)."""
        n = self.options.num_labels
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise TaskError(f"task seqcls: num_labels {n!r}: a classifier has 1 or more classes")
        out = {} if n is None else {"num_labels": n}
        if tokenizer is not None and hasattr(config, "pad_token_id") and config.pad_token_id is None:
            out["pad_token_id"] = formats.pad_id(tokenizer)
        return out

    def rows(self, ds, *, config, tokenizer=None, seq_len=None, text_column="text", label_column="label",
             num_labels=None, **_) -> dict:
        formats.check_split(ds)
        formats.need_tokenizer(tokenizer, self.name)
        return formats.fixed_rows(ds, config, tokenizer, seq_len, text_column, label_column, num_labels)


@register
class ImageClassification(_Classification):
    """Image classification: a class per image (ViT's class token)."""

    name = "imgcls"
    families = ("vit",)

    def rows(self, ds, *, config, image_column="image", label_column="label", num_labels=None, **_) -> dict:
        formats.check_split(ds)
        return formats.image_rows(ds, config, image_column, label_column, num_labels)
