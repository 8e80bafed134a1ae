"""GRPO's reward functions are user code (cuboid.tasks.grpo_rewards): one that hangs fails after its timeout
(``reward_timeout_s``, by default ``--timeout-s``), one that calls ``exit()`` fails the run (exit 2, no ``final/``),
NaN, inf and string rewards are refused naming the function and the row, and a crash shows the user's own
file:line; each in one line, with the step."""
from __future__ import annotations

import json
import time

import pytest

from tests.front.fixtures import hf_qwen2_folder

USER = '''
import time

def crash(prompts, completions, **columns):
    answers = {}
    return [answers["x"] for c in completions]

def exits(prompts, completions, **columns):
    exit(0)

def hangs(prompts, completions, **columns):
    time.sleep(30)
    return [0.0] * len(completions)
'''


def score(fn, **kw):
    from cuboid.tasks.grpo_rewards import score

    return score([fn], [fn.__name__], ["p", "p"], ["a", "b"], [[1], [2]], **kw)


def test_values_are_refused_by_function_and_row():
    from cuboid.tasks.base import TaskError

    for bad, said in ((float("nan"), "returned nan for completion 1"), (float("inf"), "returned inf"),
                      ("0.5", "returned the string '0.5' for completion 1")):
        def f(prompts, completions, **kw):
            return [1.0, bad]

        with pytest.raises(TaskError, match=f"reward function f {said}.* at step 7"):
            score(f, step=7)
    import torch

    def fine(prompts, completions, **kw):
        return [None, torch.tensor(0.5)]

    got = score(fine)
    assert torch.isnan(got[0, 0]) and got[1, 0] == 0.5


def test_hang_exit_and_crash_in_one_line(tmp_path):
    from cuboid.tasks.base import TaskError
    from cuboid.tasks.grpo_rewards import load_reward

    (tmp_path / "user_rewards.py").write_text(USER)
    crash, _ = load_reward(f"{tmp_path / 'user_rewards.py'}:crash")
    exits, _ = load_reward(f"{tmp_path / 'user_rewards.py'}:exits")
    hangs, _ = load_reward(f"{tmp_path / 'user_rewards.py'}:hangs")
    with pytest.raises(TaskError) as e:
        score(crash, step=2)
    assert f"raised KeyError: 'x' ({tmp_path / 'user_rewards.py'}:6) at step 2" in str(e.value)
    with pytest.raises(TaskError, match=r"exits called exit\(0\)"):
        score(exits, step=1)
    t0 = time.perf_counter()
    with pytest.raises(TaskError, match="reward function hangs did not return within 0.5 s at step 3"):
        score(hangs, step=3, timeout_s=0.5)
    assert time.perf_counter() - t0 < 10

    def interrupted(prompts, completions, **kw):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score(interrupted)


@pytest.mark.slow
def test_cli_exit_and_hang_fail_the_run(tmp_path, capsys, monkeypatch):
    """``exit()`` in a reward function: exit 2, one line, no ``final/``; a hanging one with ``--timeout-s 2``:
    exit 2 within seconds, one line naming it and the step."""
    from cuboid.cli import main
    from cuboid.parallel import timeouts

    monkeypatch.setattr(timeouts, "_TIMEOUT_S", [])  # (--timeout-s sets the process's; not the next test's)
    folder = hf_qwen2_folder(tmp_path / "qwen2")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b", "c"] * 4))
    (tmp_path / "user_rewards.py").write_text(USER)
    args = ["finetune", "--model", str(folder), "--task", "grpo", "--data", str(tmp_path / "prompts.jsonl"),
            "--num-generations", "2", "--max-completion-length", "4", "--batch-size", "4", "--steps", "2",
            "--no-progress", "--no-plot"]
    capsys.readouterr()
    assert main(args + ["--reward", f"{tmp_path / 'user_rewards.py'}:exits", "--output-dir",
                        str(tmp_path / "exits")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reward function exits called exit(0)" in err and "at step 1" in err, err
    assert not (tmp_path / "exits" / "final").exists()
    t0 = time.perf_counter()
    assert main(args + ["--reward", f"{tmp_path / 'user_rewards.py'}:hangs", "--timeout-s", "2", "--output-dir",
                        str(tmp_path / "hangs")]) == 2
    assert time.perf_counter() - t0 < 60
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reward function hangs did not return within 2 s at step 1" in err, err


def test_a_reward_function_runs_in_the_main_thread():
    """Reward functions run where they are called from (a run's main thread): signal-based timeouts of their
    own (math_verify's SIGALRM) work there; the bound still holds."""
    import signal
    import threading

    def alarmed(prompts, completions, **kw):
        assert threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGALRM, lambda *a: None)  # what math_verify's timeout does
        signal.signal(signal.SIGALRM, old)
        return [1.0] * len(completions)

    assert score(alarmed, timeout_s=5).tolist() == [[1.0], [1.0]]


def test_a_module_that_fails_on_import_names_its_line(tmp_path):
    from cuboid.tasks.base import TaskError
    from cuboid.tasks.grpo_rewards import load_reward

    (tmp_path / "broken.py").write_text("import os\n\nanswer = undefined_name + 1\n")
    with pytest.raises(TaskError) as e:
        load_reward(f"{tmp_path / 'broken.py'}:fn")
    assert "NameError: name 'undefined_name' is not defined" in str(e.value)
    assert f"({tmp_path / 'broken.py'}:3)" in str(e.value)
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(TaskError, match="importing .*quits.py failed: SystemExit: 3"):
        load_reward(f"{tmp_path / 'quits.py'}:fn")


def _rank_one_fails(prompts, completions, **kw):
    import os

    if os.environ.get("RANK") == "1":
        raise OSError("a file only rank 1 lacks")
    return [1.0] * len(completions)


def _score_on_each_rank():
    import torch.distributed as dist

    from cuboid.parallel.mesh import init_distributed
    from cuboid.tasks.base import TaskError
    from cuboid.tasks.grpo_rewards import score

    init_distributed()
    try:
        score([_rank_one_fails], ["local"], ["p"], ["c"], [[1]], step=3, timeout_s=30)
        out = "scored"
    except TaskError as e:
        out = str(e)
    dist.barrier()  # (every rank gets here: none is left in a collective)
    return out


def test_a_reward_function_failing_on_one_rank_stops_every_rank():
    """Every rank scores the completions with the user's functions; one that fails on one rank alone (its own
    files) ends every rank with a line, rather than leaving the others in the step's next collective."""
    from ..parallel.launch import run_world

    zero, one = run_world(_score_on_each_rank, 2, timeout=120)
    assert "local" in one and "a file only rank 1 lacks" in one, one
    assert "failed on another rank at step 3" in zero, zero
