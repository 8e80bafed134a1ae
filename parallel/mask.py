"""What attention may see of a row besides causality: :class:`Mask`, the one object blocks pass to their core.

A zoo model builds it once per forward from its inputs (:meth:`Mask.of`:
Hugging Face's ``attention_mask`` and ``position_ids``) on whole rows, before
any sequence split, and hands it to every block, which hands it unchanged to
its attention core (a :class:`~cuboid.parallel.layers.Attention` layer, or a
core a plan swapped in). A packed row is Hugging Face's: ``position_ids``
restart at 0 at each document (``DataCollatorWithFlattening``, TRL's
``padding_free``); the document ids count those restarts
(:func:`cuboid.kernels.flash_attention.doc_ids_from_positions`), and a query
attends only to keys of its own document.

Every field is laid out like the tokens the core holds (dim 0 the core's
rows, dim 1 its tokens): a plan that splits rows or tokens splits the mask
the same way (:meth:`Mask.map`, :meth:`Mask.pad`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from cuboid.kernels import doc_ids_from_positions


@dataclass(frozen=True, eq=False)
class Mask:
    """``keep``: (B, S) bool key mask, True = a token (None: every key kept); ``positions``: (B, T) long, each
    token's position in its document, which rotary embeddings use (None: 0 .. T-1, or the core's own);
    ``docs``: (B, T) int32 document ids, non-decreasing along a row (None: one document per row; ids all
    equal mean the same)."""

    keep: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    docs: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, attention_mask=None, position_ids: Optional[torch.Tensor] = None,
           rows: Optional[int] = None) -> Optional["Mask"]:
        """The mask of a model's inputs: ``attention_mask`` (B, T), 1 = token, or a Mask already made (a plan
        that cuts rows made it, returned as it is); ``position_ids`` (B, T) or (1, T) (expanded to ``rows``),
        document ids counted from their restarts. None when nothing is masked and no position is given."""
        if isinstance(attention_mask, Mask):
            return attention_mask
        keep = keep_mask(attention_mask)
        positions = docs = None
        if position_ids is not None:
            positions = position_ids.long()
            if rows is not None and positions.shape[0] != rows:
                positions = positions.expand(rows, -1)
            docs = doc_ids_from_positions(positions)
        if keep is None and positions is None:
            return None
        return cls(keep, positions, docs)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Mask":
        """The mask with ``fn`` applied to each field that is set (a split of rows or tokens: zigzag chunks,
        batch blocks)."""
        return Mask(*(None if t is None else fn(t) for t in (self.keep, self.positions, self.docs)))

    def pad(self, tokens: int) -> "Mask":
        """The mask of the row padded to ``tokens`` tokens: padded keys masked, padded tokens one more
        document at positions 0, 1, ...; the same mask when nothing is added."""
        rows, have = self.shape()
        extra = tokens - have
        if extra <= 0:
            return self
        keep = self.keep if self.keep is not None else torch.ones(rows, have, dtype=torch.bool, device=self.device)
        keep = torch.cat([keep, keep.new_zeros(rows, extra)], 1)
        positions = docs = None
        if self.positions is not None:
            tail = torch.arange(extra, device=self.device).expand(rows, extra)
            positions = torch.cat([self.positions, tail], 1)
            docs = torch.cat([self.docs, (self.docs[:, -1:] + 1).expand(rows, extra)], 1)
        return Mask(keep, positions, docs)

    def shape(self) -> tuple:
        """(rows, tokens) of the mask's fields."""
        t = next(t for t in (self.keep, self.positions, self.docs) if t is not None)
        return tuple(t.shape[:2])

    @property
    def device(self) -> torch.device:
        return next(t for t in (self.keep, self.positions, self.docs) if t is not None).device


def keep_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """HF ``attention_mask`` (B, T), 1 = token, as the kernel's bool key mask; None when every key is kept."""
    if attention_mask is None:
        return None
    mask = attention_mask.to(torch.bool)
    if mask.is_meta or torch.compiler.is_compiling():  # traced: kept as given (no host read of its values)
        return mask
    return None if bool(mask.all()) else mask
