"""GRPO before and after its steps: every prompt is checked before the first step (an empty one, or one whose
tokens and ``max_completion_length`` pass the model's positions, is refused naming its row); every prompt trains
unless an eval fraction is asked for (TRL's default), and then the eval runs (the mean reward of greedy
completions, ``eval_reward``); the ``done:`` line has the reward; the plot's reward has a moving mean beside
the raw curve; a collapsing run (its entropy rising, degenerate completions) is warned of once."""
from __future__ import annotations

import json

import pytest
import torch

from tests.front.fixtures import hf_qwen2_folder
from tests.front.test_grpo_finetune import BATCH, G, LR, PROMPTS, grpo


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return hf_qwen2_folder(tmp_path_factory.mktemp("qwen2"))  # 64 positions


def run(qwen2, out, prompts, steps=2, **options):
    import datasets

    import cuboid

    opts = dict(steps=steps, batch_size=BATCH, lr=LR, output_dir=str(out), progress=False, plot=False, log_every=1,
                warmup=0)
    return cuboid.finetune(str(qwen2), datasets.Dataset.from_dict({"prompt": prompts}), task=grpo(),
                           **{**opts, **options})


def test_prompts_are_checked_before_any_step(qwen2, tmp_path):
    from cuboid.tasks.base import TaskError

    long = " ".join(["alpha beta gamma"] * 40)
    with pytest.raises(TaskError, match=r"prompt 5 of the train split \('alpha beta gamma alpha.*'\) has \d+ "
                                        r"tokens, which with max_completion_length 8 pass the model's 64 positions"):
        run(qwen2, tmp_path / "long", PROMPTS[:5] + [long] + PROMPTS[5:])
    assert not (tmp_path / "long" / "metrics.jsonl").exists() and not list((tmp_path / "long").glob("checkpoint-*"))
    with pytest.raises(TaskError, match=r"prompt 2 of the train split \(''\) has no tokens"):
        run(qwen2, tmp_path / "empty", PROMPTS[:2] + [""] + PROMPTS[2:])


