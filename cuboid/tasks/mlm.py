"""Masked language modelling (BERT): tokens masked afresh at every step, the masked ones the targets."""
from __future__ import annotations

import torch

from cuboid.data import formats

from .base import Task, register


@register
class MaskedLM(Task):
    """BERT's objective: 15% of the real tokens become targets (80% [MASK], 10% random, 10% kept), drawn
    per step from a generator seeded by the run's seed and the step, so a resumed run masks alike."""

    name = "mlm"
    heads = ("mlm",)
    default = True
    unit = "tokens"
    metric = "perplexity"
    own_loss = False

    def rows(self, ds, *, config, tokenizer=None, seq_len=None, text_column="text", **_) -> dict:
        formats.check_split(ds)
        formats.need_tokenizer(tokenizer, self.name)
        return formats.fixed_rows(ds, config, tokenizer, seq_len, text_column)

    def before_step(self, batch: dict, step: int, *, tokenizer=None, seed: int = 0) -> dict:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step - 1)
        return formats.mask_tokens(batch, tokenizer, gen)
