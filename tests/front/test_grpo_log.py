"""GRPO's completions log and reward paths: a cut-off last line of ``completions.jsonl`` (a kill mid-append) is
dropped on resume with a warning naming the file (the resume goes on), a bad line before the end is one line
naming file:line; the log is cut in place a line at a time; ``--reward`` paths holding ':' or ';' load (parsed
from the right)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.front.fixtures import hf_qwen2_folder
from tests.front.test_grpo_finetune import BATCH, finetune, grpo, lines


def write(path: Path, steps, tail: str = "") -> None:
    path.write_text("".join(json.dumps({"step": s, "completion": "x" * s}) + "\n" for s in steps) + tail)


def test_cut_log(tmp_path, capsys):
    from cuboid.tasks.base import TaskError
    from cuboid.tasks.rollout import cut_log

    log = tmp_path / "completions.jsonl"
    write(log, [1, 1, 2, 3, 3], tail='{"step": 4, "compl')
    cut_log(log, 3)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 1, 2]
    write(log, [1, 2], tail='{"step": 2, "compl')
    cut_log(log, 5)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2]
    assert f"warning: {log}: dropped its cut-off last line 3" in capsys.readouterr().err
    write(log, [1], tail='{"step": 2}')  # whole, its newline not written: kept, the newline added
    cut_log(log, 5)
    assert log.read_text().splitlines() == [json.dumps({"step": 1, "completion": "x"}), '{"step": 2}']
    assert log.read_text().endswith("\n")
    log.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(TaskError, match=f"{log}:2: not a completions log line"):
        cut_log(log, 5)


@pytest.mark.slow
def test_resume_after_a_cut_off_completions_line(tmp_path):
    qwen2 = hf_qwen2_folder(tmp_path / "qwen2")
    finetune(qwen2, tmp_path / "run", steps=4, task=grpo(log_completions=True), save_every=2, keep=2)
    with open(tmp_path / "run" / "completions.jsonl", "a") as f:
        f.write('{"step": 5, "prompt": "alpha be')  # a kill mid-append
    rows = finetune(qwen2, tmp_path / "run", steps=4, task=grpo(log_completions=True), overwrite_output_dir=False,
                    resume=str(tmp_path / "run" / "checkpoint-2"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [g["step"] for g in lines(tmp_path / "run")] == [s for s in (1, 2, 3, 4) for _ in range(BATCH)]


def test_reward_paths_with_colon_and_semicolon(tmp_path):
    from cuboid.tasks.grpo import GRPO

    folder = tmp_path / "my:rewards;v2"
    folder.mkdir()
    (folder / "r.py").write_text("def fn(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    (folder / "s.py").write_text("def other(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    task = GRPO(reward=[f"{folder / 'r.py'}:fn;{folder / 's.py'}:other"])
    assert task.reward_names == ["fn", "other"]
    assert GRPO(reward=task.options.reward).reward_names == ["fn", "other"]  # the record read back
    assert GRPO(reward=f"{folder / 'r.py'}:fn").reward_names == ["fn"]


def test_a_resume_cuts_the_completions_log_without_reading_it_whole(tmp_path, monkeypatch):
    """Issue 65, item 5: the first write after a resume keeps the log's earlier steps by reading it a line at a
    time (the whole log was read into memory: ``Path.read_text``), so a large log costs a line."""
    import json
    import pathlib

    import torch

    from cuboid import tasks

    log = tmp_path / "completions.jsonl"
    log.write_text("".join(json.dumps({"step": s, "completion": "x" * 1000}) + "\n" for s in (1, 1, 2, 3, 4)))
    task = tasks.get("grpo")()
    task.reward_names = []
    task.rollout = {"step": 3, "texts": ["a"], "prompts": ["p"], "completion_ids": [[1]],
                    "rewards": torch.zeros(1), "per_func": torch.zeros(1, 0), "advantages": torch.zeros(1)}

    def whole(*a, **k):
        raise AssertionError("the completions log was read whole")

    monkeypatch.setattr(pathlib.Path, "read_text", whole)
    monkeypatch.setattr(pathlib.Path, "read_bytes", whole)
    task.write_completions(tmp_path)
    monkeypatch.undo()
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines()]
    assert steps == [1, 1, 2, 3], steps
