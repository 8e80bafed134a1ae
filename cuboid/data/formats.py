"""Data for fine-tuning: Hugging Face ``datasets`` in, fixed-shape tensors out.

Sources (:func:`load_source`): an in-memory ``datasets.Dataset`` /
``DatasetDict``; a local csv / json / jsonl / parquet / text file; a folder
written by ``save_to_disk``; an ``imagefolder`` folder (one sub-folder per
class); a folder of data files of one kind (split into train / validation / test by their names as
``datasets.load_dataset`` splits them, :func:`split_files`); or ``"digits"``, the 8x8
handwritten digits that ship with scikit-learn (the embedded default).

Rows (the tasks of :mod:`cuboid.tasks` choose among them): :func:`text_blocks`
(tokenized text concatenated and cut into blocks, or with ``packing`` each
record a document packed into rows by :func:`cuboid.data.packing.pack`, with
``position_ids`` restarting per document), :func:`sft_rows` (instruction and
chat records with loss masks, :mod:`cuboid.data.sft`), :func:`fixed_rows`
(padded/truncated tokens, optionally one label per example),
:func:`image_rows` (images resized and normalised as HF's ViT image
processor, one label per example) and :func:`pretokenized_rows` (a split
that is already tokenized: a ``cuboid prepare`` folder). :func:`mask_tokens`
masks a batch BERT's way.

:class:`GlobalBatches` draws global batches from the prepared tensors in a
seeded order per epoch; each data-parallel rank takes its own contiguous share.
Its position is one integer (batches drawn), so a resumed run sees the same
batches as one that never stopped. A drawn batch of padded rows (an
``attention_mask`` and no ``position_ids``) loses its trailing columns of
padding: it is as wide as its longest row, rounded up to ``width_multiple``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch

from cuboid.data.chat import DataError  # defined below the data modules (sft and chat raise it too); public here
from cuboid.data.chat import TextEncoder, head_text

DATA_FILE_KINDS = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}




# ---------------------------------------------------------------- sources


def digits_dataset():
    """scikit-learn's 1,797 8x8 handwritten digits as a ``datasets.Dataset`` of grey PIL images."""
    import datasets
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    images = [Image.fromarray((img * (255.0 / 16.0)).astype(np.uint8), mode="L") for img in d.images]
    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[str(i) for i in range(10)])})
    return datasets.Dataset.from_dict({"image": images, "label": d.target.tolist()}, features=features)


def load_source(source: Any):
    """A ``Dataset`` or ``DatasetDict`` from any supported source (see module docstring). A damaged file (empty,
    not UTF-8, a row that is not JSON) is a one-line :class:`DataError` naming the file and line."""
    try:
        return _load_source(source)
    except DataError:
        raise
    except ValueError as e:  # datasets' own complaints, made one line that names the source
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "corresponds to no data" in msg:
            raise DataError(f"data {source}: the dataset is empty") from None
        raise DataError(f"data {source}: {msg}") from None


def _load_files(kind: str, files):
    """``datasets.load_dataset(kind, data_files=files)`` (a list: one train split; a dict: split -> files), the
    files checked before (empty, not UTF-8) and a failed load traced to its row (:mod:`cuboid.data.damage`)."""
    import datasets

    from cuboid.data import damage

    every = [f for part in files.values() for f in part] if isinstance(files, dict) else list(files)
    damage.check_text_files(every, kind)
    log = logging.getLogger("datasets")  # its reader logs a failed file at ERROR: the one line below says it
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(kind, data_files=files if isinstance(files, dict) or len(files) > 1
                                     else files[0])
    except Exception as e:  # noqa: BLE001 - datasets' generation errors chain the cause; find the row
        where = damage.locate(every, kind)
        if where is not None:
            raise DataError(where) from None
        cause = e.__cause__ or e
        if "corresponds to no data" in str(cause):  # a header-only csv, a jsonl of blank lines
            raise DataError(f"data {', '.join(map(str, every))}: no rows"
                            + (" (a header and no rows below it)" if kind == "csv" else "")) from None
        raise DataError(f"data {', '.join(map(str, every))}: {type(cause).__name__}: "
                        f"{(str(cause).splitlines() or [''])[0]}") from None
    finally:
        log.setLevel(level)


