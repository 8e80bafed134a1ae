"""`cuboid finetune` end to end on tiny local models and generated data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuboid.data import formats as D
from cuboid.cli import main
from cuboid.kernels import use_backend

from . import fixtures as F

# the CLI runs as a user runs it: torch kernels on CPU, not the Triton interpreter the
# kernel tests switch on for this process (tests/conftest.py)
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
ENV.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def cli(*args, timeout=300):
    """Run `python -m cuboid ...` in a fresh process; (returncode, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-m", "cuboid", *args], capture_output=True, text=True, timeout=timeout,
                       env=ENV)
    return p.returncode, p.stdout, p.stderr


def cli_here(*args) -> int:
    """Run ``cuboid ...`` in this process, with the torch kernels a user's CPU run takes (this process has the
    Triton interpreter on, tests/conftest.py): for a one-process reference run, without a fresh interpreter's
    imports. Its exit code; its output goes to this process's stdout and stderr (capsys)."""
    with use_backend("torch"):
        return main(list(args))


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("text")
    rows = F.sentences(120)
    ds = datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]})
    ds.to_csv(str(root / "data.csv"))
    ds.to_json(str(root / "data.jsonl"))
    ds.to_parquet(str(root / "data.parquet"))
    (root / "data.txt").write_text("\n".join(t for t, _ in rows))
    ds.save_to_disk(str(root / "saved"))
    return root


def test_every_source_kind_loads(text_files, tmp_path):
    for name in ("data.csv", "data.jsonl", "data.parquet", "data.txt", "saved"):
        train, held = D.train_eval_split(D.load_source(text_files / name), 0.1, 0)
        assert len(train) + len(held) == 120, name
        assert "text" in train.column_names
    images = D.load_source(F.image_folder(tmp_path / "img"))
    train, held = D.train_eval_split(images)
    assert set(train.column_names) == {"image", "label"} and len(train) + len(held) == 24
    digits = D.load_source("digits")
    assert len(digits) == 1797 and D.num_classes(digits, "label") == 10


def test_causal_lm_single_process_jsonl(text_files, tmp_path):
    model = F.hf_gpt2_folder(tmp_path / "gpt")
    out = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(model), "--data", str(text_files / "data.jsonl"), "--steps", "6",
                     "--batch-size", "4", "--seq-len", "32", "--output-dir", str(out), "--eval-every", "3",
                     "--no-progress", "--no-plot")
    assert rc == 0, err
    rows = metrics(out)
    assert rows[-1]["step"] == 6 and "perplexity" in rows[-1]
    assert (out / "checkpoint-6").is_dir() and (out / "final" / "config.json").is_file()


def test_mlm_csv_and_seqcls_parquet_predictions_match_transformers(text_files, tmp_path):
    import transformers as T

    mlm = F.hf_bert_folder(tmp_path / "mlm", head="mlm")
    rc, _, err = cli("finetune", "--model", str(mlm), "--data", str(text_files / "data.csv"), "--steps", "4",
                     "--batch-size", "8", "--seq-len", "24", "--output-dir", str(tmp_path / "mlm-run"),
                     "--no-progress", "--no-plot")
    assert rc == 0, err
    assert "perplexity" in metrics(tmp_path / "mlm-run")[-1]

    cls = F.hf_bert_folder(tmp_path / "cls", head="cls")
    out = tmp_path / "cls-run"
    rc, _, err = cli("finetune", "--model", str(cls), "--data", str(text_files / "data.parquet"), "--steps", "30",
                     "--batch-size", "16", "--lr", "3e-3", "--seq-len", "24", "--output-dir", str(out),
                     "--no-progress", "--no-plot")
    assert rc == 0, err
    assert metrics(out)[-1]["accuracy"] > 0.5
    import cuboid

    ours = cuboid.load(out / "final").eval()
    theirs = T.AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    tok = T.AutoTokenizer.from_pretrained(out / "final")
    enc = tok([t for t, _ in F.sentences(8, seed=9)], padding="max_length", max_length=24, truncation=True,
              return_tensors="pt")
    with torch.no_grad():
        a = ours(**enc).logits
        b = theirs(**enc).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_qwen2_folder_clm_on_a_text_file_and_seqcls_load_in_transformers(text_files, tmp_path):
    """A Llama-family folder (Qwen2-shaped, its own tokenizer.json) fine-tunes from the CLI on a text file with
    --task clm, and as a classifier; both final folders load in transformers with cuboid's logits."""
    import transformers as T

    import cuboid

    qwen = F.hf_qwen2_folder(tmp_path / "qwen")
    out = tmp_path / "clm-run"
    rc, _, err = cli("finetune", "--model", str(qwen), "--data", str(text_files / "data.txt"), "--task", "clm",
                     "--steps", "6", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3", "--output-dir", str(out),
                     "--eval-every", "3", "--no-progress", "--no-plot")
    assert rc == 0, err
    rows = metrics(out)
    assert rows[-1]["step"] == 6 and rows[-1]["perplexity"] < rows[0]["perplexity"]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = T.AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert type(theirs).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        assert torch.allclose(cuboid.load(out / "final").eval()(input_ids=ids).logits, theirs(input_ids=ids).logits,
                              atol=1e-5, rtol=1e-5)

    cls = F.hf_qwen2_folder(tmp_path / "qwen-cls", head="cls")
    out = tmp_path / "cls-run"
    rc, _, err = cli("finetune", "--model", str(cls), "--data", str(text_files / "data.parquet"), "--task", "seqcls",
                     "--steps", "30", "--batch-size", "16", "--lr", "3e-3", "--seq-len", "24", "--output-dir", str(out),
                     "--no-progress", "--no-plot")
    assert rc == 0, err
    assert metrics(out)[-1]["accuracy"] > 0.5
    tok = T.AutoTokenizer.from_pretrained(out / "final")
    enc = tok([t for t, _ in F.sentences(8, seed=9)], padding="max_length", max_length=24, truncation=True,
              return_tensors="pt")
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    theirs = T.AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    with torch.no_grad():
        a, b = cuboid.load(out / "final").eval()(**enc).logits, theirs(**enc).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_imagefolder_and_in_memory_api(tmp_path):
    import datasets

    import cuboid

    folder = F.image_folder(tmp_path / "img")
    out = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", "vit-debug", "--data", str(folder), "--steps", "5", "--batch-size", "8",
                     "--output-dir", str(out), "--no-progress", "--no-plot")
    assert rc == 0, err
    assert "accuracy" in metrics(out)[-1]
    # the Python API on an in-memory Dataset, with gradient accumulation
    ds = D.load_source(folder)["train"]
    mem = datasets.Dataset.from_dict({"image": ds["image"], "label": ds["label"]})
    result = cuboid.finetune("vit-debug", mem, steps=3, batch_size=8, micro_batch_size=4,
                             output_dir=str(tmp_path / "api"), progress=False, plot=False)
    assert result["step"] == 3 and 0.0 <= result["accuracy"] <= 1.0


