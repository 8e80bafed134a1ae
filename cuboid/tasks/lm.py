"""Language modelling tasks: causal LM on plain text, and SFT on instruction and chat records.

Both train an LM head on the model's own loss (the mean cross-entropy of
``labels`` shifted by one), weighed by its label positions; they differ in
how records become rows (:mod:`cuboid.data.formats`, :mod:`cuboid.data.sft`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from cuboid.data import formats
from cuboid.data.streaming import example_tokenizer

from .base import Task, TaskError, register


class _LanguageModelling(Task):
    heads = ("lm",)
    unit = "tokens"
    metric = "perplexity"
    own_loss = False
    packs = True
    streams = True

    def rows(self, ds, *, config, tokenizer=None, seq_len=None, text_column="text", packing=False, **_) -> dict:
        formats.check_split(ds)
        if formats.pretokenized(ds):
            return formats.pretokenized_rows(ds, config, tokenizer, seq_len, packing)
        formats.need_tokenizer(tokenizer, self.label)
        return self.text_rows(ds, config=config, tokenizer=tokenizer, seq_len=seq_len, text_column=text_column,
                              packing=packing, **_)

    def text_rows(self, ds, **prep) -> dict:
        raise NotImplementedError


@register
class Causal(_LanguageModelling):
    """Causal language modelling on plain text (transformers' ``run_clm``): every token is a target."""

    name = "causal"
    aliases = ("clm",)
    default = True

    def text_rows(self, ds, *, config, tokenizer, seq_len, text_column, packing, **_) -> dict:
        return formats.text_blocks(ds, config, tokenizer, seq_len, text_column, packing)

    def example(self, prep: dict, row_length: int):
        return example_tokenizer(prep["tokenizer"], row_length, text_column=prep.get("text_column", "text"),
                                 packing=bool(prep.get("packing")))

    def dataset_rows(self, ds, tokenizer, max_length: int, *, text_column: Optional[str] = None,
                     packing: bool = False):
        """(rows as a ``datasets.Dataset``, counts) for ``cuboid prepare``: the causal rows of a split."""
        import datasets
        from types import SimpleNamespace

        tensors = self.rows(ds, config=SimpleNamespace(n_positions=max_length), tokenizer=tokenizer,
                            seq_len=max_length, text_column=text_column or "text", packing=packing)
        rows = datasets.Dataset.from_dict({k: v.numpy() for k, v in tensors.items()})
        return rows, {"examples": len(ds), "dropped": None, "truncated": None}


def _option(default, text: str):
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class SFTOptions:
    """The options of task ``sft`` (``--task sft,train_on_prompt=true``; also flags of their own)."""

    train_on_prompt: bool = _option(False, "train every token (system, user, template text), not only the answers")
    template: Optional[str] = _option(None, "a named prompt template for instruction data (alpaca)")
    data_format: Optional[str] = _option(None, "messages | prompt_completion | alpaca | text (default: from the "
                                               "columns)")
    chat_template: Optional[str] = _option(None, "a Jinja chat template file used instead of the tokenizer's")


@register
class SFT(_LanguageModelling):
    """Supervised fine-tuning on instruction and chat records: the answers are the targets (TRL's SFT)."""

    name = "sft"
    Options = SFTOptions

    def __init__(self, options=None, **fields) -> None:
        super().__init__(options, **fields)
        from cuboid.data.sft import FORMATS, TEMPLATES

        o = self.options
        if o.template is not None and o.template not in TEMPLATES:
            raise TaskError(f"unknown --template {o.template!r}; templates: {', '.join(TEMPLATES)}")
        if o.data_format is not None and o.data_format not in FORMATS:
            raise TaskError(f"unknown --data-format {o.data_format!r}; formats: {', '.join(FORMATS)}")

    def sft_options(self, max_length: int, text_column: Optional[str] = "text"):
        """The :class:`cuboid.data.sft.SFTOptions` of rows ``max_length`` tokens long."""
        from cuboid.data.sft import SFTOptions as Rows

        o = self.options
        return Rows(format=o.data_format, template=o.template, train_on_prompt=o.train_on_prompt,
                    max_length=max_length, text_column=None if text_column in (None, "text") else text_column,
                    chat_template=o.chat_template)

    def row_length(self, prep: dict) -> int:
        return min(prep.get("seq_len") or 1024, prep["config"].n_positions)

    def text_rows(self, ds, *, config, tokenizer, seq_len, text_column, packing, sft=None, sft_stats=None,
                  **_) -> dict:
        sft = sft or self.sft_options(seq_len or 1024, text_column)
        return formats.sft_rows(ds, config, tokenizer, sft, packing, sft_stats)

    def example(self, prep: dict, row_length: int):
        sft = prep.get("sft") or self.sft_options(row_length, prep.get("text_column", "text"))
        sft = dataclasses.replace(sft, max_length=row_length)
        return example_tokenizer(prep["tokenizer"], row_length, sft=sft, packing=bool(prep.get("packing")))

    def dataset_rows(self, ds, tokenizer, max_length: int, *, text_column: Optional[str] = None,
                     packing: bool = False):
        """(rows as a ``datasets.Dataset``, counts) for ``cuboid prepare``: tokenized records with their loss
        masks (packed as finetune packs them)."""
        from cuboid.data import sft as S

        opts = self.sft_options(max_length, text_column)
        rows, stats = S.tokenize_dataset(ds, tokenizer, opts)
        if len(rows) == 0:
            raise formats.DataError(f"no example has anything to learn (of {stats.examples}, {stats.no_answer} "
                                    f"without an answer, {stats.dropped} dropped after truncation): check the "
                                    "data format and --max-length")
        counts = {"format": S.detect_format(ds.column_names, opts, ds.features), "examples": stats.examples,
                  "dropped": stats.dropped, "no_answer": stats.no_answer, "truncated": stats.truncated}
        if packing:  # as finetune packs them (cuboid.data.sft.prepared_tensors)
            from cuboid.data.packing import pack_dataset

            rows = pack_dataset(rows, max_length, labels_column="labels", pad_id=formats.pad_id(tokenizer))
        return rows, counts