def split_files(folder: Path, files: list) -> dict:
    """``files`` (of ``folder``) by split, named as ``datasets.load_dataset(folder)`` names them: a file or
    sub-folder called train / validation (valid, dev, val) / test (testing, eval, evaluation), with
    datasets' own patterns (``datasets.data_files``); every file in ``train`` when none is named so."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # noqa: BLE001 - no pattern matched in datasets' sense: one split of every file
        return {"train": [str(p) for p in files]}
    wanted = {str(Path(p).resolve()) for p in files}
    out = {str(split): [f for f in found[split] if str(Path(f).resolve()) in wanted] for split in found}
    out = {k: v for k, v in out.items() if v}
    return out if out else {"train": [str(p) for p in files]}


def _load_source(source: Any):
    import datasets

    if isinstance(source, (datasets.Dataset, datasets.DatasetDict)):
        return source
    if isinstance(source, dict):
        return datasets.Dataset.from_dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DataError(f"data must be a datasets.Dataset, a dict of columns or a path, got {type(source).__name__}")
    if str(source) == "digits":
        return digits_dataset()
    path = Path(source)
    if not path.exists():
        raise DataError(f"data {source}: no such file or folder")
    if path.is_file():
        kind = DATA_FILE_KINDS.get(path.suffix.lower())
        if kind is None:
            raise DataError(f"data {source}: unsupported file type {path.suffix!r} "
                            f"(supported: {', '.join(sorted(DATA_FILE_KINDS))})")
        return _load_files(kind, [str(path)])
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return datasets.load_from_disk(str(path))
    files = [p for p in path.rglob("*") if p.is_file()]
    if any(p.suffix.lower() in IMAGE_EXTS for p in files):
        return datasets.load_dataset("imagefolder", data_dir=str(path))
    kinds = {DATA_FILE_KINDS[p.suffix.lower()] for p in files if p.suffix.lower() in DATA_FILE_KINDS}
    if len(kinds) == 1:
        kind = kinds.pop()
        ext = [e for e, k in DATA_FILE_KINDS.items() if k == kind]
        data_files = split_files(path, sorted(p for p in files if p.suffix.lower() in ext))
        return _load_files(kind, data_files if len(data_files) > 1 else data_files["train"]
                           if "train" in data_files else next(iter(data_files.values())))
    raise DataError(f"data {source}: a folder with no images and {'mixed' if kinds else 'no'} data files")


EVAL_SPLITS = ("validation", "valid", "eval", "test")  # a DatasetDict's held-out split, the first of these


def train_eval_split(data, eval_fraction: float = 0.1, seed: int = 0, eval_data: Any = None):
    """(train, eval) splits: ``eval_data``'s (a source of its own: its validation/test split, or all of it),
    else the source's own validation/test split, else a seeded holdout of ``eval_fraction``; eval is None
    when ``eval_fraction`` is 0 (no eval: every example trains) and neither gives one."""
    import datasets

    held = None
    if isinstance(data, datasets.DatasetDict):
        train = data.get("train") or data[next(iter(data))]
        held = next((data[name] for name in EVAL_SPLITS if name in data and data[name] is not train), None)
        data = train
    if eval_data is not None:
        held = load_source(eval_data)
        if isinstance(held, datasets.DatasetDict):
            held = next((held[name] for name in EVAL_SPLITS if name in held), None) or held[next(iter(held))]
        if len(held) == 0:
            raise DataError(f"eval data {eval_data}: the dataset is empty")
    if len(data) == 0:
        raise DataError("the dataset is empty")
    if held is not None or not eval_fraction:
        return data, held
    if len(data) < 2:
        raise DataError(f"the dataset has {len(data)} example: too few to hold out an eval split")
    parts = data.train_test_split(test_size=eval_fraction, seed=seed)
    return parts["train"], parts["test"]


# ---------------------------------------------------------------- preparation


def _need_column(ds, name: str, flag: str) -> None:
    if name not in ds.column_names:
        raise DataError(f"column {name!r} not found (columns: {', '.join(ds.column_names)}); set {flag}")


def class_names(ds, label_column: str) -> Optional[list]:
    feat = ds.features.get(label_column)
    return list(feat.names) if getattr(feat, "names", None) else None


def num_classes(ds, label_column: str, *others, dense: bool = True) -> int:
    """K of a classification dataset: its ClassLabel's names, or integer ids 0..K-1 over ``ds`` and the
    ``others`` splits (each class present in one of them; ``dense=False``: the largest id + 1, for a model
    whose head is already sized, against which the rows' labels are checked)."""
    _need_column(ds, label_column, "--label-column")
    names = class_names(ds, label_column)
    if names:
        return len(names)
    labels = list(ds[label_column]) + [x for o in others if label_column in o.column_names for x in o[label_column]]
    if not labels:
        raise DataError("the dataset is empty")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in labels):
        raise DataError(f"column {label_column!r} must hold integer class ids")
    return dense_classes(set(labels), label_column) if dense else max(labels) + 1


