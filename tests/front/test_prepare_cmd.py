"""`cuboid prepare`: the report's numbers against a count made here from transformers' own assistant masks, the
rows written as finetune reads them (and trained from), packed rows holding every example once, the trained
tokens marked in the printed rows, and an existing folder refused without --overwrite."""
from __future__ import annotations

import json
import re

import pytest
import torch

from cuboid.data import formats as D
from cuboid.cli import main

from . import chat_fixtures as CF
from .test_finetune import cli, metrics

MAX_LENGTH = 64  # short enough that most conversations are cut


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return CF.hf_chat_qwen2_folder(tmp_path_factory.mktemp("qwen") / "model")


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    rows = CF.messages_rows(40, seed=3)
    # a long first turn: the answer starts past MAX_LENGTH, so the row has nothing to learn and is dropped
    rows.append({"messages": [{"role": "user", "content": "alpha " * 60 + "?"},
                              {"role": "assistant", "content": "beta"}]})
    return CF.write_jsonl(rows, tmp_path_factory.mktemp("data") / "chat.jsonl")


def expected(conversations, tok, max_length: int) -> tuple[list, dict]:
    """(rows of (input_ids, labels), counts) from transformers' assistant mask, cut to ``max_length``."""
    rows, counts = [], dict(examples=0, dropped=0, truncated=0, tokens=0, trained_tokens=0)
    for messages in conversations:
        enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
        counts["examples"] += 1
        cut = len(ids) > max_length
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask[1:]):
            counts["dropped"] += 1
            continue
        counts["truncated"] += cut
        counts["tokens"] += len(ids)
        counts["trained_tokens"] += sum(mask[1:])
        rows.append((ids, [t if m else -100 for t, m in zip(ids, mask)]))
    return rows, counts


def finetune_padding(rows: list, batch_size: int, seed: int) -> float:
    """The padding of one epoch of finetune's own training batches of these rows (GlobalBatches, widths cut
    to multiples of 8); with no ``batch_size``, of the rows padded to the longest, as evaluation reads them."""
    width = max(len(ids) for ids, _ in rows)
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    if batch_size is None:
        return 1 - float(mask.sum()) / mask.numel()
    batches = D.GlobalBatches({"attention_mask": mask}, batch_size, seed, width_multiple=8)
    real = cells = 0
    for _ in range(batches.per_epoch):
        m = batches.next()["attention_mask"]
        real, cells = real + int(m.sum()), cells + m.numel()
    return 1 - real / cells


def splits(chat_file):
    train, held = D.train_eval_split(D.load_source(str(chat_file)), 0.1, 0)
    return {"train": [r["messages"] for r in train], "validation": [r["messages"] for r in held]}


