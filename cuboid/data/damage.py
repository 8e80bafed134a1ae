"""Damaged data files said in one line that names the file and the line (1-based, as an editor shows it).

``datasets`` reports a malformed jsonl row as a chained ``DatasetGenerationError``
(some 70 lines of traceback), an empty file as a bare ``StopIteration``, and
reads bytes that are not UTF-8 without a word, to fail later in the tokenizer.
:func:`check_text_files` runs before a load (a UTF-8 check, a line at a time);
:func:`locate` runs after a failed one, to find the row that broke it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

from cuboid.data.errors import DataError

TEXT_KINDS = ("json", "csv", "text")  # the kinds read as text (parquet is binary)


def check_text_file(path, what: str = "data") -> None:
    """A :class:`DataError` when ``path`` is empty or holds bytes that are not UTF-8 (naming the line and
    column of the first); read a line at a time. ``what``: the file's role in the message."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise DataError(f"{what} {path}: the file is empty")
    with open(path, "rb") as fh:
        for n, row in enumerate(fh, 1):
            try:
                row.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{what} {path}, line {n}: not UTF-8 text (byte 0x{row[e.start]:02x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None


def check_text_files(files: Iterable, kind: Optional[str]) -> None:
    """:func:`check_text_file` of each file of a text ``kind`` (json, csv, text)."""
    if kind in TEXT_KINDS:
        for f in files:
            check_text_file(f)


def locate(files: Iterable, kind: Optional[str]) -> Optional[str]:
    """``"data FILE, line N: what"`` for the first row of a json / jsonl file that is not a JSON object, or
    None when none is found (the load failed for another reason)."""
    if kind != "json":
        return None
    for f in files:
        path = Path(f)
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json" and text.lstrip()[:1] in ("[", "{"):
            try:
                json.loads(text)
                continue
            except json.JSONDecodeError as e:
                return f"data {path}, line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        for n, row in enumerate(text.splitlines(), 1):
            if not row.strip():
                continue
            try:
                value = json.loads(row)
            except json.JSONDecodeError as e:
                return f"data {path}, line {n}: not valid JSON ({e.msg}, column {e.colno})"
            if not isinstance(value, dict):
                return f"data {path}, line {n}: not a JSON object (a {type(value).__name__})"
    return None
