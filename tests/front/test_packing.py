"""The packer (cuboid/data/packing.py): best-fit-decreasing rows as TRL packs them, and the packed layout's
promises (every token once, rows within length, positions and labels per document)."""
from __future__ import annotations

import numpy as np
import pytest

from cuboid.data.packing import best_fit_decreasing, pack, pack_dataset, padding_fraction, plan_rows


def documents(n: int, seed: int, cap: int = 300) -> list[list[int]]:
    """Documents of lognormal lengths (some past the cap, some of length 1), every token a unique id."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(20), 1.0, n).astype(int), 1, cap)
    lengths[::17] = 1
    starts = np.cumsum(lengths) - lengths
    return [list(range(1000 + s, 1000 + s + n_)) for s, n_ in zip(starts.tolist(), lengths.tolist())]


def check_layout(docs: list[list[int]], out: dict, row_length: int, pad_id: int = 0) -> None:
    ids, labels, pos, mask = (np.asarray(out[k]) for k in ("input_ids", "labels", "position_ids", "attention_mask"))
    assert ids.shape[1] == row_length and ids.shape == labels.shape == pos.shape == mask.shape
    real = ids[mask == 1]
    # every token once: the tokens are unique ids
    assert sorted(real.tolist()) == sorted(t for d in docs for t in d)
    assert (ids[mask == 0] == pad_id).all() and (labels[mask == 0] == -100).all()
    doc_of = {t: i for i, d in enumerate(docs) for t in d}
    index_in_doc = {t: j for d in docs for j, t in enumerate(d)}
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        assert (mask[r, :n] == 1).all(), "documents first, padding after"
        assert (pos[r, n:] == np.arange(row_length - n)).all(), "the padding is a document of its own"
        starts = np.flatnonzero(pos[r, :n] == 0)
        assert starts[0] == 0
        for a, b in zip(starts, [*starts[1:], n]):
            piece = ids[r, a:b]
            assert (pos[r, a:b] == np.arange(b - a)).all()
            assert len({doc_of[int(t)] for t in piece}) == 1, "a piece holds one document"
            j = index_in_doc[int(piece[0])]
            assert j % row_length == 0, "documents split at multiples of the row length"
            assert (np.diff(piece) == 1).all(), "a piece is contiguous, in order"
            assert labels[r, a] == -100 and (labels[r, a + 1:b] == piece[1:]).all()


@pytest.mark.parametrize("row_length", [64, 128, 257])
def test_packed_rows_keep_every_token_once_with_positions_and_labels_per_document(row_length):
    docs = documents(300, seed=row_length)
    out = pack(docs, row_length, pad_id=0)
    check_layout(docs, out, row_length)
    assert out["input_ids"].dtype.is_floating_point is False
    layout = plan_rows([len(d) for d in docs], row_length)
    assert layout.rows == out["input_ids"].shape[0] and layout.tokens == sum(map(len, docs))
    assert padding_fraction(out) == pytest.approx(layout.padding_fraction)
    # best fit decreasing fills rows: at most one row beyond the token count's lower bound per 10 rows here
    assert layout.rows <= -(-layout.tokens // row_length) * 1.1 + 1


def test_best_fit_decreasing_by_hand():
    # 5 opens row 0 (room 3); 4 does not fit there: row 1 (room 4); 3 takes row 0's room 3, the least that
    # fits; 2 goes to row 1 (room 2), the next 2 fills it; 1 finds no room: row 2
    assert best_fit_decreasing([2, 5, 3, 4, 2, 1], 8) == [[1, 2], [3, 0, 4], [5]]
    # ties in length keep index order; ties in room take the oldest row
    assert best_fit_decreasing([3, 3, 3, 1, 1], 4) == [[0, 3], [1, 4], [2]]
    with pytest.raises(ValueError, match="1..4"):
        best_fit_decreasing([5], 4)


def test_labels_given_and_short_rows():
    docs = [[5, 6, 7], [8, 9]]
    out = pack(docs, 8, labels=[[-100, -100, 7], [8, 9]], pad_id=1, as_tensors=False)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 1, 1]]
    assert out["labels"].tolist() == [[-100, -100, 7, -100, 9, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="as long as the document"):
        pack(docs, 8, labels=[[1], [2, 3]])
    empty = pack([[], [4]], 4, as_tensors=False)  # an empty document is dropped
    assert empty["input_ids"].tolist() == [[4, 0, 0, 0]]


def test_pack_dataset_matches_pack_through_an_index_mapping():
    import datasets

    docs = documents(200, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": docs, "extra": list(range(len(docs)))})
    shuffled = ds.shuffle(seed=1)  # an indices mapping: rows are read through it
    order = shuffled["extra"]
    want = pack([docs[i] for i in order], 96, pad_id=7, as_tensors=False)
    got = pack_dataset(shuffled, 96, pad_id=7, batch_size=13)
    assert got.column_names == ["input_ids", "labels", "position_ids", "attention_mask"]
    for key in want:
        assert np.array_equal(np.asarray(got[key]), want[key]), key
    masked = datasets.Dataset.from_dict({"input_ids": docs[:20], "mask": [[-100] * len(d) for d in docs[:20]]})
    assert all(v == -100 for row in pack_dataset(masked, 96, labels_column="mask")["labels"] for v in row)


def test_same_rows_as_trl_bfd_split():
    """TRL's pack_dataset(strategy="bfd_split") on the same documents gives the same rows, in the same
    order, with the same document lengths (TRL packs each map batch apart: one batch here)."""
    trl_data = pytest.importorskip("trl.data_utils")
    import datasets

    for seed, row_length in ((0, 64), (1, 100), (2, 256)):
        docs = documents(400, seed=seed)
        ds = datasets.Dataset.from_dict({"input_ids": docs})
        theirs = trl_data.pack_dataset(ds, row_length, strategy="bfd_split", map_kwargs={"batch_size": None})
        ours = pack(docs, row_length, as_tensors=False)
        layout = plan_rows([len(d) for d in docs], row_length)
        assert len(theirs) == layout.rows
        for r, row in enumerate(theirs):
            n = int(ours["attention_mask"][r].sum())
            assert row["input_ids"] == ours["input_ids"][r, :n].tolist(), (seed, r)
            assert row["seq_lengths"] == layout.length[layout.row_ptr[r]:layout.row_ptr[r + 1]].tolist()