def test_the_report_counts_what_finetune_trains(qwen, chat_file, tmp_path, capsys):
    import datasets
    import transformers as T

    out = tmp_path / "prepared"
    assert main(["prepare", "--model", str(qwen), "--data", str(chat_file), "--output", str(out),
                 "--max-length", str(MAX_LENGTH), "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "prepare_report.json").read_text())
    assert report["task"] == "sft" and report["data_format"] == "messages" and report["max_length"] == MAX_LENGTH
    tok = T.AutoTokenizer.from_pretrained(qwen)
    saved = datasets.load_from_disk(str(out))
    dropped = 0
    for name, conversations in splits(chat_file).items():
        rows, counts = expected(conversations, tok, MAX_LENGTH)
        got = report["splits"][name]
        for key, value in counts.items():
            assert got[key] == value, (name, key)
        dropped += counts["dropped"]
        assert got["rows"] == len(rows) == len(saved[name])
        assert saved[name]["input_ids"] == [ids for ids, _ in rows] and saved[name]["labels"] == [y for _, y in rows]
        padding = finetune_padding(rows, 4 if name == "train" else None, 0)
        assert got["padding_fraction"] == pytest.approx(padding, abs=1e-12)
        line = next(x for x in printed.splitlines() if x.startswith(name + " "))
        assert line.split()[1:7] == [f"{counts[k]:,}" for k in ("examples", "dropped", "truncated")] + [
            f"{len(rows):,}", f"{counts['tokens']:,}", f"{counts['trained_tokens']:,}"]
    assert dropped == 1 and report["splits"]["train"]["truncated"] > 0  # the long question's row
    # the first printed row: its trained text is exactly what sits inside [[ ]]
    ids, labels = saved["train"][0]["input_ids"], saved["train"][0]["labels"]
    shown = printed.split("train row 0:")[1].split("train row 1:")[0].split("\n", 1)[1]  # below its heading
    inside = "".join(re.findall(r"\[\[(.*?)\]\]", shown, flags=re.S))
    spans = tok.decode([t for t, y in zip(ids[1:], labels[1:]) if y != -100], skip_special_tokens=False)
    assert inside == spans and inside and "<|im_start|>user" in shown
    assert "\033[" not in printed  # no colour when stdout is not a terminal


def test_packed_rows_hold_each_example_once_and_finetune_trains_on_the_folder(qwen, chat_file, tmp_path):
    out = tmp_path / "packed"
    rc, printed, err = cli("prepare", "--model", str(qwen), "--data", str(chat_file), "--output", str(out),
                           "--max-length", "128", "--packing")
    assert rc == 0, err
    report = json.loads((out / "prepare_report.json").read_text())
    train = D.load_source(str(out))["train"]
    rows = {k: torch.tensor(train[k]) for k in ("input_ids", "labels", "position_ids", "attention_mask")}
    assert rows["input_ids"].shape == (report["splits"]["train"]["rows"], 128)
    import transformers as T

    want, counts = expected(splits(chat_file)["train"], T.AutoTokenizer.from_pretrained(qwen), 128)
    docs = []
    for r in range(rows["input_ids"].shape[0]):
        n = int(rows["attention_mask"][r].sum())
        starts = torch.nonzero(rows["position_ids"][r, :n] == 0).flatten().tolist() + [n]
        docs += [(rows["input_ids"][r, a:b].tolist(), rows["labels"][r, a + 1:b].tolist())
                 for a, b in zip(starts, starts[1:])]
    assert sorted(docs) == sorted((ids, y[1:]) for ids, y in want)  # every kept example once, its labels kept
    cells = rows["attention_mask"].numel()
    assert report["splits"]["train"]["padding_fraction"] == pytest.approx(1 - counts["tokens"] / cells, abs=1e-12)
    assert report["splits"]["train"]["trained_tokens"] == counts["trained_tokens"]
    assert "padding: of the packed rows" in printed
    several = [int((rows["position_ids"][r][rows["attention_mask"][r] == 1] == 0).sum()) for r in range(2)]
    assert ("--- document 2" in printed) == (max(several) > 1), several

    # finetune reads the folder as it is: the same rows, tokens and trained tokens, and it trains
    run = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(qwen), "--data", str(out), "--task", "sft", "--seq-len", "128",
                     "--steps", "3", "--batch-size", "4", "--lr", "3e-3", "--plan", "single", "--log-every", "1",
                     "--eval-every", "3", "--no-progress", "--no-plot", "--output-dir", str(run))
    assert rc == 0, err
    data_line = next(x for x in err.splitlines() if x.startswith("data:"))
    assert f"{report['splits']['train']['tokens']:,} of them real" in data_line, data_line
    assert f"{report['splits']['train']['trained_tokens']:,} trained tokens" in data_line, data_line
    losses = [m["loss"] for m in metrics(run)]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_an_existing_output_is_kept_unless_overwrite(qwen, chat_file, tmp_path, capsys):
    out = tmp_path / "prepared"
    args = ["prepare", "--model", str(qwen), "--data", str(chat_file), "--output", str(out), "--max-length", "64"]
    assert main(args) == 0
    before = (out / "prepare_report.json").read_text()
    capsys.readouterr()
    assert main([*args[:-1], "96"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"cuboid prepare: error: --output {out} exists: choose another folder or pass "
                           "--overwrite to replace it")
    assert (out / "prepare_report.json").read_text() == before
    assert main([*args[:-1], "96", "--overwrite"]) == 0
    assert json.loads((out / "prepare_report.json").read_text())["max_length"] == 96
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # no temporary folder left beside it
    capsys.readouterr()
    assert main(["prepare", "--model", str(qwen), "--data", str(chat_file), "--output", str(tmp_path / "x"),
                 "--data-format", "chat"]) == 2
    assert "unknown --data-format 'chat'; formats: messages" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
