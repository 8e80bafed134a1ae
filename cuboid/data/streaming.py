"""Streaming fine-tune data (``--streaming``): local files read as they train, resumed exactly.

A local jsonl / json / csv / parquet / text file (or a folder of files of one
kind) is read as a ``datasets`` ``IterableDataset`` (``load_dataset(kind,
data_files=..., streaming=True)``), nothing tokenized ahead. Each data-parallel
rank reads its own rows (``datasets.distributed.split_dataset_by_node`` by its
dp coordinate: whole files when their number is a multiple of dp, else every
dp-th row; every dp-th row too when the stream's first rows are held out for
eval, so that no rank trains on them whatever the files), so the tensor,
pipeline and sequence ranks of one dp group read the same rows and every dp
rank different ones. A step takes ``rows`` examples
(or packed rows) from each dp rank's stream: the rank's share of the global
batch, given to :func:`cuboid.train.step.train_step` with ``share=True``.

The pipeline of one rank, each stage pulling from the one before:

1. :class:`Source`: the rank's raw rows, epoch after epoch (a stream has no
   length: the run needs ``--steps``);
2. :class:`Shuffled`: rows tokenized (:func:`cuboid.data.sft.tokenize_example` for
   ``sft``; text + EOS for ``causal``) and shuffled in blocks of
   ``shuffle_buffer`` rows, each block in an order drawn from (seed, rank,
   epoch, the block's first row); an epoch's end closes a block, so each
   epoch gives every row of the rank once;
3. :class:`Packed` (``--packing``): windows of documents (at least two steps'
   rows, and 16, worth of tokens) packed into rows by
   :func:`cuboid.data.packing.pack` (best-fit-decreasing); without packing each
   example is a row and a batch is padded to its longest row, rounded up to
   ``width_multiple``.

Exact resume. ``datasets``' own buffered shuffle loses its buffer on resume
(its docs say so; huggingface/datasets#7901), so it is not used, and neither
are saved buffers of token ids (up to ``shuffle_buffer`` examples of up to
``max_length`` tokens per dp rank in every checkpoint). Instead each stage's
position is where its current piece of work began plus how far into it the
stage is (:class:`_Pieces`): the source's ``IterableDataset.state_dict()`` at
a block's first row and the examples given from that block; with packing, the
examples' position at a window's first document and the rows given from that
window. A resume opens the source at the block's start, reads and tokenizes
that one block again (at most ``shuffle_buffer`` rows, plus one packing
window), draws the same order and skips what was given. So the checkpoint
holds a few small JSON values per dp rank, a resumed run sees exactly the
batches the uninterrupted one does, and a resume costs one block's reading,
not the stream's. The price against a sliding buffer: rows mix within a block
only (a sliding buffer lets a few rows drift further); data sorted on disk
wants its files shuffled first, or a larger buffer. A stream resumed from a
resumed stream's position (where huggingface/datasets#8308 saw the state stop
advancing) is tested with the installed ``datasets`` (5.2) in
tests/front/test_streaming.py, in one process and through two kills of a
dp=2 run.

Eval: the data's own eval file when a folder has one (a file whose name has
a word ``validation``, ``valid``, ``val``, ``eval``, ``dev`` or ``test``), else
the stream's first ``eval_examples`` rows (:data:`EVAL_EXAMPLES`, in file
order, before any shuffling), which training then skips in every epoch; of an
eval file, its first ``eval_examples`` rows. The eval rows are read
once and prepared as tensors, as the non-streaming path's eval split is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from cuboid.data.formats import DATA_FILE_KINDS, DataError, kept_text

__all__ = ["EVAL_EXAMPLES", "StreamData", "Source", "Shuffled", "Packed", "StreamBatches", "stream_files",
           "open_stream", "example_tokenizer", "collate", "setup", "gather_positions", "saved_position"]

EVAL_EXAMPLES = 100                    # rows held out for eval when the data has no eval file
EVAL_WORDS = {"validation", "valid", "val", "eval", "dev", "test"}


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
    empty = next((p for p in files if p.stat().st_size == 0), None)
    if empty is not None:
        raise DataError(f"data {empty}: the file is empty")
    held = [p for p in files if EVAL_WORDS & set(re.split(r"[^a-z]+", p.stem.lower()))] if len(files) > 1 else []
    train = [p for p in files if p not in held]
    if not train:
        raise DataError(f"data {source}: every file is named as eval data; name the training files otherwise")
    return kinds.pop(), [str(p) for p in train], [str(p) for p in held]


def diagnose(kind: str, files: list) -> None:
    """After a stream failed: a :class:`DataError` naming the damaged file and line, when one is found
    (empty, not UTF-8, a row that is not JSON; :mod:`cuboid.data.damage`)."""
    from cuboid.data import damage

    damage.check_text_files(files, kind)
    where = damage.locate(files, kind)
    if where is not None:
        raise DataError(where)


def open_stream(kind: str, files: list[str]):
    """The files as one unshuffled ``IterableDataset``."""
    import datasets

    return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)


def _by_examples() -> dict:
    """``split_dataset_by_node``'s argument that deals rows, not files (``strategy``, where datasets has it)."""
    import inspect

    from datasets.distributed import split_dataset_by_node

    if "strategy" not in inspect.signature(split_dataset_by_node).parameters:
        raise DataError("--streaming with rows held out for eval over several data-parallel ranks needs "
                        "datasets with split_dataset_by_node(strategy=...): upgrade datasets, or name an eval "
                        "file validation.jsonl beside the training files")
    return {"strategy": "examples"}