def test_dp2_through_the_launcher_resumes_exactly(tmp_path):
    folder = F.image_folder(tmp_path / "img", per_class=16)
    common = ["finetune", "--model", "vit-debug", "--data", str(folder), "--batch-size", "8", "--plan", "dp=2",
              "--lr", "5e-3", "--no-progress", "--no-plot", "--log-every", "1", "--eval-every", "100"]
    split = tmp_path / "split"
    rc, _, err = cli(*common, "--steps", "6", "--save-every", "3", "--output-dir", str(split))
    assert rc == 0, err
    assert "on 2 process(es)" in err
    a = metrics(split)  # the uninterrupted run's losses (saving draws nothing from the run's state)
    # throw away the tail of the run and resume from its step-3 checkpoint: the resume rewrites steps 4-6
    import shutil
    shutil.rmtree(split / "checkpoint-6")
    rc, _, err = cli(*common, "--steps", "6", "--resume", "latest", "--output-dir", str(split))
    assert rc == 0, err
    assert "resumed from" in err
    b = metrics(split)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt3", "--data", "digits"], "unknown model 'gpt3'"),
    (["--data", "digits", "--model", "vit-debug", "--plan", "dp=2", "--nproc-per-node", "3"],
     "--nproc-per-node 3 does not fit plan dp=2"),
    (["--data", "digits", "--model", "vit-debug", "--plan", "sp=2,tp=4,tp_mode=2d"],
     "sequence parallelism (sp=2) does not combine with tp_mode 2d"),
    (["--data", "digits", "--model", "vit-debug", "--label-column", "digit"], "column 'digit' not found"),
    (["--data", "digits", "--model", "vit-debug", "--plan", "banana"], "unknown plan 'banana'"),
])
def test_bad_values_are_one_line_and_exit_2(args, message, capsys, tmp_path):
    rc = main(["finetune", *args, "--output-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and message in err[0], err


def test_label_out_of_range_and_empty_dataset(tmp_path, capsys):
    import datasets
    import transformers as T

    folder = F.hf_bert_folder(tmp_path / "cls", head="cls", num_labels=2)
    bad = tmp_path / "bad.csv"
    datasets.Dataset.from_dict({"text": ["good dog", "bad cat", "sun moon"], "label": [0, 1, 5]}).to_csv(str(bad))
    rc = main(["finetune", "--model", str(folder), "--data", str(bad), "--steps", "1", "--batch-size", "1",
               "--eval-fraction", "0.34", "--output-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "label 5 in column 'label' is out of range for a model with 2 classes" in err
    empty = tmp_path / "empty.csv"
    empty.write_text("text,label\n")
    rc = main(["finetune", "--model", str(folder), "--data", str(empty), "--output-dir", str(tmp_path / "o2"),
               "--no-progress"])
    assert rc == 2 and "empty" in capsys.readouterr().err
    del T


def test_embedded_default_reaches_90_percent(tmp_path):
    """The README's main job: vit-debug on the digits with dp=2, >= 90% held-out accuracy."""
    out = tmp_path / "default"
    rc, _, err = cli("finetune", "--output-dir", str(out), "--no-progress", timeout=600)
    assert rc == 0, err
    final = metrics(out)[-1]
    assert final["step"] == 400 and final["accuracy"] >= 0.9, final
    assert (out / "curves.png").is_file()
    assert (out / "final" / "config.json").is_file()


def test_tp2d_on_4_processes_matches_single_and_loads_in_transformers(tmp_path):
    """`--plan tp2d --nproc-per-node 4`: the same losses as one process, and an HF-loadable final model."""
    import transformers as T

    import cuboid

    folder = F.image_folder(tmp_path / "img", per_class=16)
    common = ["finetune", "--model", "vit-debug", "--data", str(folder), "--batch-size", "8", "--steps", "3",
              "--lr", "5e-3", "--no-progress", "--no-plot", "--log-every", "1"]
    rc, _, err = cli(*common, "--plan", "tp2d", "--nproc-per-node", "4", "--output-dir", str(tmp_path / "tp"))
    assert rc == 0, err
    assert "on 4 process(es)" in err
    rc, _, err = cli(*common, "--plan", "single", "--output-dir", str(tmp_path / "one"))
    assert rc == 0, err
    a, b = metrics(tmp_path / "tp"), metrics(tmp_path / "one")
    assert all(abs(x["loss"] - y["loss"]) <= 1e-5 * abs(y["loss"]) for x, y in zip(a, b)) and len(a) == 3
    hf = T.AutoModelForImageClassification.from_pretrained(tmp_path / "tp" / "final").eval()
    ours = cuboid.load(tmp_path / "one" / "final").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(hf(pixel_values=x).logits, ours(pixel_values=x).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("task,source,extra", [
    ("causal", "data.jsonl", ["--seq-len", "32", "--optimizer", "lamb"]),
    ("mlm", "data.csv", ["--seq-len", "24", "--dtype", "bf16"]),
    ("seqcls", "data.parquet", ["--seq-len", "24", "--optimizer", "lars", "--lr", "0.5"]),
])
def test_text_tasks_dp2_under_the_launcher(task, source, extra, text_files, tmp_path):
    """Every text task on 2 processes: checkpoints kept to --keep, metrics logged, final model written."""
    folder = F.hf_gpt2_folder(tmp_path / "m") if task == "causal" else \
        F.hf_bert_folder(tmp_path / "m", head="mlm" if task == "mlm" else "cls")
    out = tmp_path / "run"
    rc, _, err = cli("finetune", "--model", str(folder), "--data", str(text_files / source), "--steps", "4",
                     "--batch-size", "8", "--plan", "dp2", "--save-every", "1", "--keep", "2",
                     "--output-dir", str(out), "--no-progress", "--no-plot", "--log-every", "1", *extra)
    assert rc == 0, err
    assert "on 2 process(es)" in err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert ("accuracy" if task == "seqcls" else "perplexity") in rows[-1]
    assert (out / "final" / "tokenizer.json").is_file()


def test_config_file_with_flag_override_and_bare_resume(tmp_path):
    folder = F.image_folder(tmp_path / "img")
    cfg = tmp_path / "job.toml"
    out = tmp_path / "run"
    cfg.write_text(f'model = "vit-debug"\ndata = "{folder}"\nsteps = 3\nbatch-size = 8\nlr = 0.5\n'
                   f'output-dir = "{out}"\nsave-every = 2\n')
    rc, _, err = cli("finetune", "--config", str(cfg), "--lr", "1e-3", "--no-progress", "--no-plot",
                     "--log-every", "1")
    assert rc == 0, err
    assert metrics(out)[0]["lr"] <= 1e-3  # the flag overrode the file's 0.5
    rc, _, err = cli("finetune", "--config", str(cfg), "--steps", "4", "--resume", "--no-progress", "--no-plot",
                     "--log-every", "1")
    assert rc == 0, err
    assert "resumed from" in err and "checkpoint-3" in err
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    bad = tmp_path / "bad.toml"
    bad.write_text('modell = "vit-debug"\n')
    rc, _, err = cli("finetune", "--config", str(bad))
    assert rc == 2 and "unknown key(s) modell" in err


def test_bad_value_under_the_launcher_is_one_line(tmp_path):
    rc, _, err = cli("finetune", "--model", "vit-debug", "--data", "digits", "--plan", "dp2", "--label-column",
                     "nope", "--output-dir", str(tmp_path), "--no-progress")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert lines == ["cuboid finetune: error: column 'nope' not found (columns: image, label); set --label-column"]
