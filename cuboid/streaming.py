"""Streaming fine-tune data (``--streaming``): local files read as they train, resumed exactly.

A local jsonl / json / csv / parquet / text file (or a folder of files of one
kind) is read as a ``datasets`` ``IterableDataset`` (``load_dataset(kind,
data_files=..., streaming=True)``), nothing tokenized ahead. Each data-parallel
rank reads its own rows (``datasets.distributed.split_dataset_by_node`` by its
dp coordinate: whole files when their number is a multiple of dp, else every
dp-th row), so the tensor, pipeline and sequence ranks of one dp group read
the same rows and every dp rank different ones. A step takes ``rows`` examples
(or packed rows) from each dp rank's stream: the rank's share of the global
batch, given to :func:`cuboid.step.train_step` with ``share=True``.

The pipeline of one rank, each stage pulling from the one before:

1. :class:`Source`: the rank's raw rows, epoch after epoch (a stream has no
   length: the run needs ``--steps``);
2. :class:`Shuffled`: rows tokenized (:func:`cuboid.sft.tokenize_example` for
   ``sft``; text + EOS for ``causal``) and shuffled in blocks of
   ``shuffle_buffer`` rows, each block in an order drawn from (seed, rank,
   epoch, the block's first row);
3. :class:`Packed` (``--packing``): windows of documents packed into rows by
   :func:`cuboid.packing.pack` (best-fit-decreasing); without packing each
   example is a row and a batch is padded to its longest row, rounded up to
   ``width_multiple``.

Exact resume. ``datasets``' own buffered shuffle loses its buffer on resume
(its docs say so; huggingface/datasets#7901, and #8308 for the state that
stopped advancing after a first resume), so it is not used. Here every
stage's position is where its current piece of work began plus how far into
it the stage is: the source's ``IterableDataset.state_dict()`` at a block's
first row, the number of examples taken from that block, and (packing) the
example position at a window's first document and the rows taken from that
window. A resume opens the source at the block's start, reads and tokenizes
that one block again (at most ``shuffle_buffer`` rows, plus one packing
window), draws the same order and skips what was taken. So the checkpoint
holds a few small JSON values per dp rank and no token ids, a resumed run
sees exactly the batches the uninterrupted one does, however often it is
resumed, and a resume costs one block's reading, not the stream's. The price
against a sliding buffer: rows mix within a block only (a sliding buffer lets
a few rows drift further); data sorted on disk wants files shuffled first or
a larger buffer. (The second resume, #8308, is fine in datasets >= 4.x with
the fix; :func:`cuboid.trainer` tests resume twice.)

Eval: the data's own eval file when a folder has one (a file whose name has
a word ``validation``, ``valid``, ``val``, ``eval``, ``dev`` or ``test``), else
the stream's first ``eval_examples`` rows (in file order, before any
shuffling), which training then skips in every epoch. The eval rows are read
once and prepared as tensors, as the non-streaming path's eval split is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from cuboid.data import DATA_FILE_KINDS, DataError

__all__ = ["EVAL_EXAMPLES", "StreamData", "Source", "Shuffled", "Packed", "StreamBatches", "stream_files",
           "open_stream", "example_tokenizer", "collate", "setup", "gather_positions", "saved_position"]

EVAL_EXAMPLES = 100                    # rows held out for eval when the data has no eval file
EVAL_WORDS = {"validation", "valid", "val", "eval", "dev", "test"}
STREAM_TASKS = ("causal", "sft")


# ---------------------------------------------------------------- files


def stream_files(source: Any) -> tuple[str, list[str], list[str]]:
    """(the ``datasets`` builder, training files, eval files) of a local file or folder; a one-line
    DataError for anything that cannot be streamed."""
    if not isinstance(source, (str, Path)):
        raise DataError(f"--streaming reads local files (jsonl, json, csv, parquet, txt), not a "
                        f"{type(source).__name__}")
    path = Path(source)
    if not path.exists():
        raise DataError(f"data {source}: no such file or folder")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()
                                                   and p.suffix.lower() in DATA_FILE_KINDS)
    kinds = {DATA_FILE_KINDS.get(p.suffix.lower()) for p in files}
    if not files or None in kinds:
        raise DataError(f"data {source}: --streaming reads {', '.join(sorted(DATA_FILE_KINDS))} files"
                        + ("" if files else " (the folder has none)"))
    if len(kinds) > 1:
        raise DataError(f"data {source}: a folder of mixed data files ({', '.join(sorted(kinds))}); stream one kind")
    held = [p for p in files if EVAL_WORDS & set(re.split(r"[^a-z]+", p.stem.lower()))] if len(files) > 1 else []
    train = [p for p in files if p not in held]
    if not train:
        raise DataError(f"data {source}: every file is named as eval data; name the training files otherwise")
    return kinds.pop(), [str(p) for p in train], [str(p) for p in held]


def open_stream(kind: str, files: list[str]):
    """The files as one unshuffled ``IterableDataset``."""
    import datasets

    return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)


# ---------------------------------------------------------------- the stages


class Source:
    """One dp rank's raw rows, epoch after epoch. ``position()``: {"epoch", "read" (rows read in the
    epoch), "dataset" (the ``IterableDataset.state_dict()``)}."""

    def __init__(self, make: Callable[[], Any], position: Optional[dict] = None) -> None:
        self.make = make
        self.epoch, self.read = 0, 0
        self.ds = make()
        if position is not None:
            self.epoch, self.read = int(position["epoch"]), int(position["read"])
            self.ds.load_state_dict(position["dataset"])
        self.it = iter(self.ds)

    def position(self) -> dict:
        return {"epoch": self.epoch, "read": self.read, "dataset": self.ds.state_dict()}

    def next(self) -> dict:
        try:
            row = next(self.it)
        except StopIteration:
            if self.read == 0:
                raise DataError("this data-parallel rank's part of the stream is empty: give more rows "
                                "(or files) than data-parallel ranks") from None
            self.epoch, self.read = self.epoch + 1, 0
            self.ds = self.make()
            self.it = iter(self.ds)
            return self.next()
        self.read += 1
        return row


class Shuffled:
    """Tokenized examples, shuffled in blocks of ``buffer`` rows (module docstring). ``position()``:
    {"block": the source's position at the block's first row, "taken": examples given from the block}."""

    def __init__(self, make: Callable[[], Any], tokenize: Callable[[dict], Optional[dict]], buffer: int,
                 seed: int, rank: int, position: Optional[dict] = None) -> None:
        if buffer < 1:
            raise DataError(f"--shuffle-buffer {buffer}: give 1 or more examples")
        self.tokenize, self.buffer, self.seed, self.rank = tokenize, buffer, seed, rank
        self.source = Source(make, None if position is None else position["block"])
        self.block: list = []
        self.start: dict = {}
        self.taken = 0
        self._fill()
        if position is not None:
            self.taken = int(position["taken"])
            if self.taken > len(self.block):
                raise DataError("the checkpoint's stream position does not fit the data: was the data changed?")

    def position(self) -> dict:
        return {"block": self.start, "taken": self.taken}

    def _fill(self) -> None:
        """The next block: at least one example (a block whose rows all drop is skipped; a whole epoch
        that drops every row is an error)."""
        first_epoch = self.source.epoch
        while True:
            self.start = self.source.position()
            raw = [self.source.next() for _ in range(self.buffer)]
            examples = [e for e in map(self.tokenize, raw) if e is not None]
            if examples:
                break
            if self.source.epoch - first_epoch >= 2:
                raise DataError("no example of the stream has a token to learn from after truncation")
        g = torch.Generator().manual_seed(hash_seed(self.seed, self.rank, self.start["epoch"], self.start["read"]))
        self.block = [examples[i] for i in torch.randperm(len(examples), generator=g).tolist()]
        self.taken = 0

    def next(self) -> dict:
        if self.taken == len(self.block):
            self._fill()
        self.taken += 1
        return self.block[self.taken - 1]


class Packed:
    """Packed rows from windows of documents (module docstring). ``position()``: {"window": the examples'
    position at the window's first document, "rows": rows given from the window}."""

    def __init__(self, examples: Shuffled, row_length: int, window_rows: int, pad_id: int,
                 position: Optional[dict] = None) -> None:
        self.examples, self.row_length, self.window_rows, self.pad_id = examples, row_length, window_rows, pad_id
        self.rows: list = []
        self.start: dict = {}
        self.given = 0
        self._fill()
        if position is not None:
            self.given = int(position["rows"])
            if self.given > len(self.rows):
                raise DataError("the checkpoint's stream position does not fit the data: was the data changed?")

    def position(self) -> dict:
        return {"window": self.start, "rows": self.given}

    def _fill(self) -> None:
        from cuboid.packing import pack

        self.start = self.examples.position()
        docs, tokens = [], 0
        while tokens < self.window_rows * self.row_length:
            doc = self.examples.next()
            docs.append(doc)
            tokens += len(doc["input_ids"])
        rows = pack([d["input_ids"] for d in docs], self.row_length, labels=[d["labels"] for d in docs],
                    pad_id=self.pad_id)
        self.rows = [{k: v[i] for k, v in rows.items()} for i in range(rows["input_ids"].shape[0])]
        self.given = 0

    def next(self) -> dict:
        if self.given == len(self.rows):
            self._fill()
        self.given += 1
        return self.rows[self.given - 1]


def hash_seed(*parts: int) -> int:
    """One 63-bit seed from integers (stable across processes, unlike ``hash``)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 64)
    return h >> 1


# ---------------------------------------------------------------- batches


def collate(examples: list, pad_id: int, width_multiple: int = 1) -> dict:
    """Examples ({"input_ids", "labels"} lists) as one batch padded to its longest row rounded up to
    ``width_multiple``: ``input_ids`` (pad ``pad_id``), ``labels`` (-100 on padding), ``attention_mask``.
    Packed rows (tensors with ``position_ids``) are stacked as they are."""
    if "position_ids" in examples[0]:
        return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}
    longest = max(len(e["input_ids"]) for e in examples)
    width = -(-longest // width_multiple) * width_multiple
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long)
        labels[i, :n] = torch.tensor(e["labels"], dtype=torch.long)
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@dataclass
class StreamData:
    """What a stream needs to read and tokenize: the files, the task and how rows are made."""

    kind: str
    files: list
    tokenize: Callable[[dict], Optional[dict]]
    pad_id: int
    row_length: int                       # the longest row (packing: the packed row's length)
    packing: bool = False
    skip: int = 0                         # rows at the stream's start held out for eval
    shuffle_buffer: int = 1000
    seed: int = 0
    width_multiple: int = 1


class StreamBatches:
    """This dp rank's share of each global batch, from its stream: ``rows`` examples (or packed rows) a
    step. ``position`` is JSON (module docstring); setting it resumes there."""

    def __init__(self, data: StreamData, rows: int, rank: int, world: int) -> None:
        self.data, self.rows, self.rank, self.world = data, rows, rank, world
        self.steps = 0
        self._open(None)

    def _make(self):
        from datasets.distributed import split_dataset_by_node

        ds = open_stream(self.data.kind, self.data.files)
        if self.data.skip:
            ds = ds.skip(self.data.skip)
        return split_dataset_by_node(ds, rank=self.rank, world_size=self.world) if self.world > 1 else ds

    def _open(self, position: Optional[dict]) -> None:
        d = self.data
        if position is not None and ("packed" in position) != d.packing:
            raise DataError("the checkpoint's stream was " + ("" if "packed" in position else "not ")
                            + "packed: resume with --packing as the run was started")
        at = None if position is None else position["packed"]["window"] if d.packing else position["examples"]
        self.examples = Shuffled(self._make, d.tokenize, d.shuffle_buffer, d.seed, self.rank, at)
        self.packed = None
        if d.packing:  # a window of at least two steps' rows, so few rows are a window's half-filled tail
            self.packed = Packed(self.examples, d.row_length, max(2 * self.rows, 16), d.pad_id,
                                 None if position is None else position["packed"])

    @property
    def position(self) -> dict:
        if self.packed is not None:
            return {"steps": self.steps, "packed": self.packed.position()}
        return {"steps": self.steps, "examples": self.examples.position()}

    @position.setter
    def position(self, position: dict) -> None:
        self._open(position)
        self.steps = int(position["steps"])

    @property
    def epoch(self) -> float:
        """The epoch this rank's stream is reading (whole epochs only: a stream has no length)."""
        return float(self.examples.source.epoch)

    def describe(self) -> str:
        """The stream in one line (for the run's start)."""
        d = self.data
        rows = (f"{self.rows} packed rows of {d.row_length} tokens" if d.packing
                else f"{self.rows} rows (each batch as wide as its longest, up to {d.row_length} tokens)")
        return (f"data: streamed from {len(d.files)} {d.kind} file(s), {rows} a step per data-parallel rank "
                f"of {self.world}, shuffled in blocks of {d.shuffle_buffer} rows"
                + (f", the first {d.skip} rows held out for eval" if d.skip else ""))

    def next(self) -> dict:
        stage = self.packed if self.packed is not None else self.examples
        batch = collate([stage.next() for _ in range(self.rows)], self.data.pad_id, self.data.width_multiple)
        self.steps += 1
        return batch


def example_tokenizer(task: str, tokenizer, row_length: int, *, text_column: str = "text", sft=None,
                      packing: bool = False) -> Callable[[dict], Optional[dict]]:
    """One raw row -> {"input_ids", "labels"} (None: nothing to learn). ``sft``: the row through
    :func:`cuboid.sft.tokenize_example` with ``sft`` (an ``SFTOptions`` whose ``max_length`` is
    ``row_length``; the format is detected from the first row's columns unless given, and the chat template
    read once then). ``causal``: the text column's tokens + EOS, labels the tokens, cut to ``row_length``
    unless packing (the packer splits a long document into row-sized pieces)."""
    if task == "sft":
        return _sft_tokenizer(tokenizer, sft)
    eos = tokenizer.eos_token_id

    def tokenize_text(row: dict) -> Optional[dict]:
        if text_column not in row:
            raise DataError(f"column {text_column!r} not found (columns: {', '.join(row)}); set --text-column")
        text = row[text_column]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) and text else []
        if not ids:
            return None
        ids = [*ids, eos] if eos is not None else ids
        ids = ids if packing else ids[:row_length]
        return {"input_ids": ids, "labels": list(ids)}

    return tokenize_text