# ---------------------------------------------------------------- the stages


class Source:
    """One dp rank's raw rows, epoch after epoch. ``position()``: {"epoch", "read" (rows read in the
    epoch), "dataset" (the ``IterableDataset.state_dict()``)}."""

    def __init__(self, make: Callable[[], Any], position: Optional[dict] = None,
                 diagnose: Optional[Callable[[], None]] = None) -> None:
        self.make, self.diagnose = make, diagnose
        self.epoch, self.read = 0, 0
        self.ds = make()
        if position is not None:
            self.epoch, self.read = int(position["epoch"]), int(position["read"])
            self.ds.load_state_dict(position["dataset"])
        self.it = iter(self.ds)

    def position(self) -> dict:
        return {"epoch": self.epoch, "read": self.read, "dataset": self.ds.state_dict()}

    def next(self) -> Optional[dict]:
        """The next row; None at an epoch's end (the next call reads the next epoch's first row)."""
        try:
            row = next(self.it)
        except DataError:
            raise
        except StopIteration:
            if self.read == 0:
                raise DataError("this data-parallel rank's part of the stream is empty: give more rows "
                                "(or files) than data-parallel ranks") from None
            self.epoch, self.read = self.epoch + 1, 0
            self.ds = self.make()
            self.it = iter(self.ds)
            return None
        except Exception:  # a damaged file (datasets' generation error): the file and line, if they are found
            if self.diagnose is not None:
                self.diagnose()
            raise
        self.read += 1
        return row


class _Pieces:
    """A stage that gives items from pieces of work (a block, a window), each made whole from where it
    began. ``position()``: {"start": the stage before's position at the piece's start, "given": items given
    from the piece}; restoring makes that piece again and skips what was given."""

    items: list
    start: dict
    given: int

    def _fill(self) -> None:  # sets start and items, given = 0
        raise NotImplementedError

    def _restore(self, position: Optional[dict]) -> None:
        self._fill()
        if position is not None:
            self.given = int(position["given"])
            if self.given > len(self.items):
                raise DataError("the checkpoint's stream position does not fit the data: was the data changed?")

    def position(self) -> dict:
        return {"start": self.start, "given": self.given}

    def next(self) -> dict:
        if self.given == len(self.items):
            self._fill()
        self.given += 1
        return self.items[self.given - 1]


class Shuffled(_Pieces):
    """Tokenized examples, shuffled in blocks of ``buffer`` rows, an epoch's end closing a block (so an
    epoch gives each row once); a piece is a block, its start the :class:`Source`'s position."""

    def __init__(self, make: Callable[[], Any], tokenize: Callable[[dict], Optional[dict]], buffer: int,
                 seed: int, rank: int, position: Optional[dict] = None,
                 diagnose: Optional[Callable[[], None]] = None) -> None:
        if buffer < 1:
            raise DataError(f"--shuffle-buffer {buffer}: give 1 or more examples")
        self.tokenize, self.buffer, self.seed, self.rank = tokenize, buffer, seed, rank
        self.source = Source(make, None if position is None else position["start"], diagnose)
        self._restore(position)

    def _fill(self) -> None:
        """The next block: at least one example (a block whose rows all drop is skipped; a whole epoch
        that drops every row is an error)."""
        first_epoch = self.source.epoch
        while True:
            self.start = self.source.position()
            raw = []
            while len(raw) < self.buffer:
                row = self.source.next()
                if row is None:
                    break
                raw.append(row)
            examples = [e for e in map(self.tokenize, raw) if e is not None]
            if examples:
                break
            if self.source.epoch - first_epoch >= 2:
                raise DataError("no example of the stream has a token to learn from after truncation")
        g = torch.Generator().manual_seed(hash_seed(self.seed, self.rank, self.start["epoch"], self.start["read"]))
        self.items = [examples[i] for i in torch.randperm(len(examples), generator=g).tolist()]
        self.given = 0