def dense_classes(ids: set, label_column: str) -> int:
    """K for class ids that are exactly 0..K-1 (every class present), checked before a head of K rows is
    built: a stray id (10^9, -1) would size the head, or index past it."""
    k = len(ids)
    if min(ids) < 0 or max(ids) >= k:
        bad = min(ids) if min(ids) < 0 else max(ids)
        missing = sorted(set(range(min(k, 1 << 20))) - ids)[:3]
        raise DataError(f"column {label_column!r} holds class id {bad}, but its {k} distinct ids must be 0..{k - 1}"
                        + (f" (missing {', '.join(map(str, missing))})" if missing else "")
                        + ": renumber the classes 0..K-1, or give the column a ClassLabel feature naming them")
    return k


def _check_labels(labels: torch.Tensor, n: int, column: str) -> None:
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= n):
        bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
        raise DataError(f"label {bad} in column {column!r} is out of range for a model with {n} classes")


def check_split(ds) -> None:
    """A one-line DataError for an empty split."""
    if len(ds) == 0:
        raise DataError("the dataset is empty")


def need_tokenizer(tokenizer, task: str) -> None:
    """A one-line DataError when a text task has no tokenizer."""
    if tokenizer is None:
        raise DataError(f"task {task} needs a tokenizer: load the model from a folder with tokenizer.json "
                        "or pass --tokenizer PATH")


def pretokenized(ds) -> bool:
    """Whether a split is already tokenized (an ``input_ids`` column: a ``cuboid prepare`` folder)."""
    return "input_ids" in ds.column_names


PREPARE_REPORT = "prepare_report.json"  # what cuboid prepare writes beside its splits
# a fine-tune flag -> (its FinetuneConfig field, the report's key, prepare's flag): the rows a prepared
# folder holds were made with these; a fine-tune cannot make them again
PREPARED_FLAGS = {"--seq-len": ("seq_len", "max_length", "--max-length"),
                  "--train-on-prompt": ("train_on_prompt", "train_on_prompt", "--train-on-prompt"),
                  "--template": ("template", "template", "--template"),
                  "--data-format": ("data_format", "data_format", "--data-format"),
                  "--chat-template": ("chat_template", None, "--chat-template")}


def check_prepared(data, given: dict) -> None:
    """A one-line DataError when ``data`` is a ``cuboid prepare`` folder and a flag that makes rows (``given``:
    field -> value, unset ones None or False) asks for other rows than the folder's report says it holds:
    those flags cannot apply to tokenized rows (prepare again with them)."""
    if not isinstance(data, (str, os.PathLike)) or not (Path(data) / PREPARE_REPORT).is_file():
        return
    from cuboid.data.damage import check_text_file

    check_text_file(Path(data) / PREPARE_REPORT)
    try:
        report = json.loads((Path(data) / PREPARE_REPORT).read_text(encoding="utf-8"))
    except ValueError:
        raise DataError(f"data {data}: {PREPARE_REPORT} is not JSON") from None
    for flag, (field, key, theirs) in PREPARED_FLAGS.items():
        value = given.get(field)
        if value is None or value is False or (key is not None and value == report.get(key)):
            continue
        was = f"{theirs} {report.get(key)}" if key is not None and report.get(key) is not None else \
            f"no {theirs}" if key is not None else f"the {theirs} of its tokenizer"
        raise DataError(f"{flag} {value} cannot apply to {data}: a cuboid prepare folder's rows are tokenized "
                        f"already (made with {was}, {PREPARE_REPORT}); run cuboid prepare again with {theirs}, "
                        f"or leave out {flag}")