def _sft_tokenizer(tokenizer, opts) -> Callable[[dict], Optional[dict]]:
    from cuboid.sft import detect_format, resolve_options, tokenize_example

    resolved: list = []  # (format, options) once the first row is seen

    def tokenize_sft(row: dict) -> Optional[dict]:
        if not resolved:
            fmt = detect_format(list(row), opts)
            column = row.get(opts.text_column or "prompt") if fmt == "prompt_completion" else None
            resolved.append((fmt, resolve_options(opts, tokenizer, fmt, isinstance(column, list))))
        fmt, o = resolved[0]
        out = tokenize_example(row, tokenizer, o, fmt)
        return None if out is None else {"input_ids": list(out["input_ids"]), "labels": list(out["labels"])}

    return tokenize_sft


def setup(prep: dict, data: Any, task: str, *, rank: int, world: int, rows: int, shuffle_buffer: int = 1000,
          seed: int = 0, width_multiple: int = 1, eval_examples: int = EVAL_EXAMPLES) -> tuple:
    """(this dp rank's :class:`StreamBatches`, the eval tensors, the eval examples) for streaming ``data``;
    ``prep`` is what :func:`cuboid.data.prepare` is given (config, tokenizer, seq_len, text_column,
    packing, sft). Eval: the data's eval file, else the stream's first ``eval_examples`` rows (module
    docstring)."""
    import dataclasses
    from itertools import islice

    if task not in STREAM_TASKS:
        raise DataError(f"--streaming streams text for {' and '.join(STREAM_TASKS)}, not for task {task}")
    tokenizer, config, packing = prep.get("tokenizer"), prep["config"], bool(prep.get("packing"))
    if tokenizer is None:
        raise DataError(f"task {task} needs a tokenizer: load the model from a folder with tokenizer.json "
                        "or pass --tokenizer PATH")
    kind, train, held = stream_files(data)
    sft = None
    if task == "sft":  # as cuboid.data.prepare: the max length is the row length, within the model's positions
        from cuboid.sft import SFTOptions

        text_column = prep.get("text_column", "text")
        sft = prep.get("sft") or SFTOptions(max_length=prep.get("seq_len") or 1024,
                                            text_column=None if text_column == "text" else text_column)
        sft = dataclasses.replace(sft, max_length=min(sft.max_length, config.n_positions))
        row_length = sft.max_length
    else:
        row_length = min(prep.get("seq_len") or 128, config.n_positions)
    tokenize = example_tokenizer(task, tokenizer, row_length, text_column=prep.get("text_column", "text"),
                                 sft=sft, packing=packing)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    raw = list(islice(iter(open_stream(kind, held or train)), eval_examples))
    if not held and len(raw) < eval_examples:
        raise DataError(f"data {data}: {len(raw)} rows, all held out for eval (the first {eval_examples}): "
                        "give more rows, or a file named validation.* beside the training file(s)")
    examples = [e for e in map(tokenize, raw) if e is not None]
    if not examples:
        raise DataError(f"data {data}: none of the {len(raw)} eval rows has a token to learn from")
    if packing:
        from cuboid.packing import pack

        eval_tensors = pack([e["input_ids"] for e in examples], row_length,
                            labels=[e["labels"] for e in examples], pad_id=pad_id)
    else:
        eval_tensors = collate(examples, pad_id, width_multiple)
    stream = StreamData(kind=kind, files=train, tokenize=tokenize, pad_id=pad_id, row_length=row_length,
                        packing=packing, skip=0 if held else len(raw), shuffle_buffer=shuffle_buffer, seed=seed,
                        width_multiple=width_multiple)
    return StreamBatches(stream, rows, rank, world), eval_tensors, len(raw)


def gather_positions(batches: StreamBatches, mesh) -> list:
    """Every dp rank's stream position, indexed by dp coordinate, on every rank (a collective)."""
    dp = mesh.size("dp")
    if mesh.world_size == 1:
        return [batches.position]
    import torch.distributed as dist

    from cuboid.parallel import comm

    every: list = [None] * mesh.world_size
    with comm.guarded("all_gather_object (stream positions)", None):
        dist.all_gather_object(every, (mesh.coords["dp"], batches.position))
    out: list = [None] * dp
    for coord, pos in every:
        out[coord] = pos
    return out


def saved_position(saved: dict, mesh) -> dict:
    """This dp rank's stream position from a checkpoint's data state; a one-line ValueError when the
    checkpoint was not streamed or streamed over another number of dp ranks."""
    positions = saved.get("stream")
    if positions is None:
        raise ValueError("the checkpoint was not written by a --streaming run: resume it without --streaming")
    if len(positions) != mesh.size("dp"):
        raise ValueError(f"the checkpoint streamed over {len(positions)} data-parallel ranks, this run has "
                         f"{mesh.size('dp')}: a stream resumes under the same dp")
    return positions[mesh.coords["dp"]]