class Packed(_Pieces):
    """Packed rows; a piece is a window of documents (at least ``window_rows`` rows' worth of tokens) packed
    by best-fit-decreasing, its start the :class:`Shuffled` examples' position at its first document."""

    def __init__(self, examples: Shuffled, row_length: int, window_rows: int, pad_id: int,
                 position: Optional[dict] = None) -> None:
        self.examples, self.row_length, self.window_rows, self.pad_id = examples, row_length, window_rows, pad_id
        self._restore(position)

    def _fill(self) -> None:
        from cuboid.data.packing import pack

        self.start = self.examples.position()
        docs, tokens = [], 0
        while tokens < self.window_rows * self.row_length:
            doc = self.examples.next()
            docs.append(doc)
            tokens += len(doc["input_ids"])
        rows = pack([d["input_ids"] for d in docs], self.row_length, labels=[d["labels"] for d in docs],
                    pad_id=self.pad_id)
        self.items = [{k: v[i] for k, v in rows.items()} for i in range(rows["input_ids"].shape[0])]
        self.given = 0


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
        self._files = [[Path(f).name, Path(f).stat().st_size, _head_hash(f)] for f in data.files]  # as they start
        self._open(None)

    def _make(self):
        from datasets.distributed import split_dataset_by_node

        ds = open_stream(self.data.kind, self.data.files)
        if not self.data.skip:
            return split_dataset_by_node(ds, rank=self.rank, world_size=self.world) if self.world > 1 else ds
        ds = ds.skip(self.data.skip)
        if self.world == 1:
            return ds
        # held-out rows are the stream's first rows in file order: dealt as whole files, each rank would skip
        # a share of its own files' rows (datasets splits a skip per shard), training on eval rows
        return split_dataset_by_node(ds, rank=self.rank, world_size=self.world, **_by_examples())

    def _open(self, position: Optional[dict]) -> None:
        d = self.data
        if position is not None and ("packed" in position) != d.packing:
            raise DataError("the checkpoint's stream was " + ("" if "packed" in position else "not ")
                            + "packed: resume with --packing as the run was started")
        at = None if position is None else position["packed"]["start"] if d.packing else position["examples"]
        self.examples = Shuffled(self._make, d.tokenize, d.shuffle_buffer, d.seed, self.rank, at,
                                 lambda: diagnose(d.kind, d.files))
        self.packed = None
        if d.packing:  # a window of at least two steps' rows, so few rows are a window's half-filled tail
            self.packed = Packed(self.examples, d.row_length, max(2 * self.rows, 16), d.pad_id,
                                 None if position is None else position["packed"])

    @property
    def position(self) -> dict:
        at = {"packed": self.packed.position()} if self.packed is not None else {"examples": self.examples.position()}
        return {"steps": self.steps, **at, "stream": self.fingerprint()}

    @position.setter
    def position(self, position: dict) -> None:
        if "stream" in position:
            check_fingerprint(position["stream"], self.fingerprint())
        self._open(position)
        self.steps = int(position["steps"])

    def fingerprint(self) -> dict:
        """What a position refers to: each file's name, size and SHA-256 of its first block, and the settings
        that decide the rows (buffer, seed, row length, packing and its window, the held-out rows)."""
        d = self.data
        return {"files": self._files, "shuffle_buffer": d.shuffle_buffer, "seed": d.seed,
                "row_length": d.row_length, "packing": d.packing, "skip": d.skip,
                "rows": self.rows if d.packing else None}

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


_HEAD = 1 << 16  # bytes of a file's start hashed for a stream's fingerprint


def _head_hash(path) -> str:
    import hashlib

    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read(_HEAD)).hexdigest()[:16]


_SETTINGS = {"shuffle_buffer": "--shuffle-buffer", "seed": "--seed", "row_length": "the row length (--seq-len)",
             "packing": "--packing", "skip": "the rows held out for eval", "rows": "the rows a step (--batch-size)"}


