"""Packing documents into rows of fixed length, each document attending only to itself.

Fine-tuning examples are short and uneven; padding each to the longest in its
batch wastes most of the compute, and concatenating them lets one attend to
another. A packed row holds several whole documents and tells the model where
each begins, in Hugging Face's padding-free convention (what transformers'
``DataCollatorWithFlattening`` and TRL's ``padding_free`` give):

- ``input_ids`` (rows, row_length): the documents one after another, then padding;
- ``position_ids``: 0, 1, 2, ... restarting at 0 at each document (the model's
  attention keeps each document to itself and RoPE / learned positions read them);
- ``labels``: the tokens (or the given labels), with each document's first token
  -100, so a causal LM's shifted loss never predicts a document from the previous
  one; padding -100;
- ``attention_mask``: 1 on documents, 0 on padding. The padding at a row's end is
  its own document (its positions restart at 0 too), so no document sees it even
  where the mask is not used.

Rows are filled by best-fit-decreasing (:func:`best_fit_decreasing`), as TRL's
``packing_strategy="bfd"`` does: longest first, each into the open row with the
least room that still fits it, the oldest such row on ties, else a new row. A
document longer than a row is split into row-sized pieces (the last one the
rest), each packed as a document of its own, as TRL's ``bfd_split`` does.
Empty documents are dropped.

:func:`pack` works on token lists in memory; :func:`pack_dataset` on a
``datasets.Dataset`` with a list column, by batched ``map`` (only the per-document
lengths come into Python; rows are gathered with numpy). :func:`plan_rows` is
the layout both use: which piece of which document goes where.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

__all__ = ["best_fit_decreasing", "plan_rows", "Layout", "pack", "pack_dataset", "padding_fraction", "PACKED_KEYS"]

PACKED_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def best_fit_decreasing(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Rows of item indices: items longest first (ties in index order), each into the open row with the
    least room that fits it (the oldest such row on ties), or into a new row. Every length must be in
    1..``row_length``. Rows are listed in the order they were opened, items in the order they went in."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > row_length):
        raise ValueError(f"best_fit_decreasing: lengths must be 1..{row_length} (the row length), "
                         f"got {int(lengths.min())}..{int(lengths.max())}")
    rows: list[list[int]] = []
    rooms: list[int] = []                 # the distinct room values of open rows, ascending
    rows_with_room: dict[int, deque] = {}  # room -> the rows that have it, oldest first
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        k = bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            row = rows_with_room[room].popleft()
            if not rows_with_room[room]:
                del rows_with_room[room], rooms[k]
        else:
            room, row = row_length, len(rows)
            rows.append([])
        rows[row].append(i)
        left = room - n
        if left > 0:
            if left not in rows_with_room:
                insort(rooms, left)
                rows_with_room[left] = deque()
            rows_with_room[left].append(row)
    return rows


@dataclass
class Layout:
    """Where every piece goes: piece ``p`` is tokens ``start[p] : start[p] + length[p]`` of document
    ``doc[p]``; row ``r`` holds pieces ``row_ptr[r] : row_ptr[r + 1]`` in that order."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    row_ptr: np.ndarray
    row_length: int

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def tokens(self) -> int:
        return int(self.length.sum())

    @property
    def padding_fraction(self) -> float:
        """Padding over all row slots."""
        return 1.0 - self.tokens / max(self.rows * self.row_length, 1)

    def rows_of(self, first: int, last: int) -> "Layout":
        """Rows ``first .. last - 1`` as a layout of their own (same document numbers)."""
        a, b = int(self.row_ptr[first]), int(self.row_ptr[last])
        return Layout(self.doc[a:b], self.start[a:b], self.length[a:b], self.row_ptr[first:last + 1] - a,
                      self.row_length)


