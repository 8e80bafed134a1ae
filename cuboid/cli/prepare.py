"""``cuboid prepare``: tokenize (and pack) a dataset as ``cuboid finetune`` would, write it, and say what it holds.

    cuboid prepare --model FOLDER --data chat.jsonl --output prepared/ [--packing] [--max-length 1024]
    cuboid finetune --model FOLDER --data prepared/ --task sft [--packing] ...

The rows are made by the code ``cuboid finetune`` runs (:mod:`cuboid.data.sft` for
``--task sft``, the task's rows (:mod:`cuboid.tasks`) for ``--task clm``, and the packer
of :mod:`cuboid.data.packing`), split into train and validation as finetune splits
(the data's own validation split, or a seeded ``--eval-fraction``), and
written with ``save_to_disk``: a folder that ``cuboid finetune --data`` reads
as it is (columns ``input_ids`` and ``labels``; packed rows also
``position_ids`` and ``attention_mask``), with ``prepare_report.json``. The
folder appears whole or not at all (written beside it, then renamed); an
existing one is replaced only with ``--overwrite``, and only when cuboid prepare
wrote it (its report beside the splits and nothing else) and it holds neither
the current directory nor the data, model or tokenizer.

The report gives, per split, the examples read, those dropped (nothing left
to learn after truncation) and truncated, the rows, the tokens, the trained
tokens (the labels the shifted loss predicts) and the padding fraction: of
the rows as finetune batches them (training: ``--batch-size`` rows in
finetune's seeded order, each batch cut to its longest row rounded up to a
multiple of 8; validation: padded to its longest row), or of the packed rows. Then two training rows are printed with their trained
tokens inside ``[[ ]]`` (in colour on a terminal), so the masks can be
checked before any GPU time is spent.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from cuboid import tasks
from cuboid.data.formats import DataError

WIDTH_MULTIPLE = 8        # finetune's batch width multiple on one device, dp, and tp or sp up to 4
REPORT = "prepare_report.json"
MARK = ("[[", "]]")
COLOUR = ("\033[1;32m", "\033[0m", "\033[2m")  # trained, reset, untrained


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prepare`` on an ``add_subparsers()`` object; the handler is ``args.func``."""
    p = subparsers.add_parser("prepare", help="tokenize (and pack) a dataset as finetune would, write it, report "
                                              "tokens, trained tokens and padding, and show the trained tokens",
                              description=__doc__.split("\n\n")[0], epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local model folder: its tokenizer, chat template and positions")
    p.add_argument("--tokenizer", help="a tokenizer folder or tokenizer.json (default: the model folder's)")
    p.add_argument("--data", required=True, help="a jsonl/json/csv/parquet/txt file or a datasets folder")
    p.add_argument("--output", "--output-dir", dest="output", required=True,
                   help="the folder to write (cuboid finetune --data reads it)")
    p.add_argument("--task", default=tasks.SFT.name, help=f"{' | '.join(preparable())} (default {tasks.SFT.name}), "
                   "with options as finetune's --task")
    p.add_argument("--max-length", "--seq-len", dest="max_length", type=int,
                   help="tokens per example, or per packed row (default: sft 1024, clm 128; at most the model's)")
    p.add_argument("--packing", action="store_true", help="pack the examples into rows of --max-length")
    p.add_argument("--train-on-prompt", action="store_true", help="sft: train on every token, not only the answers")
    p.add_argument("--template", help="sft: the prompt template of instruction data (alpaca)")
    p.add_argument("--data-format", help="sft: messages | prompt_completion | alpaca | text (default: from columns)")
    p.add_argument("--chat-template", help="sft: a Jinja chat template file used instead of the tokenizer's")
    p.add_argument("--text-column", help="the messages, prompt or text column, when not named as usual")
    p.add_argument("--eval-fraction", type=float, default=0.1,
                   help="held-out fraction when the data has no validation split (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="the seed of the held-out split and batch order (default 0)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="the global batch the padding fraction is counted for (default 32, finetune's)")
    p.add_argument("--show", type=int, default=2, help="training rows to print with the trained tokens marked")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output folder")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from cuboid.data.formats import load_source, train_eval_split

    output = Path(args.output)
    if output.exists() and not args.overwrite:
        raise ValueError(f"--output {output} exists: choose another folder or pass --overwrite to replace it")
    check_replaceable(output, {"--data": args.data, "--model": args.model, "--tokenizer": args.tokenizer})
    from cuboid.train.config import TASK_FLAGS, with_flags

    task = with_flags(args.task, {k: getattr(args, k) for k in TASK_FLAGS})
    if not hasattr(task, "dataset_rows"):
        raise ValueError(f"cuboid prepare writes rows for {', '.join(preparable())}, not for task {task.label}")
    tokenizer, positions = _tokenizer_and_positions(args)
    max_length = task.row_length({"seq_len": args.max_length, "config": SimpleNamespace(n_positions=positions or math.inf)})
    splits = train_eval_split(load_source(args.data), args.eval_fraction, args.seed)
    if splits[1] is None:
        raise ValueError(f"--eval-fraction 0: cuboid prepare writes a validation split beside the training one, and "
                         f"{args.data} has none of its own; give a fraction above 0")
    prepared, stats = {}, {}
    for name, ds in zip(("train", "validation"), splits):
        prepared[name], stats[name] = prepare_split(ds, task, args, tokenizer, max_length, training=name == "train")
    report = {"data": str(args.data), "tokenizer": str(args.tokenizer or args.model), "task": task.name,
              "max_length": max_length, "packing": args.packing, "train_on_prompt": args.train_on_prompt,
              "template": args.template, "data_format": stats["train"].pop("format", None),
              "batch_size": args.batch_size, "seed": args.seed, "splits": stats}
    stats["validation"].pop("format", None)
    write(prepared, report, output, args.overwrite)
    print(format_report(report, output))
    print()
    print(show_rows(prepared["train"], tokenizer, args.show, colour=sys.stdout.isatty() and "NO_COLOR" not in
                    os.environ))
    return 0


def preparable() -> list:
    """The registered tasks that have a tokenization path of their own (``dataset_rows``), by name and alias."""
    out = []
    for name in tasks.names():
        cls = tasks.get(name)
        if hasattr(cls, "dataset_rows"):
            out.append(name if not getattr(cls, "aliases", ()) else f"{name} (or {', '.join(cls.aliases)})")
    return out


def _tokenizer_and_positions(args: argparse.Namespace):
    """(tokenizer, the model's positions or None) of ``--model`` / ``--tokenizer``."""
    from cuboid.data.formats import load_tokenizer

    if args.model is None and args.tokenizer is None:
        raise ValueError("give --model FOLDER (its tokenizer and chat template) or --tokenizer PATH")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: not a folder; give a local model folder, or --tokenizer PATH")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if tokenizer is None:
        raise ValueError(f"no tokenizer in {args.tokenizer or args.model}: give a folder with tokenizer.json "
                         "or --tokenizer PATH")
    return tokenizer, model_positions(args.model)


def model_positions(folder: Optional[str]) -> Optional[int]:
    """The positions a model folder's ``config.json`` allows (``max_position_embeddings`` or ``n_positions``)."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings", config.get("n_positions"))
    return int(value) if value else None


# ---------------------------------------------------------------- rows


def prepare_split(ds, task, args: argparse.Namespace, tokenizer, max_length: int, training: bool = True):
    """(the split's rows as a ``datasets.Dataset``, its numbers for the report; the padding of a training
    split as finetune's training batches cut it, of another as evaluation pads it: to the longest row)."""
    rows, counts = task.dataset_rows(ds, tokenizer, max_length, text_column=args.text_column, packing=args.packing)
    batch_size = args.batch_size if training else None
    return rows, {**counts, **row_counts(rows, batch_size, args.seed)}


def row_counts(rows, batch_size: Optional[int], seed: int) -> dict:
    """Rows, tokens (not padding), trained tokens (labels the shifted loss predicts: a row's first label never
    is) and the padding fraction of a split's rows: packed rows' own, else that of training batches of
    ``batch_size`` (:func:`padding_fraction`), or with no ``batch_size`` of rows padded to the longest."""
    import numpy as np
    import pyarrow.compute as pc

    table = rows.with_format("arrow")[:]
    labels = table.column("labels")
    trained = int(pc.sum(pc.not_equal(pc.list_flatten(labels), -100)).as_py() or 0)
    trained -= int(pc.sum(pc.not_equal(pc.list_element(labels, 0), -100)).as_py() or 0)
    if "attention_mask" in table.column_names:
        lengths = np.asarray(pc.list_value_length(table.column("attention_mask")), dtype=np.int64)
        tokens = int(pc.sum(pc.list_flatten(table.column("attention_mask"))).as_py() or 0)
        cells = int(lengths.sum())
        padding = 1.0 - tokens / cells if cells else 0.0
    else:
        lengths = np.asarray(pc.list_value_length(table.column("input_ids")), dtype=np.int64)
        tokens = int(lengths.sum())
        padding = padding_fraction(lengths, batch_size, seed) if batch_size else \
            1.0 - tokens / (len(lengths) * int(lengths.max()))
    return {"rows": len(rows), "tokens": tokens, "trained_tokens": trained, "padding_fraction": padding}


def padding_fraction(lengths, batch_size: int, seed: int, width_multiple: int = WIDTH_MULTIPLE) -> float:
    """The padding of rows of ``lengths`` tokens over one epoch of finetune's batches: ``batch_size`` rows drawn
    in :class:`cuboid.data.formats.GlobalBatches`' seeded order, each batch as wide as its longest row rounded up to
    ``width_multiple`` (:func:`cuboid.data.formats.trim_padding`). A split smaller than a batch is one batch."""
    import numpy as np
    import torch

    from cuboid.data.formats import GlobalBatches

    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    batches = GlobalBatches({"length": torch.from_numpy(lengths)}, min(batch_size, lengths.size), seed)
    real = cells = 0
    for position in range(batches.per_epoch):
        part = lengths[batches.indices(position).numpy()]
        width = -(-int(part.max()) // width_multiple) * width_multiple
        real, cells = real + int(part.sum()), cells + width * part.size
    return 1.0 - real / cells


# ---------------------------------------------------------------- writing


def foreign_entry(folder: Path) -> Optional[str]:
    """The first entry of ``folder`` that ``cuboid prepare`` did not write, or None. A prepared folder holds
    its report, ``dataset_dict.json`` and the split folders that file names; a folder without the report
    was not written by cuboid, and its first entry is returned."""
    entries = sorted(folder.iterdir())
    if not (folder / REPORT).is_file():
        return entries[0].name + ("/" if entries[0].is_dir() else "") if entries else None
    try:
        splits = set(json.loads((folder / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError):
        splits = set()
    for entry in entries:
        ours = entry.name in (REPORT, "dataset_dict.json") and entry.is_file()
        if not ours and not (entry.name in splits and entry.is_dir() and not entry.is_symlink()):
            return entry.name + ("/" if entry.is_dir() else "")
    return None


def check_replaceable(output: Path, inputs: dict) -> None:
    """A one-line ValueError unless ``output`` is absent, empty, or a folder ``cuboid prepare`` wrote that holds
    none of ``inputs`` (flag -> path: the data, model and tokenizer) and not the current directory."""
    if not output.exists() and not output.is_symlink():
        return
    if not output.is_dir():
        raise ValueError(f"--output {output} exists and is not a folder: choose another path")
    where = output.resolve()
    for what, path in [("the current directory", os.getcwd()),
                       *((f"{flag} {p}", p) for flag, p in inputs.items() if isinstance(p, (str, os.PathLike)))]:
        inside = Path(path).resolve()
        if inside == where or where in inside.parents:
            raise ValueError(f"refusing to replace --output {output}: it holds {what}; choose another folder")
    other = foreign_entry(output)
    if other is not None:
        raise ValueError(f"refusing to replace --output {output}: cuboid prepare did not write it ({other} is not "
                         f"part of a prepared folder with its {REPORT}); move it out or choose another folder")


def write(prepared: dict, report: dict, output: Path, overwrite: bool) -> None:
    """``prepared`` (split -> Dataset) saved as a DatasetDict folder with ``prepare_report.json``, written in a
    temporary folder beside ``output`` and renamed into place, so ``output`` is whole or absent."""
    import datasets

    output = output.resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    old = None
    try:
        datasets.DatasetDict(prepared).save_to_disk(str(tmp / "data"))
        (tmp / "data" / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if output.exists():
            if not overwrite:
                raise ValueError(f"--output {output} exists: choose another folder or pass --overwrite to replace it")
            check_replaceable(output, {})
            old = tmp / "old"
            os.replace(output, old)
        os.replace(tmp / "data", output)
    except BaseException:
        if old is not None and not output.exists():
            os.replace(old, output)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the report


def format_report(report: dict, output: Path) -> str:
    """The printed report: the settings, one table row per split, and what the padding is of."""
    from cuboid.cli.tables import table

    def n(v):
        return "-" if v is None else f"{v:,}"

    head = (f"cuboid prepare: {report['data']} -> {output} (task {report['task']}"
            + (f", format {report['data_format']}" if report["data_format"] else "")
            + f", max length {report['max_length']}"
            + (", packed" if report["packing"] else "") + (", trained on prompts" if report["train_on_prompt"] else "")
            + ")")
    rows = [(name, n(s["examples"]), n(s["dropped"]), n(s["truncated"]), n(s["rows"]), n(s["tokens"]),
             n(s["trained_tokens"]), f"{100 * s['trained_tokens'] / max(s['tokens'], 1):.1f}%",
             f"{100 * s['padding_fraction']:.1f}%", n(s.get("no_answer"))) for name, s in report["splits"].items()]
    text = table(rows, ("split", "examples", "dropped", "truncated", "rows", "tokens", "trained", "trained %",
                        "padding", "no answer"))
    how = ("of the packed rows" if report["packing"] else
           f"of the rows as finetune batches them (train: {report['batch_size']} a batch, each cut to its "
           f"longest row rounded up to {WIDTH_MULTIPLE}; validation: padded to its longest row)")
    return (f"{head}\n\n{text}\n\ndropped: nothing left to train after truncation; no answer: nothing to train "
            f"before it (no assistant turn, an empty completion), dropped too; padding: {how}")


def show_rows(rows, tokenizer, count: int, colour: bool = False) -> str:
    """The first ``count`` rows decoded, trained tokens inside ``[[ ]]`` (or green, the rest dim, with
    ``colour``); a packed row's documents each on a line of their own."""
    out = []
    for i in range(min(count, len(rows))):
        row = rows[i]
        ids, labels = row["input_ids"], [-100, *row["labels"][1:]]  # a row's first label is never predicted
        n = sum(row["attention_mask"]) if "attention_mask" in row else len(ids)
        starts = [j for j in range(n) if row["position_ids"][j] == 0] if "position_ids" in row else [0]
        trained = sum(1 for x in labels[:n] if x != -100)
        docs = f", {len(starts)} documents" if len(starts) > 1 else ""
        key = "trained tokens in green" if colour else "trained tokens inside [[ ]]"
        out.append(f"train row {i}: {n} tokens, {trained} trained{docs} ({key}):")
        for d, (a, b) in enumerate(zip(starts, starts[1:] + [n])):
            if len(starts) > 1:
                out.append(f"--- document {d + 1}")
            out.append(marked(ids[a:b], labels[a:b], tokenizer, colour))
        out.append("")
    return "\n".join(out).rstrip("\n")


def marked(ids, labels, tokenizer, colour: bool = False) -> str:
    """Tokens decoded run by run: runs whose labels are not -100 inside ``[[ ]]`` (or coloured)."""
    parts, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or (labels[j] != -100) != (labels[start] != -100):
            text = tokenizer.decode(ids[start:j], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            if labels[start] != -100:
                parts.append(f"{COLOUR[0]}{text}{COLOUR[1]}" if colour else f"{MARK[0]}{text}{MARK[1]}")
            else:
                parts.append(f"{COLOUR[2]}{text}{COLOUR[1]}" if colour else text)
            start = j
    return "".join(parts)
