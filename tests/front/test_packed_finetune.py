"""`cuboid finetune --task clm --packing`: each record a document, packed rows whose documents attend only
to themselves, the same losses on one process, dp=2 and pp=2, and the padding said at the start."""
from __future__ import annotations

import pytest
import torch

from cuboid import tasks
from cuboid.data import formats as D
from cuboid.train.config import FinetuneConfig, checked
from cuboid.kernels import use_backend

from . import fixtures as F
from .test_finetune import cli, metrics


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return F.hf_qwen2_folder(tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "data.txt"
    path.write_text("\n".join(t for t, _ in F.sentences(120)))
    return path


def texts(n: int) -> list[str]:
    return [t for t, _ in F.sentences(n, seed=5)]


def test_prepare_packs_each_record_as_a_document(qwen):
    import datasets

    tok = D.load_tokenizer(qwen)
    config = type("C", (), {"n_positions": 64})()
    lines = texts(30) + [""]  # an empty record is no document
    ds = datasets.Dataset.from_dict({"text": lines})
    rows = tasks.prepare(ds, "causal", config=config, tokenizer=tok, seq_len=64, packing=True)
    assert set(rows) == {"input_ids", "labels", "position_ids", "attention_mask"} and rows["input_ids"].shape[1] == 64
    want = sorted(tuple(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in lines if t)
    got = []
    for r in range(rows["input_ids"].shape[0]):
        n = int(rows["attention_mask"][r].sum())
        starts = torch.nonzero(rows["position_ids"][r, :n] == 0).flatten().tolist() + [n]
        got += [tuple(rows["input_ids"][r, a:b].tolist()) for a, b in zip(starts, starts[1:])]
        assert (rows["labels"][r, starts[:-1]] == -100).all()
    assert sorted(got) == want  # every document whole (none is longer than a row), each once
    assert D.real_tokens(rows) == sum(map(len, want))
    assert "attention_mask" not in D.model_inputs(rows) and "attention_mask" in D.model_inputs(
        {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"]})
    # without packing: blocks of the concatenated text, as before
    blocks = tasks.prepare(ds, "causal", config=config, tokenizer=tok, seq_len=32)
    assert set(blocks) == {"input_ids", "labels"} and blocks["input_ids"].numel() <= sum(map(len, want))
    with pytest.raises(D.DataError, match="not for task mlm"):
        tasks.prepare(ds, "mlm", config=config, tokenizer=tok, seq_len=32, packing=True)
    with pytest.raises(ValueError, match="--packing puts whole documents into rows for language modelling"):
        checked(FinetuneConfig(task="seqcls", packing=True))


def test_packed_loss_is_the_documents_loss(qwen):
    """A packed row's loss is the token-weighted mean of its documents' losses, each document run alone."""
    import datasets

    import cuboid

    model = cuboid.load(qwen).eval()
    tok = D.load_tokenizer(qwen)
    ds = datasets.Dataset.from_dict({"text": texts(12)})
    rows = tasks.prepare(ds, "causal", config=model.config, tokenizer=tok, seq_len=48, packing=True)
    batch = {k: v[:2] for k, v in D.model_inputs(rows).items()}
    with use_backend("torch"):  # the CPU path a user runs (this process has the Triton interpreter on)
        packed, across, weighted, total = packed_and_alone(model, rows, batch)
    assert packed == pytest.approx(weighted / total, rel=1e-5, abs=1e-6)
    assert abs(across - packed) > 1e-4  # attending across documents is another loss: the positions matter


@torch.no_grad()
def packed_and_alone(model, rows: dict, batch: dict) -> tuple:
    """(the packed loss, the loss with the positions dropped, sum of the documents' losses each run alone
    weighted by their targets, the targets)."""
    total = weighted = 0.0
    for r in range(2):
        n = int(rows["attention_mask"][r].sum())
        starts = torch.nonzero(rows["position_ids"][r, :n] == 0).flatten().tolist() + [n]
        for a, b in zip(starts, starts[1:]):
            doc = rows["input_ids"][r:r + 1, a:b]
            weighted += float(model(input_ids=doc, labels=doc).loss) * (b - a - 1)
            total += b - a - 1
    packed = float(model(**batch).loss)
    across = float(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
    return packed, across, weighted, total


def test_packing_from_the_cli_on_one_process_dp2_and_pp2(qwen, text_file, tmp_path):
    """The same losses step by step on one process, under dp=2 and under pp=2 (positions travel with the
    batch); each run says its padding at the start and logs real tokens/s."""
    common = ["finetune", "--model", str(qwen), "--data", str(text_file), "--task", "clm", "--packing",
              "--steps", "4", "--batch-size", "4", "--seq-len", "64", "--lr", "3e-3", "--no-progress", "--no-plot",
              "--log-every", "1", "--eval-every", "4"]
    runs = {}
    for name, plan in (("single", "single"), ("dp2", "dp=2"), ("pp2", "pp=2")):  # (2 micro-batches: the schedule's default)
        rc, _, err = cli(*common, "--plan", plan, "--output-dir", str(tmp_path / name))
        assert rc == 0, err
        assert "padding" in err and "(packed: 108 documents" in err, err
        runs[name] = metrics(tmp_path / name)
    one = runs["single"]
    assert [r["step"] for r in one] == [1, 2, 3, 4] and all(r["tokens_per_s"] > 0 for r in one)
    assert one[-1]["loss"] < one[0]["loss"]
    for name in ("dp2", "pp2"):
        assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]) for a, b in zip(runs[name], one)), name
        assert runs[name][-1]["eval_loss"] == pytest.approx(one[-1]["eval_loss"], rel=1e-5)


def test_packing_through_the_python_api(qwen):
    import datasets

    import cuboid

    ds = datasets.Dataset.from_dict({"text": texts(60)})
    with use_backend("torch"):
        result = cuboid.finetune(str(qwen), ds, task="clm", packing=True, steps=2, batch_size=4, seq_len=64,
                                 output_dir=str(qwen.parent / "api-run"), progress=False, plot=False)
    assert result["step"] == 2 and result["perplexity"] > 1.0