def plan_rows(lengths: Sequence[int], row_length: int) -> Layout:
    """The packing of documents of ``lengths`` tokens into rows of ``row_length`` (module docstring)."""
    if row_length < 1:
        raise ValueError(f"row length must be at least 1, got {row_length}")
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    pieces = -(-lengths // row_length)                     # ceil; 0 for an empty document
    doc = np.repeat(np.arange(len(lengths)), pieces)
    first = np.cumsum(pieces) - pieces                     # each document's first piece
    k = np.arange(len(doc)) - np.repeat(first, pieces)     # piece number within its document
    start = k * row_length
    length = np.minimum(lengths[doc] - start, row_length)
    rows = best_fit_decreasing(length, row_length)
    order = np.fromiter((p for row in rows for p in row), dtype=np.int64, count=len(doc))
    row_ptr = np.cumsum([0] + [len(row) for row in rows]).astype(np.int64)
    return Layout(doc[order], start[order], length[order], row_ptr, row_length)


def _fill(layout: Layout, doc_offset: np.ndarray, values: np.ndarray, label_values: Optional[np.ndarray],
          pad_id: int) -> dict:
    """The packed rows of ``layout`` as numpy arrays; document ``d``'s tokens are
    ``values[doc_offset[d]:]`` (and its labels ``label_values[doc_offset[d]:]``)."""
    n_rows, L = layout.rows, layout.row_length
    length = layout.length
    excl = np.cumsum(length) - length                             # each piece's start in the rows' tokens
    piece_row = np.repeat(np.arange(n_rows), np.diff(layout.row_ptr))
    row_first = excl[layout.row_ptr[:-1]] if len(length) else np.zeros(n_rows, dtype=np.int64)
    dest_start = piece_row * L + excl - row_first[piece_row]      # flat slot of each piece's first token
    rep = np.repeat(np.arange(len(length)), length)
    k = np.arange(int(length.sum())) - excl[rep]                  # token number within its piece
    src = doc_offset[layout.doc][rep] + layout.start[rep] + k
    dest = dest_start[rep] + k
    used = np.zeros(n_rows, dtype=np.int64)
    np.add.at(used, piece_row, length)

    input_ids = np.full(n_rows * L, pad_id, dtype=np.int64)
    input_ids[dest] = values[src]
    labels = np.full(n_rows * L, -100, dtype=np.int64)
    labels[dest] = (values if label_values is None else label_values)[src]
    labels[dest_start] = -100
    position_ids = (np.arange(L)[None, :] - used[:, None]).reshape(-1)  # padding: its own document
    position_ids[dest] = k
    attention_mask = np.zeros(n_rows * L, dtype=np.int64)
    attention_mask[dest] = 1
    out = dict(input_ids=input_ids, labels=labels, position_ids=position_ids, attention_mask=attention_mask)
    return {key: v.reshape(n_rows, L) for key, v in out.items()}


def pack(docs: Sequence[Sequence[int]], row_length: int, *, labels: Optional[Sequence[Sequence[int]]] = None,
         pad_id: int = 0, as_tensors: bool = True) -> dict:
    """Token lists packed into rows of ``row_length`` (module docstring): a dict of
    :data:`PACKED_KEYS`, each (rows, row_length), torch tensors (numpy with ``as_tensors=False``).

    ``labels``, one list per document as long as it (-100 where nothing is learned, as an SFT mask),
    default to the tokens; each piece's first label becomes -100 either way.
    """
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    if labels is not None and (len(labels) != len(docs) or any(len(a) != len(b) for a, b in zip(labels, docs))):
        raise ValueError("pack: labels must hold one list per document, as long as the document")
    layout = plan_rows(lengths, row_length)
    doc_offset = np.cumsum(lengths) - lengths
    out = _fill(layout, doc_offset, _flat(docs), None if labels is None else _flat(labels), pad_id)
    if as_tensors:
        import torch

        out = {key: torch.from_numpy(v) for key, v in out.items()}
    return out


def _flat(lists: Sequence[Sequence[int]]) -> np.ndarray:
    """Lists of ids one after another, as one int64 array (a numpy copy per list, no loop per token)."""
    parts = [np.asarray(x, dtype=np.int64).reshape(-1) for x in lists]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _arrow_values(column) -> tuple[np.ndarray, np.ndarray]:
    """A list column's (flat values, each list's start in them) as numpy."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return values, np.cumsum(lengths) - lengths


def _lengths(ds, column: str, batch_size: int) -> np.ndarray:
    import pyarrow.compute as pc

    parts = [pc.list_value_length(t.column(column)).fill_null(0).to_numpy(zero_copy_only=False)
             for t in ds.with_format("arrow").iter(batch_size=batch_size)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def pack_dataset(ds, row_length: int, *, column: str = "input_ids", labels_column: Optional[str] = None,
                 pad_id: int = 0, batch_size: int = 1000, num_proc: Optional[int] = None):
    """A ``datasets.Dataset`` whose ``column`` holds token lists, packed: a new Dataset with one row per
    packed row and the columns :data:`PACKED_KEYS` (module docstring). ``labels_column`` (same lengths)
    gives the labels; default the tokens. The whole dataset is planned at once (its lengths only); rows
    are built ``batch_size`` at a time by ``Dataset.map``, reading only the documents they hold."""
    import datasets

    if column not in ds.column_names:
        raise ValueError(f"pack_dataset: column {column!r} not found (columns: {', '.join(ds.column_names)})")
    layout = plan_rows(_lengths(ds, column, max(batch_size, 10_000)), row_length)
    source = ds.with_format("arrow")

    def build(batch: dict) -> dict:
        rows = np.asarray(batch["row"])
        part = layout.rows_of(int(rows[0]), int(rows[-1]) + 1)
        docs, local = np.unique(part.doc, return_inverse=True)
        table = source[docs.tolist()]
        values, offset = _arrow_values(table.column(column))
        label_values = _arrow_values(table.column(labels_column))[0] if labels_column else None
        part = Layout(local.reshape(-1), part.start, part.length, part.row_ptr, row_length)
        return {k: list(v) for k, v in _fill(part, offset, values, label_values, pad_id).items()}

    features = datasets.Features({k: datasets.Sequence(datasets.Value("int64")) for k in PACKED_KEYS})
    rows = datasets.Dataset.from_dict({"row": np.arange(layout.rows)})
    return rows.map(build, batched=True, batch_size=batch_size, remove_columns=["row"], features=features,
                    num_proc=num_proc, desc="packing")


def padding_fraction(batch: dict) -> float:
    """Padding over all slots of a batch with an ``attention_mask`` (0 when it has none)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.numel() == 0:
        return 0.0
    return 1.0 - float(mask.sum()) / mask.numel()