def pretokenized_rows(ds, config, tokenizer, seq_len: Optional[int], packing: bool) -> dict:
    """A tokenized split's rows as they are (packed rows kept; other rows padded to the longest, or packed)."""
    from cuboid.data.sft import prepared_tensors

    return prepared_tensors(ds, packing=packing, row_length=min(seq_len or 1024, config.n_positions),
                            pad_id=pad_id(tokenizer))


# columns that say which task the data is for, when the text column is missing: (columns, the hint)
TASK_COLUMNS = ((("prompt", "chosen", "rejected"), "looks like preference pairs: add --task dpo (or reward)"),
                (("messages",), "looks like chat data: add --task sft"),
                (("conversations",), "looks like chat data: add --task sft"),
                (("prompt", "completion"), "looks like prompt/completion data: add --task sft"),
                (("instruction", "output"), "looks like instruction data: add --task sft"))


def _texts(ds, text_column: str) -> list:
    if text_column not in ds.column_names:
        hint = next((h for cols, h in TASK_COLUMNS if set(cols) <= set(ds.column_names)), None)
        if hint is not None:
            raise DataError(f"column {text_column!r} not found (columns: {', '.join(ds.column_names)}): {hint}")
    _need_column(ds, text_column, "--text-column")
    return [t if isinstance(t, str) else "" for t in ds[text_column]]


