"""``--streaming``: local files read as a stream per dp rank, shuffled, tokenized and packed on the fly, and
resumed exactly (cuboid/data/streaming.py).

- in one process: a stream resumed from its position at any step (mid-block, mid-packing-window, past an
  epoch's end, and resumed again from a resumed stream) gives the batches the uninterrupted stream gives;
  dp ranks read disjoint rows that together are the data; eval rows are held out (or read from a
  validation file) and never trained on;
- two processes (dp=2, ``cuboid finetune --task sft --streaming --packing``): a run killed twice (step 3,
  then step 5 of the restarted run, each resuming from the newest checkpoint: the second resume reads a
  stream that was itself resumed) ends with the uninterrupted run's parameters and optimizer state, bit for
  bit, and logs the same losses.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from cuboid.data.formats import DataError
from cuboid.tasks import SFT, MaskedLM
from cuboid.data.streaming import StreamBatches, StreamData, example_tokenizer, setup, stream_files

from . import chat_fixtures as C
from .test_faults import ROOT, assert_identical, launch

N_ROWS = 150


class RowTokenizer:
    """Row ``i`` ("i" then x's) -> tokens ``[10 + i] * (1 + number of x's)``: every token names its row."""

    eos_token_id, pad_token_id = 1, 0

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        head, _, tail = text.partition(" ")
        return {"input_ids": [10 + int(head)] * (1 + len(tail))}


def rows_file(path: Path, n: int = N_ROWS, start: int = 0) -> Path:
    """``n`` rows of uneven lengths (1..13 tokens, and an EOS), row ``i`` naming itself."""
    return C.write_jsonl(({"text": f"{i} " + "x" * ((i * 7) % 13)} for i in range(start, start + n)), path)


def stream(files: list, packing: bool, rank: int = 0, world: int = 1, rows: int = 3, skip: int = 0,
           buffer: int = 8) -> StreamBatches:
    tokenize = example_tokenizer(RowTokenizer(), 16, packing=packing)
    data = StreamData("json", [str(f) for f in files], tokenize, pad_id=0, row_length=16, packing=packing, skip=skip,
                      shuffle_buffer=buffer, seed=7, width_multiple=4)
    return StreamBatches(data, rows, rank, world)


def row_ids(batch: dict) -> list[int]:
    """The rows whose tokens a batch holds (each once per document start)."""
    ids, labels = batch["input_ids"], batch["labels"]
    if "position_ids" in batch:
        starts = (batch["position_ids"] == 0) & (batch["attention_mask"] == 1)
        return [int(t) - 10 for t in ids[starts] if int(t) >= 10]
    return [int(r[0]) - 10 for r, m in zip(ids, batch["attention_mask"]) if m[0]]


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_resume_at_any_step_gives_the_same_batches(tmp_path, packing):
    data = rows_file(tmp_path / "rows.jsonl")
    ref, at = stream([data], packing, skip=5), []
    batches = []
    for _ in range(70):  # past the end of the first epoch (145 rows, 3 a step)
        at.append(json.loads(json.dumps(ref.position)))  # what a checkpoint keeps: JSON
        batches.append(ref.next())
    assert ref.epoch >= 1.0
    first = [i for b in batches[:10] for i in row_ids(b)]
    assert min(first) >= 5 and first != sorted(first), "the held-out rows were read, or nothing was shuffled"
    if not packing:
        widths = {b["input_ids"].shape[1] for b in batches}
        assert widths <= {4, 8, 12, 16} and len(widths) > 1  # each batch cut to its longest row, rounded to 4
    for k in (0, 1, 3, 9, 30, 47, 69):
        again = stream([data], packing, skip=5)
        again.position = at[k]
        for j in range(k, min(k + 6, len(batches))):
            got = again.next()
            assert got.keys() == batches[j].keys()
            assert all(torch.equal(got[key], batches[j][key]) for key in got), f"resumed at {k}: step {j} differs"
        twice = stream([data], packing, skip=5)  # a stream resumed from a resumed one (datasets#8308)
        twice.position = json.loads(json.dumps(again.position))
        for j in range(min(k + 6, len(batches)), min(k + 10, len(batches))):
            got = twice.next()
            assert all(torch.equal(got[key], batches[j][key]) for key in got), f"resumed twice: step {j} differs"


@pytest.mark.parametrize("files", [1, 2], ids=["rows-strided", "file-per-rank"])
def test_dp_ranks_read_disjoint_rows_that_cover_the_data(tmp_path, files):
    paths = [rows_file(tmp_path / "a.jsonl", 60), rows_file(tmp_path / "b.jsonl", 60, start=60)][:files]
    n = 60 * files
    seen = []
    for rank in range(2):
        s = stream(paths, False, rank=rank, world=2, rows=1)
        seen.append([i for _ in range(n // 2) for i in row_ids(s.next())])
    assert set(seen[0]).isdisjoint(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(n))  # one epoch each: every row once


def test_setup_holds_out_eval_rows_or_reads_a_validation_file(tmp_path):
    tok = C.chat_tokenizer(tmp_path / "tok", "qwen2")
    config = type("Config", (), {"n_positions": 256})()
    data = C.write_jsonl(C.messages_rows(130), tmp_path / "chat" / "train.jsonl")
    prep = dict(config=config, tokenizer=tok, seq_len=128, packing=False)
    batches, eval_tensors, n_eval = setup(prep, str(data), SFT(), rank=0, world=1, rows=4, eval_examples=100)
    assert n_eval == 100 and batches.data.skip == 100 and eval_tensors["labels"].shape[0] == 100
    batch = batches.next()
    assert (batch["labels"] != -100).any() and (batch["labels"] == -100).any()  # answers only
    text = tok.apply_chat_template(C.messages_rows(130)[0]["messages"], tokenize=False)
    first = tok(text, add_special_tokens=False)["input_ids"][:128]
    assert eval_tensors["input_ids"][0, :len(first)].tolist() == first  # eval: the stream's first rows
    C.write_jsonl(C.messages_rows(20, seed=3), tmp_path / "chat" / "validation.jsonl")
    assert stream_files(tmp_path / "chat")[1:] == ([str(data)], [str(tmp_path / "chat" / "validation.jsonl")])
    batches, eval_tensors, n_eval = setup({**prep, "packing": True}, str(tmp_path / "chat"), SFT(), rank=0,
                                          world=1, rows=2)
    assert n_eval == 20 and batches.data.skip == 0 and "position_ids" in batches.next()
    with pytest.raises(DataError, match="all held out for eval"):
        setup(prep, str(data), SFT(), rank=0, world=1, rows=4, eval_examples=500)
    with pytest.raises(ValueError, match="--streaming streams text for causal and sft, not for task mlm"):
        setup(prep, str(data), MaskedLM(), rank=0, world=1, rows=4)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(DataError, match="--streaming reads"):
        stream_files(tmp_path / "weights.bin")


def test_streaming_needs_steps():
    import cuboid

    with pytest.raises(ValueError, match="--streaming needs --steps"):
        cuboid.finetune("gpt-debug", "nowhere.jsonl", streaming=True)


# ---------------------------------------------------------------- killed twice, under dp=2

STEPS = 6  # = fault_job.STEPS, which assert_identical reads


def finetune_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["finetune", "--model", str(model), "--data", str(data), "--task", "sft", "--streaming", "--packing",
            "--shuffle-buffer", "16", "--seq-len", "64", "--plan", "dp=2", "--steps", str(STEPS), "--batch-size",
            "8", "--lr", "3e-3", "--save-every", "2", "--log-every", "1", "--eval-every", "100", "--output-dir",
            str(out), "--no-progress", "--no-plot"]


def test_streaming_run_killed_twice_ends_like_the_uninterrupted_one(tmp_path):
    model = C.hf_chat_qwen2_folder(tmp_path / "qwen")
    data = C.write_jsonl(C.messages_rows(240), tmp_path / "chat.jsonl")
    reference, out = tmp_path / "reference", tmp_path / "run"
    launch([sys.executable, "-m", "cuboid", *finetune_args(model, data, reference)], what="the streaming reference")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # attempt 0: rank 1 dies in step 3 (resume from checkpoint-2); attempt 1: rank 0 dies in step 5 (resume
    # from checkpoint-4, written by the resumed stream); attempt 2 finishes
    err, = launch([sys.executable, "-m", "tests.front.fault_job", *finetune_args(model, data, out),
                   "--max-restarts", "2", "--timeout-s", "60"],
                  env={"CUBOID_FAULT": "1:3:step,0:5:step", "PYTHONPATH": path}, what="the streaming run killed twice")
    assert "resumed from" in err and "at step 2 (restart 1)" in err and "at step 4 (restart 2)" in err, err[-3000:]
    assert_identical(out, reference)  # checkpoint-6: model and optimizer tensors, and the logged losses
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())["state"]["data"]
    assert len(state["stream"]) == 2 and state["stream"][0] != state["stream"][1]  # each dp rank's position