@pytest.mark.slow
def test_every_prompt_trains_and_an_asked_eval_runs(qwen2, tmp_path, capsys):
    summary = run(qwen2, tmp_path / "all", PROMPTS * 4, steps=2)
    err = capsys.readouterr().err
    assert "32 train / 0 eval examples" in err
    done = err.strip().splitlines()[-1]
    assert done.startswith("done:") and f"reward {summary['reward']:.4f}" in done
    rows = [json.loads(x) for x in (tmp_path / "all" / "metrics.jsonl").read_text().splitlines()]
    assert summary["reward"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    assert not any("eval_reward" in r for r in rows)

    summary = run(qwen2, tmp_path / "eval", PROMPTS * 4, steps=2, eval_fraction=0.25, eval_every=1)
    err = capsys.readouterr().err
    assert "24 train / 8 eval examples" in err
    rows = [json.loads(x) for x in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["eval_reward"] <= 1.0 for r in rows) and "eval_reward" in summary
    assert "eval_reward" in err.strip().splitlines()[-1]


def test_greedy_eval_reward_is_the_reward_of_the_greedy_completions(qwen2):
    """GRPO.evaluate: the reward function of the greedy completions of the eval prompts (as generate gives)."""
    import datasets

    import cuboid
    from cuboid.data.formats import load_tokenizer
    from tests.front.test_grpo_finetune import reward_ae

    tokenizer = load_tokenizer(str(qwen2))
    model = cuboid.load(str(qwen2), seed=0)
    task = grpo()
    rows = task.rows(datasets.Dataset.from_dict({"prompt": PROMPTS[:3]}), tokenizer=tokenizer)
    _, evals = task.with_model(model, [rows, rows])
    got = task.evaluate(model, evals, tokenizer=tokenizer)
    want = []
    for p in PROMPTS[:3]:
        ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        new = new[:new.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in new else new
        want.append(reward_ae([p], [tokenizer.decode(new, skip_special_tokens=True)])[0])
    assert got["eval_reward"] == pytest.approx(sum(want) / 3, abs=1e-12)


def test_collapse_is_warned_of_once(capsys):
    from cuboid.tasks.rollout import collapse_note

    assert collapse_note(0.3, [0.28, 0.3, 0.29], [[1, 2, 3, 4] * 10]) is None
    assert "entropy rose to 1 from 0.29" in collapse_note(1.0, [0.28, 0.3, 0.29], [])
    assert "93% of their tokens repeat" in collapse_note(0.3, [0.3], [[7] * 20 + [1, 2] + [7] * 20], ["aaaa"])
    task = grpo()
    for step, entropy in enumerate([0.28, 0.3, 0.29, 0.5, 1.0, 1.1], 1):
        task.watch({"entropy": entropy}, step, True)
    err = capsys.readouterr().err
    assert err.count("warning: step 5: the policy may be collapsing: the entropy rose to 1 from 0.29") == 1, err
    assert err.count("warning") == 1


def test_plot_has_a_moving_mean_beside_the_raw_reward(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from cuboid.train.curves import plot_curves

    rewards = [0.1 * (i % 3) + 0.01 * i for i in range(40)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": 0.0, "reward": r}) + "\n"
                                                   for i, r in enumerate(rewards)))
    seen = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: seen.setdefault("axes", fig.axes))
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png", "reward")
    lines = {line.get_label(): list(line.get_ydata()) for line in seen["axes"][1].get_lines()}
    assert lines["reward"] == rewards
    smooth = lines["reward, moving mean of 4 steps"]
    assert smooth[-1] == pytest.approx(sum(rewards[-4:]) / 4) and smooth[0] == rewards[0]


def beta_rows(folder: str, out: str, plan=None) -> list:
    """3 steps of GRPO with ``beta`` 0.04 and no LoRA (the loop's frozen reference copy): the metrics rows."""
    from pathlib import Path

    from tests.front.test_grpo_finetune import finetune

    return finetune(Path(folder), Path(out), steps=3, task=grpo(beta=0.04), plan=plan)


@pytest.mark.slow
def test_beta_without_lora_keeps_a_frozen_reference(qwen2, tmp_path):
    """``beta`` > 0 on a full fine-tune (TRL's reference model): kl 0 at step 1 (the policy is the reference),
    above 0 after; under ``dp=2,zero=3`` (the reference sharded as the policy) the same kl and loss."""
    from tests.parallel.launch import run_world

    rows = beta_rows(str(qwen2), str(tmp_path / "one"))
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert all(r["kl"] > 1e-6 for r in rows[1:]), [r["kl"] for r in rows]
    sharded = run_world(beta_rows, 2, str(qwen2), str(tmp_path / "z3"), "dp=2,zero=3", timeout=600)[0]
    for a, b in zip(rows, sharded):
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-4, abs=1e-7)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)


def eval_rows(folder: str, out: str, plan=None) -> list:
    """2 steps with 7 of the prompts held out (an odd count: dp=2 pads them), evaluated after each step."""
    from pathlib import Path

    from tests.front.test_grpo_finetune import finetune

    return finetune(Path(folder), Path(out), steps=2, task=grpo(), plan=plan, eval_fraction=7 / 32, eval_every=1)


@pytest.mark.slow
def test_eval_under_dp2_is_one_devices(qwen2, tmp_path):
    from tests.parallel.launch import run_world

    one = eval_rows(str(qwen2), str(tmp_path / "one"))
    two = run_world(eval_rows, 2, str(qwen2), str(tmp_path / "dp2"), "dp", timeout=600)[0]
    for a, b in zip(one, two):
        assert b["eval_reward"] == pytest.approx(a["eval_reward"], abs=1e-9)
        assert b["eval_completions/mean_length"] == a["eval_completions/mean_length"]