def text_blocks(ds, config, tokenizer, seq_len: Optional[int], text_column: str = "text",
                packing: bool = False) -> dict:
    """Causal language modelling rows: the texts tokenized, concatenated (EOS between) and cut into blocks
    of ``seq_len`` (labels = inputs; the model shifts); with ``packing`` each text is a document packed into
    rows of ``seq_len`` (:func:`cuboid.data.packing.pack`)."""
    seq_len = min(seq_len or 128, config.n_positions)
    ids = tokenizer(_texts(ds, text_column), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    if packing:
        return _packed_documents(ids, eos, tokenizer.pad_token_id, seq_len)
    flat = [tok for seq in ids for tok in ([*seq, eos] if eos is not None else seq)]
    n_blocks = len(flat) // seq_len
    if n_blocks == 0:
        raise DataError(f"the text has {len(flat)} tokens: fewer than one block of seq_len {seq_len}")
    block = torch.tensor(flat[:n_blocks * seq_len]).view(n_blocks, seq_len)
    return {"input_ids": block, "labels": block.clone()}


def fixed_rows(ds, config, tokenizer, seq_len: Optional[int], text_column: str = "text",
               label_column: Optional[str] = None, num_labels: Optional[int] = None) -> dict:
    """Texts tokenized, padded/truncated to ``seq_len`` (with ``token_type_ids`` for models with segments);
    with ``label_column``, one class label per example, checked against the model's classes."""
    seq_len = min(seq_len or 128, config.n_positions)
    texts = _texts(ds, text_column)
    if getattr(tokenizer, "truncation_side", "right") == "right":  # a cut keeps the start: tokenize only that
        texts = [kept_text(tokenizer, t, seq_len) for t in texts]
    enc = tokenizer(texts, truncation=True, max_length=seq_len, padding="max_length",
                    return_tensors="pt")
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if "token_type_ids" in enc and hasattr(config, "type_vocab_size"):  # only models with segments take them
        out["token_type_ids"] = enc["token_type_ids"]
    if label_column is not None:
        _need_column(ds, label_column, "--label-column")
        labels = torch.tensor(ds[label_column])
        _check_labels(labels, num_labels or config.num_labels, label_column)
        out["labels"] = labels
    return out


def kept_text(tokenizer, text: str, n: int) -> str:
    """A prefix of ``text`` whose tokens (without special tokens) begin with the whole text's first ``n``: what a
    row cut to ``n`` tokens needs tokenized (:func:`cuboid.data.chat.head_text`; the text itself when short)."""
    return head_text(text, n, TextEncoder(tokenizer, special=False))


def sft_rows(ds, config, tokenizer, sft, packing: bool = False, stats=None) -> dict:
    """Instruction and chat records as rows with loss masks (:func:`cuboid.data.sft.sft_tensors`), the
    :class:`~cuboid.data.sft.SFTOptions` ``sft``'s max length cut to the model's positions."""
    from cuboid.data.sft import sft_tensors

    sft = dataclasses.replace(sft, max_length=min(sft.max_length, config.n_positions))
    return sft_tensors(ds, tokenizer, sft, packing=packing, stats=stats)


def pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0
    for tok_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tok_id is not None:
            return int(tok_id)
    return 0


def _packed_documents(ids: list, eos: Optional[int], pad_id: Optional[int], seq_len: int) -> dict:
    """Each non-empty text a document (its tokens, then EOS), packed into rows of ``seq_len``."""
    from cuboid.data.packing import pack

    docs = [[*seq, eos] if eos is not None else seq for seq in ids if seq]
    if not docs:
        raise DataError("the text column holds no text to pack")
    return pack(docs, seq_len, pad_id=pad_id if pad_id is not None else 0)


def model_inputs(batch: dict, routed: bool = False) -> dict:
    """What the model is given of a batch: a packed batch (one with ``position_ids``) without its
    ``attention_mask``: its padding is a document of its own, which the positions already keep apart,
    and a key mask beside document ids only adds work (rows of padding that see no key). ``routed``: the
    model routes tokens to experts, and keeps the mask: its load-balancing loss leaves the padding out."""
    if "position_ids" in batch and "attention_mask" in batch and not routed:
        return {k: v for k, v in batch.items() if k != "attention_mask"}
    return batch


def real_tokens(batch: dict) -> int:
    """The tokens of a batch that are not padding (its ``attention_mask``; every token when it has none)."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


def image_rows(ds, config, image_column: str = "image", label_column: str = "label",
               num_labels: Optional[int] = None) -> dict:
    """Images resized to the model's size and normalised (mean 0.5, std 0.5, as HF's ViT processor), one
    class label per example."""
    import numpy as np

    _need_column(ds, image_column, "--image-column")
    _need_column(ds, label_column, "--label-column")
    size, channels = config.image_size, config.channels
    mode = "L" if channels == 1 else "RGB"
    arrays = []
    for img in ds[image_column]:
        if not hasattr(img, "convert"):
            raise DataError(f"column {image_column!r} must hold images, got {type(img).__name__}")
        img = img.convert(mode).resize((size, size), resample=3)  # bicubic, as HF's ViT processor
        a = np.asarray(img, dtype=np.float32) / 255.0
        arrays.append(a[None] if channels == 1 else a.transpose(2, 0, 1))
    pixels = (torch.from_numpy(np.stack(arrays)) - 0.5) / 0.5  # (N, C, H, W)
    labels = torch.tensor(ds[label_column])
    _check_labels(labels, num_labels or config.num_labels, label_column)
    return {"pixel_values": pixels, "labels": labels}


def mask_tokens(batch: dict, tokenizer, generator: torch.Generator, prob: float = 0.15) -> dict:
    """BERT masking: ``prob`` of real tokens become targets; 80% [MASK], 10% random, 10% kept."""
    ids = batch["input_ids"].clone()
    special = torch.zeros_like(ids, dtype=torch.bool)
    for tok in tokenizer.all_special_ids:
        special |= ids == tok
    if "attention_mask" in batch:
        special |= batch["attention_mask"] == 0
    chosen = (torch.rand(ids.shape, generator=generator) < prob) & ~special
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    ids = torch.where(chosen & (roll < 0.8), torch.full_like(ids, tokenizer.mask_token_id), ids)
    random_ids = torch.randint(0, len(tokenizer), ids.shape, generator=generator)
    ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_ids, ids)
    return {**batch, "input_ids": ids, "labels": labels}


# ---------------------------------------------------------------- batching


@dataclass
class GlobalBatches:
    """Seeded global batches over prepared tensors; ``position`` counts batches drawn. Padded rows
    (an ``attention_mask``, no ``position_ids``) are cut to the batch's longest row, rounded up to
    ``width_multiple`` (the sequence splits of the plan need whole pieces)."""

    tensors: dict
    batch_size: int
    seed: int = 0
    position: int = 0
    width_multiple: int = 1

    def __post_init__(self) -> None:
        self.size = len(next(iter(self.tensors.values())))
        if self.size == 0:
            raise DataError("the dataset is empty")
        if self.batch_size > self.size:
            raise DataError(f"batch size {self.batch_size} is larger than the {self.size} training examples"
                            + (" (packed rows)" if "position_ids" in self.tensors else ""))
        self.per_epoch = self.size // self.batch_size  # the tail of each epoch is dropped

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))

    def indices(self, position: int) -> torch.Tensor:
        epoch, i = divmod(position, self.per_epoch)
        return self._order(epoch)[i * self.batch_size:(i + 1) * self.batch_size]

    def next(self) -> dict:
        idx = self.indices(self.position)
        self.position += 1
        return trim_padding({k: v[idx] for k, v in self.tensors.items()}, self.width_multiple)

    @property
    def epoch(self) -> float:
        return self.position / self.per_epoch


_PAD_FILL = {"labels": -100, "attention_mask": 0}


def trim_padding(batch: dict, multiple: int = 1) -> dict:
    """A batch of padded rows (or pairs of rows, (P, 2, L): :mod:`cuboid.data.pairs`) cut to its longest row,
    rounded up to ``multiple``: trailing columns of
    padding go, and where the rounding passes the rows' width, columns of padding are added (the batch's
    pad token, labels -100, mask 0). Packed batches (``position_ids``) and batches without an
    ``attention_mask`` are returned as they are."""
    mask = batch.get("attention_mask")
    if mask is None or "position_ids" in batch or mask.dim() < 2:
        return batch
    multiple, full = max(multiple, 1), mask.shape[-1]
    used = mask.reshape(-1, full).any(dim=0).nonzero()  # (rows, or pairs of rows (P, 2, L): the last dim)
    width = -(-(int(used[-1]) + 1 if len(used) else 1) // multiple) * multiple
    if width == full:
        return batch
    out = {}
    for k, v in batch.items():
        if v.dim() != mask.dim() or v.shape[-1] != full:
            out[k] = v
        elif width < full:
            out[k] = v[..., :width]
        else:
            pads = v[mask == 0]
            fill = _PAD_FILL.get(k, int(pads[0]) if k == "input_ids" and len(pads) else 0)
            out[k] = torch.cat([v, v.new_full((*v.shape[:-1], width - full), fill)], dim=-1)
    return out


class Filler(dict):
    """An eval batch run only so that every rank runs the same forwards (each may hold collectives: ZeRO-3's
    gathers, the experts' all-to-alls, the router statistics); its sums count with weight 0."""


def eval_batches(tensors: dict, batch_size: int, rank: int = 0, world: int = 1, width_multiple: int = 1):
    """Deterministic eval batches, this rank's strided share of the examples (padded rows cut as
    :class:`GlobalBatches` cuts them). Every rank yields as many batches as the rank with the most rows,
    a number taken from the global row count: a rank a batch short (or with no row: fewer rows than ranks)
    ends with a :class:`Filler` of one row that the evaluation runs and does not count."""
    if batch_size < 1:
        raise ValueError(f"eval batch size {batch_size}: give 1 or more rows")
    n = len(next(iter(tensors.values())))
    idx = torch.arange(rank, n, world)
    most = -(-n // world)  # rows of rank 0, the rank with the most
    for s in range(0, most, batch_size):
        part = idx[s:s + batch_size]
        if len(part):
            yield trim_padding({k: v[part] for k, v in tensors.items()}, width_multiple)
        else:
            row = rank % n
            yield Filler(trim_padding({k: v[row:row + 1] for k, v in tensors.items()}, width_multiple))


def load_tokenizer(path: Union[str, os.PathLike, None]):
    """A tokenizer from a local folder or tokenizer.json (no downloads); None if there is none."""
    if path is None:
        return None
    path = Path(path)
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError as e:
        raise DataError("text tasks need transformers for the tokenizer: pip install 'cuboid[text]'") from e

    if path.is_file() and path.name.endswith(".json"):
        tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    elif (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() or (path / "vocab.txt").is_file():
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        return None
    ordinary = set(tok.get_vocab().values()) - set(tok.all_special_ids)
    if len(ordinary) < 2:  # a tokenizer_config.json without its vocabulary files loads as its special tokens
        raise DataError(f"tokenizer {path}: {len(ordinary)} token(s) beside its special ones: its vocabulary "
                        "files (tokenizer.json, or vocab and merges files) are missing")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok
