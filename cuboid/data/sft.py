"""Supervised fine-tuning data: instruction and chat records in, token ids and loss masks out.

Formats (:data:`FORMATS`; :func:`detect_format` picks one from the columns unless told):

- ``messages``: a list of ``{"role", "content"}`` turns rendered with the chat template
  (:mod:`cuboid.data.chat`); the loss is on the assistant's turns (their content and end-of-turn text).
  ShareGPT's ``conversations`` of ``{"from", "value"}`` turns are read as messages (keys renamed as
  TRL's ``maybe_convert_to_chatml`` does; roles ``human``/``gpt`` read as ``user``/``assistant``).
  A ``tools`` column is passed to the template.
- ``prompt_completion``: ``prompt`` and ``completion``, as TRL reads them. Strings: the eos is appended
  to the completion when it lacks one, both ``prompt`` and ``prompt + completion`` are tokenized as plain
  text, and the completion is what follows their common token prefix. Message lists: the prompt is
  rendered with the generation prompt, the whole with the completion's turns. The loss is on the
  completion.
- ``alpaca``: ``instruction``, ``input`` (may be empty or absent) and ``output`` through a named prompt
  template (:data:`TEMPLATES`; ``alpaca``: Stanford Alpaca's texts with and without input); read as a
  prompt/completion pair of strings, so the response and the eos are trained.
- ``text``: plain language modelling: the text and an eos, every token trained.

``train_on_prompt`` trains every token instead. Rows longer than ``max_length`` keep their start
(TRL's ``keep_start``); a row left with nothing to learn (no trained label after its first token: the
model shifts, so the first label is never a target) is dropped. :class:`SFTStats` counts both. Only the
kept tokens are made: a long row's texts are tokenized as far as they reach (:func:`cuboid.data.chat.head_text`),
with the same tokens and labels as the whole row's cut.

Labels are unshifted (-100 where nothing is learned); the model shifts them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cuboid.data.chat import DataError, TextEncoder, common_prefix, head_ids, head_ids_batch

__all__ = ["FORMATS", "TEMPLATES", "SFTOptions", "SFTStats", "detect_format", "format_columns",
           "tokenize_example", "tokenize_dataset", "resolve_options", "alpaca_prompt", "sft_tensors",
           "prepared_tensors", "padded_tensors"]

FORMATS = ("messages", "prompt_completion", "alpaca", "text")

# Stanford Alpaca's prompts (train.py's PROMPT_DICT): with an input, and without one.
_ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
_ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:")
TEMPLATES = {"alpaca": (_ALPACA_INPUT, _ALPACA_NO_INPUT)}

FORMAT_HELP = ("messages (a 'messages' list of role/content turns), prompt_completion ('prompt' and "
               "'completion'), alpaca ('instruction', 'input', 'output'), text ('text')")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


@dataclass
class SFTOptions:
    """How records become training rows (module docstring)."""

    format: Optional[str] = None         # messages | prompt_completion | alpaca | text; None: from the columns
    template: Optional[str] = None       # a named prompt template for instruction data (TEMPLATES)
    train_on_prompt: bool = False        # train every token, not only the answers
    max_length: int = 1024               # tokens kept per row (the start)
    text_column: Optional[str] = None    # the messages / prompt / text column, when not the format's own name
    chat_template: Optional[str] = None  # a Jinja file or template text instead of the tokenizer's


@dataclass
class SFTStats:
    """Counts over tokenized records: ``examples`` read, ``dropped`` (nothing left to learn after truncation),
    ``no_answer`` (nothing to learn before it: no assistant turn, an empty completion; dropped too, counted
    apart), ``truncated`` (kept rows cut to max_length), and the kept rows' ``tokens`` and ``trained_tokens``
    (labels that are loss targets: not -100 and not a row's first)."""

    examples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    dropped: int = 0
    truncated: int = 0
    no_answer: int = 0

    @property
    def kept(self) -> int:
        return self.examples - self.dropped - self.no_answer

    def merge(self, other: "SFTStats") -> "SFTStats":
        """Adds ``other``'s counts to these (in place) and returns self."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- formats


def _is_list_feature(feature) -> bool:
    import datasets

    return isinstance(feature, (list, datasets.Sequence)) or type(feature).__name__ in ("List", "LargeList")


def _check_template(opts: SFTOptions, fmt: str) -> None:
    if opts.template is not None and opts.template not in TEMPLATES:
        raise DataError(f"unknown template {opts.template!r}; templates: {', '.join(TEMPLATES)}")
    if opts.template is not None and fmt != "alpaca":
        raise DataError(f"template {opts.template!r} is for instruction data (instruction/input/output "
                        f"columns), not the {fmt} format")


def detect_format(column_names: Sequence[str], opts: SFTOptions, features=None) -> str:
    """The data format of a dataset with these columns (``opts.format`` when set, checked); a one-line
    :class:`DataError` listing the accepted formats when none fits. ``features`` (the dataset's) tells a
    ``text_column`` of messages from one of text."""
    cols = set(column_names)
    if opts.format is not None:
        if opts.format not in FORMATS:
            raise DataError(f"unknown data format {opts.format!r}; formats: {FORMAT_HELP}")
        fmt = opts.format
    elif opts.template is not None:
        fmt = "alpaca"
    elif opts.text_column is not None and opts.text_column in cols:
        is_list = features is not None and _is_list_feature(features.get(opts.text_column))
        fmt = "prompt_completion" if "completion" in cols else "messages" if is_list else "text"
    elif "messages" in cols or "conversations" in cols:
        fmt = "messages"
    elif {"prompt", "completion"} <= cols:
        fmt = "prompt_completion"
    elif {"instruction", "output"} <= cols:
        fmt = "alpaca"
    elif "text" in cols:
        fmt = "text"
    else:
        raise DataError(f"no SFT data format fits the columns ({', '.join(column_names)}); formats: "
                        f"{FORMAT_HELP}; set --data-format and --text-column")
    _check_template(opts, fmt)
    missing = [c for c in format_columns(fmt, opts, cols) if c not in cols]
    if missing:
        raise DataError(f"the {fmt} format needs column(s) {', '.join(map(repr, missing))} (columns: "
                        f"{', '.join(column_names)}); set --text-column or --data-format")
    return fmt


def format_columns(fmt: str, opts: SFTOptions, cols: Optional[set] = None) -> list:
    """The columns a format reads (``input`` of alpaca is optional and not listed)."""
    if fmt == "messages":
        default = "conversations" if cols is not None and "messages" not in cols and "conversations" in cols \
            else "messages"
        return [opts.text_column or default]
    if fmt == "prompt_completion":
        return [opts.text_column or "prompt", "completion"]
    if fmt == "alpaca":
        return ["instruction", "output"]
    return [opts.text_column or "text"]


def alpaca_prompt(instruction: str, input: Optional[str] = None, template: str = "alpaca") -> str:
    """The prompt text of an instruction (and its input, when not empty) in a named template."""
    with_input, without = TEMPLATES[template]
    if input:
        return with_input.format(instruction=instruction, input=input)
    return without.format(instruction=instruction)


def _messages(value) -> list:
    """A record's turns as role/content dicts (ShareGPT's from/value read as role/content)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DataError(f"a messages record must be a list of role/content turns, got {type(value).__name__}")
    out = []
    for m in value:
        m = {k: v for k, v in m.items() if v is not None}  # datasets fills absent struct keys with None
        if "from" in m:
            role = m.pop("from")
            m["role"] = _SHAREGPT_ROLES.get(role, role)
        if "value" in m:
            m["content"] = m.pop("value")
        out.append(m)
    return out


def _tools(example: dict):
    import json

    tools = example.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


# ---------------------------------------------------------------- tokenizing


def resolve_options(opts: SFTOptions, tokenizer, fmt: str, conversational: bool = True) -> SFTOptions:
    """``opts`` with the chat template read once (its text in ``chat_template``) when ``fmt`` renders
    conversations; a one-line DataError when the tokenizer has none."""
    from cuboid.data.chat import require_template

    if fmt == "messages" or (fmt == "prompt_completion" and conversational):
        return dataclasses.replace(opts, chat_template=require_template(tokenizer, opts.chat_template))
    return opts


def _template(tokenizer, opts: SFTOptions) -> str:
    from cuboid.data.chat import require_template

    return require_template(tokenizer, opts.chat_template)


def _with_eos(text: str, tokenizer) -> str:
    eos = tokenizer.eos_token
    return text + eos if eos and not text.endswith(eos) else text


def _string_pairs(example: dict, fmt: str, opts: SFTOptions) -> Optional[tuple]:
    """(prompt, completion) strings of an alpaca or string prompt/completion record; None otherwise."""
    if fmt == "alpaca":
        return (alpaca_prompt(example.get("instruction") or "", example.get("input") or "", opts.template or "alpaca"),
                example.get("output") or "")
    if fmt == "prompt_completion":
        prompt, completion = example[opts.text_column or "prompt"], example["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        if isinstance(prompt, str) or isinstance(completion, str):
            raise DataError("prompt and completion must both be strings or both be message lists")
    return None


def _mask_after(prompt_ids: Sequence[int], ids: Sequence[int]) -> list:
    n = common_prefix(prompt_ids, ids)
    return [0] * n + [1] * (len(ids) - n)


def _answer_row(prompt_ids: list, ids: list, n: int, answer: bool) -> tuple[list, list, bool]:
    """(ids, mask, later) of a prompt and an answer tokenized as far as ``n`` tokens: the answer follows the
    tokens the two share; ``later`` when the whole is cut there and has an answer (``answer``: its text)."""
    return ids, _mask_after(prompt_ids, ids), answer and len(ids) >= n


def _encode(example: dict, tokenizer, opts: SFTOptions, fmt: str) -> tuple[list, list, bool]:
    """(input ids, 0/1 trained mask, later) of one record before ``train_on_prompt``: the first ``max_length``
    + 1 tokens of the whole row (the kept ones, and one to tell a cut row), tokenizing no further than they
    reach; ``later``: an answer token lies past them (a row whose kept tokens hold none is dropped, not
    counted as having no answer)."""
    from cuboid.data.chat import encode_conversation_head, render

    n, encode = opts.max_length + 1, TextEncoder(tokenizer)
    if fmt == "text":
        ids = head_ids(_with_eos(example[opts.text_column or "text"] or "", tokenizer), n, encode)
        return ids, [1] * len(ids), False
    pair = _string_pairs(example, fmt, opts)
    if pair is not None:
        prompt, completion = pair
        completion = _with_eos(completion, tokenizer)
        return _answer_row(head_ids(prompt, n, encode), head_ids(prompt + completion, n, encode), n,
                           bool(completion))
    template, tools = _template(tokenizer, opts), _tools(example)
    if fmt == "messages":
        return encode_conversation_head(_messages(example[format_columns(fmt, opts, set(example))[0]]), tokenizer,
                                        template, n, tools=tools)
    prompt = _messages(example[opts.text_column or "prompt"])
    completion = _messages(example["completion"])
    plain = TextEncoder(tokenizer, special=False)  # the template writes its specials
    prompt_ids = head_ids(render(tokenizer, prompt, template, tools, add_generation_prompt=True), n, plain)
    ids = head_ids(render(tokenizer, prompt + completion, template, tools), n, plain)
    return _answer_row(prompt_ids, ids, n, bool(completion))


def _finish(ids: list, mask: list, opts: SFTOptions) -> Optional[dict]:
    truncated = len(ids) > opts.max_length
    ids = ids[:opts.max_length]
    if opts.train_on_prompt:
        labels = list(ids)
    else:
        labels = [t if m else -100 for t, m in zip(ids, mask[:opts.max_length])]
    if all(x == -100 for x in labels[1:]):
        return None
    return {"input_ids": ids, "labels": labels, "truncated": truncated}


def tokenize_example(example: dict, tokenizer, opts: SFTOptions, fmt: str) -> Optional[dict]:
    """One record as ``{"input_ids", "labels", "truncated"}`` (module docstring); None when it has
    nothing to learn after truncation (dropped). Call :func:`resolve_options` once first when the
    chat template comes from a file."""
    ids, mask, _ = _encode(example, tokenizer, opts, fmt)
    return _finish(ids, mask, opts)


def _encode_batch(batch: dict, tokenizer, opts: SFTOptions, fmt: str) -> list:
    """:func:`_encode` over a batch of records; the short texts of string formats tokenized in one call each."""
    rows = len(next(iter(batch.values())))
    examples = [{k: v[i] for k, v in batch.items()} for i in range(rows)]
    n, encode = opts.max_length + 1, TextEncoder(tokenizer)
    if fmt == "text":
        texts = [_with_eos(e[opts.text_column or "text"] or "", tokenizer) for e in examples]
        return [(ids, [1] * len(ids), False) for ids in head_ids_batch(texts, n, encode)]
    pairs = [_string_pairs(e, fmt, opts) for e in examples] if fmt in ("alpaca", "prompt_completion") else []
    if pairs and all(p is not None for p in pairs):
        completions = [_with_eos(c, tokenizer) for _, c in pairs]
        prompt_ids = head_ids_batch([p for p, _ in pairs], n, encode)
        full = head_ids_batch([p + c for (p, _), c in zip(pairs, completions)], n, encode)
        return [_answer_row(p, ids, n, bool(c)) for p, ids, c in zip(prompt_ids, full, completions)]
    return [_encode(e, tokenizer, opts, fmt) for e in examples]


def _is_conversational(ds, fmt: str, opts: SFTOptions) -> bool:
    if fmt != "prompt_completion":
        return fmt == "messages"
    return _is_list_feature(ds.features.get(opts.text_column or "prompt"))


def tokenize_dataset(ds, tokenizer, opts: SFTOptions) -> tuple[Any, SFTStats]:
    """A ``datasets.Dataset`` of records as ``(Dataset with input_ids and labels, SFTStats)``: tokenized
    by a batched ``Dataset.map``; the counts are read from its columns, then rows with nothing to learn
    are filtered out."""
    import datasets

    fmt = detect_format(ds.column_names, opts, ds.features)
    opts = resolve_options(opts, tokenizer, fmt, _is_conversational(ds, fmt, opts))

    def encode(batch: dict) -> dict:
        out = {"input_ids": [], "labels": [], "truncated": [], "dropped": [], "n_trained": [], "no_answer": []}
        for ids, mask, later in _encode_batch(batch, tokenizer, opts, fmt):
            row = _finish(ids, mask, opts)
            out["dropped"].append(row is None)
            out["no_answer"].append(row is None and not opts.train_on_prompt and not any(mask[1:]) and not later)
            row = row or {"input_ids": [], "labels": [], "truncated": False}
            for k in ("input_ids", "labels", "truncated"):
                out[k].append(row[k])
            out["n_trained"].append(sum(1 for x in row["labels"][1:] if x != -100))
        return out

    ints = datasets.Sequence(datasets.Value("int64"))
    features = datasets.Features({"input_ids": ints, "labels": ints, "truncated": datasets.Value("bool"),
                                  "dropped": datasets.Value("bool"), "n_trained": datasets.Value("int64"),
                                  "no_answer": datasets.Value("bool")})
    mapped = ds.map(encode, batched=True, batch_size=256, remove_columns=ds.column_names, features=features,
                    desc=f"tokenizing ({fmt})")
    stats = _stats(mapped)
    if stats.dropped or stats.no_answer:
        mapped = mapped.filter(lambda d: [not x for x in d], input_columns=["dropped"], batched=True,
                               desc="dropping rows with nothing to learn")
    return mapped.remove_columns(["truncated", "dropped", "n_trained", "no_answer"]), stats


def _stats(mapped) -> SFTStats:
    """The counts of :func:`tokenize_dataset`'s mapped columns, read with arrow (no Python rows)."""
    import pyarrow.compute as pc

    stats = SFTStats(examples=len(mapped))
    for t in mapped.with_format("arrow").iter(batch_size=10_000):
        dropped, no_answer = t.column("dropped"), t.column("no_answer")
        stats.no_answer += int(pc.sum(no_answer).as_py() or 0)
        stats.dropped += int(pc.sum(pc.and_(dropped, pc.invert(no_answer))).as_py() or 0)
        stats.truncated += int(pc.sum(pc.and_(t.column("truncated"), pc.invert(dropped))).as_py() or 0)
        stats.tokens += int(pc.sum(pc.list_value_length(t.column("input_ids"))).as_py() or 0)
        stats.trained_tokens += int(pc.sum(t.column("n_trained")).as_py() or 0)
    return stats


# ---------------------------------------------------------------- tensors


def _list_arrays(table, column: str):
    """A list column of an arrow table as (flat values, per-row lengths) in numpy."""
    import numpy as np
    import pyarrow.compute as pc

    col = table.column(column).combine_chunks()
    lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    return col.flatten().to_numpy(zero_copy_only=False).astype(np.int64), lengths


def padded_tensors(ds, pad_id: int) -> dict:
    """Rows of token lists (``input_ids``; ``labels`` default the tokens; an ``attention_mask`` column is
    kept) padded to the longest row: ``input_ids`` with ``pad_id``, labels -100, ``attention_mask`` 0."""
    import numpy as np
    import torch

    table = ds.with_format("arrow")[:]
    values, lengths = _list_arrays(table, "input_ids")
    n, width = len(lengths), int(lengths.max()) if len(lengths) else 0
    if width == 0:
        raise DataError("the dataset holds no tokens")
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)

    def grid(flat, fill):
        out = np.full((n, width), fill, dtype=np.int64)
        out[rows, cols] = flat
        return torch.from_numpy(out)

    labels = _list_arrays(table, "labels")[0] if "labels" in table.column_names else values
    mask = _list_arrays(table, "attention_mask")[0] if "attention_mask" in table.column_names \
        else np.ones_like(values)
    return {"input_ids": grid(values, pad_id), "attention_mask": grid(mask, 0), "labels": grid(labels, -100)}


def _rectangular(ds, keys: Sequence[str]) -> dict:
    import numpy as np
    import torch

    table = ds.with_format("arrow")[:]
    out = {}
    for key in keys:
        values, lengths = _list_arrays(table, key)
        if len(set(lengths.tolist())) > 1:
            raise DataError(f"packed rows must all have one length; column {key!r} has "
                            f"{int(lengths.min())}..{int(lengths.max())}")
        out[key] = torch.from_numpy(np.ascontiguousarray(values.reshape(len(lengths), -1)))
    return out


def prepared_tensors(ds, *, packing: bool, row_length: int, pad_id: int) -> dict:
    """Tensors of a dataset that is already tokenized (a ``cuboid prepare`` folder): packed rows
    (with ``position_ids``) as they are; other rows packed into ``row_length`` with ``packing``, else
    padded to the longest row."""
    from cuboid.data.packing import PACKED_KEYS, pack_dataset

    cols = ds.column_names
    if "position_ids" in cols:
        missing = [k for k in PACKED_KEYS if k not in cols]
        if missing:
            raise DataError(f"packed rows need the columns {', '.join(PACKED_KEYS)}; missing {', '.join(missing)}")
        return _rectangular(ds, PACKED_KEYS)
    if packing:
        labels = "labels" if "labels" in cols else None
        return _rectangular(pack_dataset(ds, row_length, labels_column=labels, pad_id=pad_id), PACKED_KEYS)
    return padded_tensors(ds, pad_id)


def sft_tensors(ds, tokenizer, opts: SFTOptions, *, packing: bool, stats: Optional[SFTStats] = None) -> dict:
    """A split of records as tensors for SFT: tokenized (:func:`tokenize_dataset`), then packed into rows
    of ``opts.max_length`` or padded to the longest row. ``stats``, when given, takes the counts."""
    tokens, counts = tokenize_dataset(ds, tokenizer, opts)
    if stats is not None:
        stats.merge(counts)
    if len(tokens) == 0:
        raise DataError(f"no example has anything to learn (of {counts.examples}, {counts.no_answer} without an "
                        f"answer, {counts.dropped} dropped after truncation): "
                        "check the data format and --max-length")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return prepared_tensors(tokens, packing=packing, row_length=opts.max_length, pad_id=pad_id)
