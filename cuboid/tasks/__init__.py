"""The training objectives: one small class per task (:mod:`.base` says what a task is).

Registered: ``causal`` (``clm``), ``sft`` (:mod:`.lm`), ``mlm`` (:mod:`.mlm`),
``seqcls``, ``imgcls`` (:mod:`.classify`), ``grpo`` (:mod:`.grpo`), ``dpo``
(:mod:`.preference`), ``reward`` (:mod:`.reward`). A user's own task subclasses :class:`Task` and is passed as an object.
"""
from __future__ import annotations

from .base import NoOptions, Task, TaskError, class_of, for_model, get, names, parse, register, resolve
from .lm import SFT, Causal
from .mlm import MaskedLM
from .grpo import GRPO
from .classify import ImageClassification, SequenceClassification  # noqa: I001 (registration order: defaults)
from .preference import DPO
from .reward import Reward

__all__ = ["Task", "NoOptions", "TaskError", "register", "get", "names", "parse", "resolve", "class_of", "for_model",
           "prepare", "Causal", "SFT", "MaskedLM", "SequenceClassification", "ImageClassification", "GRPO",
           "DPO", "Reward"]


def prepare(ds, task, **prep) -> dict:
    """A split as a dict of equal-length tensors for ``task`` (a name, options or a :class:`Task`);
    ``prep``: config, tokenizer, seq_len, text/label/image columns, num_labels, packing (and for sft an
    explicit :class:`cuboid.data.sft.SFTOptions` ``sft`` and ``sft_stats``)."""
    task = resolve(task)
    task.check(packing=bool(prep.get("packing")))
    return task.rows(ds, **prep)
