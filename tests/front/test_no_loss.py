"""Nothing lost (issue 49): held-out stream rows stay out of training, eval forwards match across dp ranks,
and ``--overwrite`` replaces only a folder cuboid wrote."""
from __future__ import annotations

import pytest
import torch

from .test_streaming import row_ids, rows_file, stream


@pytest.mark.parametrize("files", [2, 4], ids=["file-per-rank", "two-files-per-rank"])
def test_streamed_eval_rows_are_never_trained_on(tmp_path, files):
    """The first ``skip`` rows of the stream (in file order) are the eval rows: no dp rank reads them, and
    together the ranks read every other row once an epoch, however the files are dealt to the ranks."""
    paths = [rows_file(tmp_path / f"{i}.jsonl", 30, start=30 * i) for i in range(files)]
    n, skip = 30 * files, 40  # the held-out rows span the first file and a part of the second
    seen = []
    for rank in range(2):
        s = stream(paths, False, rank=rank, world=2, rows=1, skip=skip)
        seen.append([i for _ in range((n - skip) // 2) for i in row_ids(s.next())])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(skip, n)), "eval rows trained on, or training rows never read"
