"""What a new user met on a fresh clone with their own model folder and data (issue 65, item 4): a folder of
split files keeps its splits as ``datasets.load_dataset`` names them (``--eval-data`` and ``--eval-fraction 0``
beside), chat data without ``--task sft`` says to add it, a header-only csv is one line, a failed run leaves
its output folder as it found it, a misspelt ``--config`` key gets a did-you-mean, a CPU run sets its threads,
and the helps and listings say what they show, once."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cuboid.cli import main
from cuboid.data import formats as D
from cuboid.kernels import use_backend
from cuboid.train.callbacks import TrainerCallback

from . import fixtures as F


def texts(n: int, tag: str) -> list:
    return [{"text": f"{tag} {t}"} for t, _ in F.sentences(n, seed=len(tag))]


def parquet(rows: list, path: Path) -> Path:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


def jsonl(rows: list, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(*args) -> int:
    with use_backend("torch"):
        return main(list(args))


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("names, want", [
    ({"train.parquet": 250, "validation.parquet": 50}, (250, 50)),       # the user's folder
    ({"data/train-00000.parquet": 30, "data/dev.parquet": 7}, (30, 7)),  # sharded train, a dev file
    ({"train/a.parquet": 20, "test/b.parquet": 5}, (20, 5)),            # split sub-folders
    ({"one.parquet": 40, "two.parquet": 60}, (90, 10))])                  # no split named: a seeded holdout
def test_a_folder_keeps_its_split_files(names, want, tmp_path):
    import datasets

    for name, n in names.items():
        parquet(texts(n, Path(name).stem), tmp_path / "d" / name)
    train, held = D.train_eval_split(D.load_source(tmp_path / "d"), 0.1, 0)
    assert (len(train), len(held)) == want
    if "one.parquet" not in names:  # as datasets reads the folder
        ds = datasets.load_dataset(str(tmp_path / "d"))
        assert (len(ds["train"]), len(next(ds[k] for k in ds if k != "train"))) == want
        assert not set(train["text"]) & set(held["text"])  # no eval row is trained on


def test_eval_data_and_no_eval(tmp_path):
    data = jsonl(texts(30, "train"), tmp_path / "train.jsonl")
    held = jsonl(texts(6, "held"), tmp_path / "held.jsonl")
    train, ev = D.train_eval_split(D.load_source(data), 0.1, 0, eval_data=held)
    assert (len(train), len(ev)) == (30, 6) and set(ev["text"]) == {r["text"] for r in texts(6, "held")}
    train, ev = D.train_eval_split(D.load_source(data), 0.0, 0)
    assert len(train) == 30 and ev is None
    from cuboid.train.config import FinetuneConfig, checked

    with pytest.raises(ValueError, match="--eval-data is not read with --streaming"):
        checked(FinetuneConfig(model="gpt-debug", data=str(data), streaming=True, steps=1, eval_data=str(held)))


@pytest.mark.slow
def test_finetune_reads_the_splits_and_runs_without_eval(tmp_path, capsys):
    model = F.hf_gpt2_folder(tmp_path / "m")
    parquet(texts(40, "train"), tmp_path / "d" / "train.parquet")
    parquet(texts(10, "valid"), tmp_path / "d" / "validation.parquet")
    common = ["--model", str(model), "--task", "clm", "--steps", "2", "--batch-size", "4", "--seq-len", "16",
              "--no-progress", "--no-plot"]
    assert run_cli("finetune", *common, "--data", str(tmp_path / "d"), "--output-dir", str(tmp_path / "a")) == 0
    err = capsys.readouterr().err
    assert "40 train / 10 eval examples" in err, err  # not 45 / 5: the validation file is the eval split
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in rows)
    held = jsonl(texts(5, "other"), tmp_path / "other.jsonl")
    assert run_cli("finetune", *common, "--data", str(tmp_path / "d"), "--eval-data", str(held),
                   "--output-dir", str(tmp_path / "b")) == 0
    assert "/ 5 eval examples" in capsys.readouterr().err
    assert run_cli("finetune", *common, "--data", str(tmp_path / "d" / "train.parquet"), "--eval-fraction", "0",
                   "--output-dir", str(tmp_path / "c")) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "evaluates nothing" in line]
    assert len(said) == 1 and "40 train / 0 eval examples" in err, err
    rows = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    assert rows and not any("eval_loss" in r for r in rows)


# ---------------------------------------------------------------- one-line data errors


def test_chat_data_without_task_sft_says_so(tmp_path, capsys):
    model = F.hf_gpt2_folder(tmp_path / "m")
    capsys.readouterr()  # (the fixture's own bars)
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
            for i in range(12)]
    data = jsonl(rows, tmp_path / "chat.jsonl")
    rc = run_cli("finetune", "--model", str(model), "--data", str(data), "--no-progress", "--output-dir",
                 str(tmp_path / "o"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "looks like chat data: add --task sft" in err and "--text-column" not in err, err
    assert not (tmp_path / "o").exists()


def test_header_only_csv_is_one_line(tmp_path, capsys):
    (tmp_path / "h.csv").write_text("text,label\n")
    with pytest.raises(D.DataError) as e:
        D.load_source(tmp_path / "h.csv")
    assert str(e.value) == f"data {tmp_path / 'h.csv'}: no rows (a header and no rows below it)"
    model = F.hf_gpt2_folder(tmp_path / "m")
    capsys.readouterr()
    rc = run_cli("finetune", "--model", str(model), "--data", str(tmp_path / "h.csv"), "--no-progress",
                 "--output-dir", str(tmp_path / "o"))
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == f"cuboid finetune: error: data {tmp_path / 'h.csv'}: no rows (a header and no rows " \
                              f"below it)", err


# ---------------------------------------------------------------- a failed run's folder


class Fail(TrainerCallback):
    """Raises as step ``at`` begins: a run that fails there (an out-of-memory first step, say)."""

    def __init__(self, at: int):
        self.at = at

    def on_step_begin(self, run, step):
        if step == self.at:
            raise RuntimeError("boom")


@pytest.mark.slow
def test_a_failed_run_leaves_the_folder_as_it_was(tmp_path):
    import cuboid

    model = F.hf_gpt2_folder(tmp_path / "m")
    data = jsonl(texts(40, "t"), tmp_path / "t.jsonl")
    kw = dict(task="clm", steps=3, batch_size=4, seq_len=16, progress=False, plot=False, log_every=100)
    fresh = tmp_path / "runs" / "new"
    with use_backend("torch"), pytest.raises(RuntimeError, match="boom"):
        cuboid.finetune(str(model), str(data), output_dir=str(fresh), callbacks=[Fail(1)], **kw)
    assert not (tmp_path / "runs").exists()  # the folders it made are gone with the run file
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    (kept / "cuboid-run.json").write_text('{"run_id": "earlier"}\n')
    with use_backend("torch"), pytest.raises(RuntimeError, match="boom"):
        cuboid.finetune(str(model), str(data), output_dir=str(kept), callbacks=[Fail(1)], overwrite_output_dir=True,
                        **kw)
    assert sorted(p.name for p in kept.iterdir()) == ["cuboid-run.json", "notes.txt"]
    assert (kept / "cuboid-run.json").read_text() == '{"run_id": "earlier"}\n'
    useful = tmp_path / "useful"
    with use_backend("torch"), pytest.raises(RuntimeError, match="boom"):
        cuboid.finetune(str(model), str(data), output_dir=str(useful), callbacks=[Fail(2)], save_every=1, **kw)
    assert (useful / "checkpoint-1").is_dir() and (useful / "cuboid-run.json").is_file()  # what it wrote stays


# ---------------------------------------------------------------- config keys, threads


def test_a_misspelt_config_key_gets_a_did_you_mean(tmp_path, capsys):
    (tmp_path / "run.toml").write_text('model = "m"\neval_fracton = 0.2\nbatchsize = 8\nzzz = 1\n')
    rc = main(["finetune", "--config", str(tmp_path / "run.toml")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"cuboid finetune: error: --config {tmp_path / 'run.toml'}: unknown key(s) batchsize, "
                               "eval_fracton, zzz; batchsize: did you mean batch_size?; eval_fracton: did you mean "
                               "eval_fraction? (cuboid finetune --help lists the keys as flags)"), err


def test_cpu_threads_decision():
    from cuboid.train.sizes import cpu_threads

    assert cpu_threads({"OMP_NUM_THREADS": "4"}, 64) == (None, None)  # the user's choice stands
    assert cpu_threads({}, 64)[0] == 16                                # capped
    assert cpu_threads({}, 64, local_processes=8)[0] == 8              # the cores shared by the local processes
    assert cpu_threads({}, 2, load=5.0) == (1, "2 cores available, load 5.0")  # a loaded machine: one thread
    assert cpu_threads({}, 2, load=1.0)[0] == 2                        # its own process's load is not others'
    assert cpu_threads({}, 8, quota=2.5)[0] == 2                       # a cgroup's CPU limit
    assert cpu_threads({}, 3, local_processes=4)[0] == 1               # never 0
    assert cpu_threads({}, 4, cap=100)[0] == 4                         # never past the affinity


def test_set_cpu_threads_says_it_in_one_line(monkeypatch):
    import torch

    from cuboid.train.sizes import set_cpu_threads

    before = torch.get_num_threads()
    try:
        assert set_cpu_threads({"OMP_NUM_THREADS": "3"}) is None
        line = set_cpu_threads({})
        n = torch.get_num_threads()
        assert line.startswith(f"cuboid finetune: {n} CPU thread") and "set OMP_NUM_THREADS to choose" in line
        import os

        assert 1 <= n <= len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- helps and listings


def test_prepare_help_lists_every_task_with_rows(capsys):
    from cuboid import tasks

    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    able = [n for n in tasks.names() if hasattr(tasks.get(n), "dataset_rows")]
    assert "dpo" in able
    for name in able:
        assert re.search(rf"--task TASK .*\b{name}\b", out), name


def test_finetune_help_says_each_default_and_choice_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 200, len(out.splitlines())
    assert "(default None)" not in out and "(default False)" not in out
    flat = " ".join(out.split())
    assert flat.count("dapo | grpo | dr_grpo | bnpo | cispo") == 1
    assert flat.count("group | batch | none") == 1 and flat.count("token | sequence") == 1
    assert flat.count("(default 1 each)") == 2  # --reward-weights and --loss-weights, no second default
    usage = out.split("\n\n", 1)[0]
    assert len(usage.splitlines()) <= 2, usage
    for flag in ("--eval-data", "--eval-fraction", "--beta", "--reward", "--config", "--max-restarts"):
        assert flag in out, flag


def test_plans_say_how_many_they_show(capsys):
    assert main(["plans", "--model", "gpt2", "--gpus", "8", "--gpu-memory", "2GB", "--top", "3"]) == 0
    out = capsys.readouterr().out
    shown = re.search(r"\n(\d+) plan\(s\) do not fit \(showing 3 of (\d+); --top N shows more, --json lists all\):", out)
    assert shown and shown.group(1) == shown.group(2) and int(shown.group(1)) > 3, out
    misfits = out.split("do not fit", 1)[1].splitlines()[1:]
    assert len([line for line in misfits if line.startswith("  ")]) == 3, out
    fit = re.search(r"\nshowing 3 of (\d+) plans that fit", out)
    assert fit and int(fit.group(1)) > 3, out


def test_the_metric_axis_says_eval_once():
    from cuboid.train.curves import axis_label

    assert axis_label("eval_rewards/accuracies", evaluated=True) == "eval_rewards/accuracies"
    assert axis_label("perplexity", evaluated=True) == "eval perplexity"
    assert axis_label("reward", evaluated=False) == "reward"


def test_the_tidy_keeps_what_a_restart_needs(tmp_path, monkeypatch):
    from cuboid.train.resume import RUN_FILE, tidied_on_failure, write_run_file

    out = tmp_path / "a" / "b"
    for restarts, left in (("0", False), ("2", True)):
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", restarts)
        with pytest.raises(OSError), tidied_on_failure(out):
            out.mkdir(parents=True, exist_ok=True)
            write_run_file(out, "new")
            raise OSError("out of memory")
        assert (out / RUN_FILE).is_file() == left and (tmp_path / "a").exists() == left


def test_a_run_keeps_the_callers_threads():
    import torch

    from cuboid.train.sizes import set_cpu_threads, threads_kept

    before = torch.get_num_threads()
    with threads_kept():
        torch.set_num_threads(1 if before > 1 else 2)
        set_cpu_threads({})
    assert torch.get_num_threads() == before


def test_only_a_test_split_is_not_trained_and_evaluated_on(tmp_path, capsys):
    import datasets

    only = datasets.DatasetDict({"test": datasets.Dataset.from_list(texts(20, "t"))})
    train, held = D.train_eval_split(only, 0.1, 0)
    assert (len(train), len(held)) == (18, 2)  # a holdout of it, not the split twice
    model = F.hf_gpt2_folder(tmp_path / "m")
    data = jsonl(texts(20, "p"), tmp_path / "p.jsonl")
    capsys.readouterr()
    rc = main(["prepare", "--model", str(model), "--data", str(data), "--output", str(tmp_path / "out"),
               "--eval-fraction", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("cuboid prepare: error: --eval-fraction 0: cuboid prepare writes a validation "
                                      "split") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