def check_fingerprint(saved: dict, now: dict) -> None:
    """A one-sentence DataError when a checkpoint's stream position was taken over other files or settings
    than this run's (a resume would go on silently on other rows)."""
    where = "resume with the data and settings the run started with"
    if [f[0] for f in saved.get("files", [])] != [f[0] for f in now["files"]]:
        raise DataError(f"the checkpoint streamed the files {', '.join(f[0] for f in saved['files'])}, this run "
                        f"{', '.join(f[0] for f in now['files'])}: {where}")
    for (name, size, head), (_, size_now, head_now) in zip(saved["files"], now["files"]):
        if size != size_now or head != head_now:
            change = f"was {size} bytes, now {size_now}" if size != size_now else "has another first block"
            raise DataError(f"the checkpoint's stream position refers to {name} as it was: the file {change} "
                            f"(truncated or rewritten); {where}")
    for key, what in _SETTINGS.items():
        if key in saved and saved[key] != now[key]:
            raise DataError(f"the checkpoint streamed with {what} {saved[key]}, this run with {now[key]}: {where}")


def example_tokenizer(tokenizer, row_length: int, *, text_column: str = "text", sft=None,
                      packing: bool = False) -> Callable[[dict], Optional[dict]]:
    """One raw row -> {"input_ids", "labels"} (None: nothing to learn). With ``sft`` (an ``SFTOptions``
    whose ``max_length`` is ``row_length``) the row goes through :func:`cuboid.data.sft.tokenize_example`
    (the format detected from the first row's columns unless given, the chat template read once then);
    without, the text column's tokens + EOS, labels the tokens, cut to ``row_length`` unless packing (the
    packer splits a long document into row-sized pieces)."""
    if sft is not None:
        return _sft_tokenizer(tokenizer, sft)
    eos = tokenizer.eos_token_id

    def tokenize_text(row: dict) -> Optional[dict]:
        if text_column not in row:
            raise DataError(f"column {text_column!r} not found (columns: {', '.join(row)}); set --text-column")
        text = row[text_column]
        if isinstance(text, str) and not packing:  # a cut keeps the first row_length tokens: tokenize only those
            text = kept_text(tokenizer, text, row_length)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if isinstance(text, str) and text else []
        if not ids:
            return None
        ids = [*ids, eos] if eos is not None else ids
        ids = ids if packing else ids[:row_length]
        return {"input_ids": ids, "labels": list(ids)}

    return tokenize_text


def _sft_tokenizer(tokenizer, opts) -> Callable[[dict], Optional[dict]]:
    from cuboid.data.sft import detect_format, resolve_options, tokenize_example

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


def setup(prep: dict, data: Any, task, *, rank: int, world: int, rows: int, shuffle_buffer: int = 1000,
          seed: int = 0, width_multiple: int = 1, eval_examples: int = EVAL_EXAMPLES) -> tuple:
    """(this dp rank's :class:`StreamBatches`, the eval tensors, the eval examples) for streaming ``data``;
    ``prep`` is what the task's rows are made with (config, tokenizer, seq_len, text_column, packing);
    ``task`` (a :class:`cuboid.tasks.Task`) gives the row length and the record -> row function. Eval: the
    data's eval file, else the stream's first ``eval_examples`` rows (module docstring)."""
    from itertools import islice

    task.check(streaming=True)
    tokenizer, packing = prep.get("tokenizer"), bool(prep.get("packing"))
    if tokenizer is None:
        raise DataError(f"task {task.label} needs a tokenizer: load the model from a folder with tokenizer.json "
                        "or pass --tokenizer PATH")
    kind, train, held = stream_files(data)
    row_length = task.row_length(prep)
    tokenize = task.example(prep, row_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    try:
        raw = list(islice(iter(open_stream(kind, held or train)), eval_examples))
    except DataError:
        raise
    except Exception:  # noqa: BLE001 - a damaged file: named with its line where it is found
        diagnose(kind, held or train)
        raise
    if not held and len(raw) < eval_examples:
        raise DataError(f"data {data}: {len(raw)} rows, all held out for eval (the first {eval_examples}): "
                        "give more rows, or a file named validation.* beside the training file(s)")
    examples = [e for e in map(tokenize, raw) if e is not None]
    if not examples:
        raise DataError(f"data {data}: none of the {len(raw)} eval rows has a token to learn from")
    if packing:
        from cuboid.data.packing import pack

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
