"""Preference pairs: records with a prompt, a chosen and a rejected answer, made into tensors (TRL's layout).

Records
-------
Columns ``prompt``, ``chosen``, ``rejected``, each a string or a
conversation (a list of ``{"role", "content"}`` messages). Without a
``prompt`` column (or with a string prompt beside conversational answers)
the shared start of ``chosen`` and ``rejected`` is the prompt: the common
leading messages of two whole dialogues, or the common leading characters of
two strings (TRL 1.16's ``extract_prompt``). Tokenized as TRL 1.16's
``DPOTrainer`` does:

- plain text: the tokenizer's EOS is appended to an answer that does not end
  with it; ``prompt`` and ``prompt + answer`` are tokenized as text;
- conversations: rendered with the chat template (the tokenizer's, or
  ``chat_template``): the prompt with the generation prompt, and
  ``prompt + answer`` as one conversation;
- the answer starts where the tokenized prompt and the tokenized prompt +
  answer first differ (for either answer), so both rows share the prompt
  tokens exactly;
- ``max_length`` cuts each of the two sequences to its first ``max_length``
  tokens (``keep_start``), and a pair whose prompt alone fills ``max_length``
  is dropped (nothing of its answers would be left to learn). Only those
  tokens are made: a long record is tokenized as far as they reach
  (:func:`cuboid.data.chat.head_text`), with the whole record's tokens.

Tensors: a pair dimension
-------------------------
:func:`pair_rows` returns, for P pairs, tensors of shape (P, 2, L) (and
(P, 2) per-sequence values), L the longest sequence of the split:

- ``input_ids`` (P, 2, L) long: ``[:, 0]`` prompt + chosen, ``[:, 1]``
  prompt + rejected, right-padded with the pad id;
- ``attention_mask`` (P, 2, L) long: 1 on real tokens;
- ``labels`` (P, 2, L) long: the answer's tokens, -100 on the prompt and the
  padding (TRL's ``completion_mask`` is ``labels != -100``), so the model's
  per-token log-probabilities (``logprobs=True``: of ``labels[..., 1:]``,
  0 where -100) sum to each answer's log-probability.

Drawing batches along dim 0 keeps every pair whole. A step's batch is the
pairs made rows by :func:`flatten`: (P, 2, ...) -> (2P, ...) with the pairs
**interleaved**, row ``2i`` the chosen and row ``2i + 1`` the rejected
sequence of pair ``i`` (values of shape (P, 2), such as ``ref_logps``,
become (2P,) the same way). Every split of a step (the dp shares, the
micro-batches, the pipeline's micro-batches) cuts rows into equal
contiguous parts, so a pair stays in one part whenever each part has an
even number of rows; the preference tasks refuse a part with an odd one
(:func:`pairs_of_rows`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from cuboid.data.chat import (DataError, TextEncoder, check_turns, common_prefix, head_ids, render,
                              require_template, template_failure)

__all__ = ["PairStats", "extract_prompt", "is_conversation", "tokenize_pair", "pair_sequences", "pair_rows",
           "pair_dataset", "prepared_pairs", "whole_pairs", "pair_tensors", "flatten", "pairs_of_rows", "PAIR_COLUMNS"]

PAIR_COLUMNS = ("prompt", "chosen", "rejected")


@dataclass
class PairStats:
    examples: int = 0
    dropped: int = 0     # the prompt alone fills max_length
    truncated: int = 0   # a sequence of the pair was cut to max_length


def is_conversation(value) -> bool:
    """Whether ``value`` is a list of chat messages (dicts with a role)."""
    return isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], dict) \
        and "role" in value[0]


def extract_prompt(chosen, rejected) -> tuple:
    """(prompt, chosen, rejected): the shared start of two whole answers taken as the prompt (messages of
    two conversations, characters of two strings; a space before the first difference stays with the
    answers), as TRL 1.16's ``extract_prompt``."""
    n = min(len(chosen), len(rejected))
    idx = max(n - 1, 0)  # (no difference within the shorter: TRL's loop ends on its last index)
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if chosen[i - 1] == " " else i  # (i = 0 reads the last item, as TRL's does)
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _record(example: dict) -> tuple:
    """(prompt, chosen, rejected) of a record, the prompt extracted where the record has none that fits."""
    for key in ("chosen", "rejected"):
        if key not in example:
            raise DataError(f"a preference record needs chosen and rejected columns (and a prompt), got "
                            f"{', '.join(example)}")
    missing = [k for k in ("chosen", "rejected") if example[k] is None]
    if missing:
        raise DataError(f"the record has no {' and no '.join(missing)}: a preference record has a chosen and a "
                        "rejected answer (and a prompt), strings or message lists")
    chosen, rejected = example["chosen"], example["rejected"]
    prompt = example.get("prompt")
    if prompt is None or is_conversation(prompt) != is_conversation(chosen):
        return extract_prompt(chosen, rejected)
    return prompt, chosen, rejected


def tokenize_pair(example: dict, tokenizer, chat_template: Optional[str] = None,
                  max_length: Optional[int] = None) -> tuple:
    """(prompt ids, chosen ids, rejected ids) of one record (module docstring): the answers' ids start
    where the prompt's and the whole sequence's first differ. With ``max_length``, each of the prompt, the
    prompt + chosen and the prompt + rejected is tokenized only as far as its first ``max_length`` + 1 tokens
    (what a cut keeps, and one to tell a cut sequence): the ids are the whole record's, up to there."""
    prompt, chosen, rejected = _record(example)
    n = None if max_length is None else max_length + 1
    if is_conversation(chosen):
        template = require_template(tokenizer, chat_template)
        tools = example.get("tools")

        for what, value in (("the prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, (list, tuple)):
                raise DataError(f"{what} is a {type(value).__name__} beside message lists: prompt, chosen and "
                                "rejected must be all strings or all conversations (message lists)")
            check_turns(value, what)

        def ids(messages, **kw):
            try:
                text = render(tokenizer, messages, template, tools, **kw)
            except Exception as e:  # noqa: BLE001 - the template's own errors are one line (template_failure)
                raise template_failure(e, messages) from None
            return head_ids(text, n, TextEncoder(tokenizer, special=False))

        p = ids(prompt, add_generation_prompt=True)
        pc, pr = ids(list(prompt) + list(chosen)), ids(list(prompt) + list(rejected))
    else:
        if not all(isinstance(v, str) for v in (prompt, chosen, rejected)):
            raise DataError("prompt, chosen and rejected must be all strings or all conversations (message lists)")
        eos = tokenizer.eos_token
        if eos is None:
            raise DataError("plain-text preference pairs get the tokenizer's EOS appended: this tokenizer has none")
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        encode = TextEncoder(tokenizer)
        p, pc, pr = (head_ids(text, n, encode) for text in (prompt, prompt + chosen, prompt + rejected))
    shared = min(common_prefix(p, pc), common_prefix(p, pr))
    return p[:shared], pc[shared:], pr[shared:]


def located_pair(ds, i: int, example: dict, tokenizer, chat_template, max_length, source) -> tuple:
    """:func:`tokenize_pair` of record ``i`` of ``ds``, its DataError prefixed with where the record is."""
    try:
        return tokenize_pair(example, tokenizer, chat_template, max_length)
    except DataError as e:
        raise DataError(f"{record_where(ds, i, source)}: {e}") from None


def record_where(ds, i: int, source=None) -> str:
    """Where record ``i`` of ``ds`` (a split of ``source``'s) is, as an editor shows it: ``data FILE, line N``
    (1-based) for a JSON-lines file (the first line that holds that record), ``data FILE, row N`` for another
    file, else ``record N`` of the split. Run on an error only: it reads the file."""
    import json
    import os

    path = Path(source) if isinstance(source, (str, os.PathLike)) and os.path.isfile(source) else None
    indices = getattr(ds, "_indices", None)  # a shuffled split's rows point into the source's
    row = int(indices.column(0)[i].as_py()) if indices is not None else i
    if path is not None and path.suffix.lower() == ".jsonl":
        want = _without_nulls(ds[i])
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    if line.strip() and _without_nulls(json.loads(line)) == want:
                        return f"data {path}, line {number}"
                except ValueError:
                    continue
    if path is not None and indices is not None:
        return f"data {path}, line {row + 2}" if path.suffix.lower() == ".csv" else f"data {path}, row {row + 1}"
    return f"data {path}, record {i + 1} of its split" if path is not None else f"record {row + 1}"


def _without_nulls(value):
    """``value`` without the None entries of its dicts: a record as its file wrote it (a dataset gives every
    record the keys any record has, None where it had none)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def pair_sequences(ds, tokenizer, max_length: Optional[int] = None, chat_template: Optional[str] = None,
                   stats: Optional[PairStats] = None, source=None) -> list:
    """Per kept pair, ``((chosen ids, answer start), (rejected ids, answer start))`` (module docstring);
    ``stats`` counts the examples, the dropped and the truncated ones. A bad record is a one-line DataError
    that names it (:func:`record_where`: ``source``'s file and line)."""
    stats = stats if stats is not None else PairStats()
    seqs = []
    for i, example in enumerate(ds):
        stats.examples += 1
        p, c, r = located_pair(ds, i, example, tokenizer, chat_template, max_length, source)
        if max_length is not None and len(p) >= max_length:
            stats.dropped += 1
            continue
        pair = []
        for answer in (c, r):
            ids = p + answer
            if max_length is not None and len(ids) > max_length:
                ids = ids[:max_length]
                stats.truncated += 1
            pair.append((ids, len(p)))
        seqs.append(pair)
    if not seqs:
        raise DataError(f"no preference pair is left ({stats.dropped} of {stats.examples} dropped: the prompt "
                        "alone fills --max-length)")
    return seqs


def whole_pairs(ds, tokenizer, max_length: int, chat_template: Optional[str] = None, source=None) -> tuple:
    """(pairs, keep): per record whose two sequences both fit in ``max_length`` tokens whole, its
    ``((chosen ids, answer start), (rejected ids, answer start))``; ``keep`` a bool per record (False: the
    pair is longer, dropped as TRL's RewardTrainer drops it). Each sequence is tokenized only as far as its
    first ``max_length`` + 1 tokens (:func:`tokenize_pair`), so a long record costs no more than a kept one."""
    seqs, keep = [], []
    for i, example in enumerate(ds):
        p, c, r = located_pair(ds, i, example, tokenizer, chat_template, max_length, source)
        keep.append(len(p) + max(len(c), len(r)) <= max_length)
        if keep[-1]:
            seqs.append([(p + c, len(p)), (p + r, len(p))])
    return seqs, keep


def pair_rows(ds, tokenizer, max_length: Optional[int] = None, chat_template: Optional[str] = None,
              pad_id: int = 0, stats: Optional[PairStats] = None, source=None) -> dict:
    """The pairs of a split (rows with prompt/chosen/rejected) as tensors with a pair dimension (module
    docstring): ``input_ids``, ``attention_mask``, ``labels`` (P, 2, L). ``stats`` (a :class:`PairStats`)
    counts the examples, the dropped and the truncated ones."""
    return pair_tensors(pair_sequences(ds, tokenizer, max_length, chat_template, stats, source), pad_id)


def pair_dataset(ds, tokenizer, max_length: Optional[int] = None, chat_template: Optional[str] = None,
                 stats: Optional[PairStats] = None):
    """The pairs as a ``datasets.Dataset`` of rows (``cuboid prepare``'s folder): ``input_ids``,
    ``attention_mask``, ``labels`` lists, unpadded, chosen and rejected interleaved (row 2i, 2i + 1: pair i);
    :func:`prepared_pairs` reads them back."""
    import datasets

    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for pair in pair_sequences(ds, tokenizer, max_length, chat_template, stats):
        for ids, start in pair:
            rows["input_ids"].append(list(ids))
            rows["attention_mask"].append([1] * len(ids))
            rows["labels"].append([-100] * start + list(ids[start:]))
    return datasets.Dataset.from_dict(rows)


def prepared_pairs(ds, pad_id: int = 0, max_length: Optional[int] = None) -> dict:
    """A prepared split of interleaved rows (:func:`pair_dataset`) as (P, 2, L) tensors (rows cut to
    ``max_length``); a one-line DataError for an odd number of rows or rows without labels."""
    for key in ("input_ids", "labels"):
        if key not in ds.column_names:
            raise DataError(f"prepared preference rows need input_ids and labels columns, got "
                            f"{', '.join(ds.column_names)}")
    if len(ds) % 2:
        raise DataError(f"prepared preference rows come in pairs (chosen, rejected), got {len(ds)} rows")
    seqs, ids, labels = [], ds["input_ids"], ds["labels"]
    for i in range(0, len(ds), 2):
        pair = []
        for j in (i, i + 1):
            row, lab = list(ids[j])[:max_length], list(labels[j])[:max_length]
            start = next((k for k, x in enumerate(lab) if x != -100), len(lab))
            pair.append((row, start))
        seqs.append(pair)
    return pair_tensors(seqs, pad_id)


def pair_tensors(seqs: list, pad_id: int) -> dict:
    """(P, 2, L) ``input_ids``, ``attention_mask``, ``labels`` of :func:`pair_sequences`' pairs."""
    width = max(len(ids) for pair in seqs for ids, _ in pair)
    P = len(seqs)
    input_ids = torch.full((P, 2, width), pad_id, dtype=torch.long)
    mask = torch.zeros((P, 2, width), dtype=torch.long)
    labels = torch.full((P, 2, width), -100, dtype=torch.long)
    for i, pair in enumerate(seqs):
        for j, (ids, start) in enumerate(pair):
            t = torch.tensor(ids, dtype=torch.long)
            input_ids[i, j, :len(ids)] = t
            mask[i, j, :len(ids)] = 1
            labels[i, j, start:len(ids)] = t[start:]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def flatten(batch: dict) -> dict:
    """Pairs made rows: every tensor of shape (P, 2, ...) as (2P, ...), chosen and rejected interleaved (row
    2i: pair i's chosen, 2i + 1: its rejected); a batch already in rows is returned as it is (decided by
    ``input_ids`` having a pair dimension, (P, 2, L))."""
    ids = batch.get("input_ids")
    if ids is None or ids.dim() != 3:
        return batch
    P = ids.shape[0]
    return {k: v.reshape(2 * P, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 2
            and v.shape[:2] == (P, 2) else v for k, v in batch.items()}


def pairs_of_rows(rows: int, what: str = "a preference batch") -> int:
    """The pairs in ``rows`` interleaved rows; a one-sentence ValueError when they are odd (a split cut a pair)."""
    if rows % 2:
        raise ValueError(f"{what} has {rows} rows: pairs are two interleaved rows (chosen, rejected), so every "
                         "dp share and micro-batch must hold an even number of rows; choose a batch size that "
                         "splits into whole pairs")
    return rows // 2
