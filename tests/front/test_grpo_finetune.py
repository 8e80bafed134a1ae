"""``cuboid.finetune(..., task=GRPO(...))`` on a tiny random Qwen2 (tests/front/fixtures.py) with a verifiable
reward over the completion text (the share of its characters that are ``a`` or ``e``), against TRL 1.16's
``GRPOTrainer`` on the same folder, prompts, reward, budget and settings.

- Learning: over 30 steps cuboid's mean reward rises (mean of the last 5 steps minus the first 5) at least half
  as much as TRL's, and TRL's rises (else the comparison says nothing).
- ``completions.jsonl``: each logged reward is the function of the logged text; the advantages are the
  group-normalised rewards (TRL's formula, unbiased std + 1e-4); step 1's logged loss is the dapo aggregate
  of those advantages over the completion tokens (ratio 1: ``-sum_j A_j n_j / sum_j n_j``).
- Two ranks (one 2-rank gloo world): ``dp=2`` step 1 samples the same completions and logs the same reward and
  loss as one device; under tp1d, pp2 and ZeRO-3 a step by hand (``num_iterations=2``) samples the same
  completions and gets the same old log-probs and loss.
- The command line, ``--beta 0.04 --lora`` (and dr_grpo with ``--scale-rewards none``): ``kl`` is 0 at step 1
  (the adapters start at zero) and above 0 after; a reward function of the wrong length stops it (exit 2).
- Resume (GSPO with ``num_iterations=2``): 4 steps, and steps 3-4 resumed from its ``checkpoint-2``, end with
  the same weights.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.front.fixtures import hf_qwen2_folder
from tests.parallel.launch import run_world

STEPS, G, BATCH, LENGTH, LR = 30, 4, 8, 8, 1e-2
PROMPTS = ["alpha beta", "gamma delta epsilon", "zeta", "eta theta", "iota", "kappa lambda", "mu nu", "xi omicron"]


def reward_ae(prompts, completions, **columns):
    """The share of a completion's characters that are ``a`` or ``e``."""
    return [sum(ch in "ae" for ch in c) / max(len(c), 1) for c in completions]


def dataset():
    import datasets

    return datasets.Dataset.from_dict({"prompt": PROMPTS * 4})


def grpo(**options):
    from cuboid.tasks.grpo import GRPO

    return GRPO(reward_funcs=[reward_ae], **{**dict(num_generations=G, max_completion_length=LENGTH), **options})


def finetune(model, out: Path, steps=STEPS, task=None, **options):
    import cuboid

    opts = dict(steps=steps, batch_size=BATCH, lr=LR, output_dir=str(out), overwrite_output_dir=True, progress=False,
                plot=False, log_every=1, warmup=0, schedule="constant", weight_decay=0.0, max_grad_norm=1.0)  # TRL's
    cuboid.finetune(str(model), dataset(), task=task or grpo(log_completions=True), **{**opts, **options})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def lines(out: Path):
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return hf_qwen2_folder(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def ours(qwen2, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    return out, finetune(qwen2, out)


def trl_rewards(folder: Path, out: Path) -> list:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), use_cpu=True, per_device_train_batch_size=BATCH, num_generations=G,
                      max_completion_length=LENGTH, learning_rate=LR, max_steps=STEPS, logging_steps=1, report_to=[],
                      save_strategy="no", lr_scheduler_type="constant", warmup_steps=0, seed=0, disable_tqdm=True,
                      weight_decay=0.0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(folder)), reward_funcs=[reward_ae], args=args,
                          train_dataset=dataset(), processing_class=AutoTokenizer.from_pretrained(str(folder)))
    trainer.train()
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def rise(rewards: list) -> float:
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


def test_reward_rises_at_least_half_as_much_as_trl(qwen2, ours, tmp_path):
    _, rows = ours
    mine = [r["reward"] for r in rows]
    theirs = trl_rewards(qwen2, tmp_path / "trl")
    assert len(mine) == len(theirs) == STEPS
    assert rise(theirs) > 0.05, f"TRL's reward did not rise: {theirs}"
    assert rise(mine) >= 0.5 * rise(theirs), f"cuboid {mine}\nTRL {theirs}"


def test_completions_log_and_metrics(ours):
    out, rows = ours
    logged = lines(out)
    assert len(logged) == STEPS * BATCH
    assert {"step", "prompt", "completion", "completion_ids", "reward", "reward_ae", "advantage"} <= set(logged[0])
    for k in range(0, len(logged), G):
        group = logged[k:k + G]
        assert len({g["step"] for g in group}) == 1 and len({g["prompt"] for g in group}) == 1
        for g in group:
            assert g["reward"] == pytest.approx(reward_ae([g["prompt"]], [g["completion"]])[0], abs=1e-12)
            assert g["reward"] == g["reward_ae"]
        r = torch.tensor([g["reward"] for g in group], dtype=torch.float64)
        want = (r - r.mean()) / (r.std() + 1e-4)
        torch.testing.assert_close(torch.tensor([g["advantage"] for g in group], dtype=torch.float64), want)
    first = [g for g in logged if g["step"] == 1]
    n = torch.tensor([len(g["completion_ids"]) for g in first], dtype=torch.float64)
    a = torch.tensor([g["advantage"] for g in first], dtype=torch.float64)
    assert rows[0]["loss"] == pytest.approx(float(-(a * n).sum() / n.sum()), rel=1e-5, abs=1e-6)
    names = {"reward", "reward_std", "rewards/reward_ae/mean", "rewards/reward_ae/std", "frac_reward_zero_std",
             "loss", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
             "completions/mean_length", "completions/min_length", "completions/max_length",
             "completions/clipped_ratio", "num_tokens"}
    assert names <= set(rows[0]), names - set(rows[0])
    assert rows[0]["clip_ratio/region_mean"] == 0.0  # one iteration: the ratio is 1
    assert rows[0]["completions/max_length"] <= LENGTH and rows[1]["num_tokens"] > rows[0]["num_tokens"]


ROLLOUT_PLANS = ("tp1d", "pp2", "dp=2,zero=3")


def rollout_step(folder: str, plan=None):
    """One GRPO step by hand under ``plan`` (num_iterations 2: the old log-probs come from a forward of their
    own): (completion ids, old log-probs, the step's loss)."""
    import datasets

    import cuboid
    from cuboid.data.formats import load_tokenizer

    tokenizer = load_tokenizer(folder)
    model = cuboid.load(folder, plan, seed=0)
    task = grpo(num_iterations=2)
    rows = task.rows(datasets.Dataset.from_dict({"prompt": PROMPTS[:2]}), tokenizer=tokenizer)
    task.with_model(model, [rows, None])
    batch = task.before_step({"index": rows["index"]}, 1, tokenizer=tokenizer, seed=0)
    result = cuboid.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, task=task)
    return task.rollout["completion_ids"], batch["old_logps"], result.loss


def two_ranks(folder: str, out: str):
    """The 2-rank world's jobs: one dp=2 fine-tune step, then a step by hand under the other plans."""
    rows = finetune(Path(folder), Path(out), steps=1, plan="dp")
    logged = lines(Path(out)) if Path(out, "completions.jsonl").exists() else None  # (rank 0 writes it)
    return rows[0], logged, [rollout_step(folder, plan) for plan in ROLLOUT_PLANS]


def test_two_ranks_sample_and_step_as_one_device(qwen2, ours, tmp_path):
    """dp=2 step 1 samples the same completions and logs the same reward and loss as one device; under tp1d,
    pp2 and ZeRO-3 the rollouts, old log-probs and loss of a step by hand are one device's."""
    out, rows = ours
    row, logged, by_plan = run_world(two_ranks, 2, str(qwen2), str(tmp_path / "dp2"), timeout=600)[0]
    want = [g for g in lines(out) if g["step"] == 1]
    assert [g["completion_ids"] for g in logged] == [g["completion_ids"] for g in want]
    assert row["reward"] == pytest.approx(rows[0]["reward"], rel=1e-9)
    assert row["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5, abs=1e-7)
    ids, old, loss = rollout_step(str(qwen2))
    for plan, (got_ids, got_old, got_loss) in zip(ROLLOUT_PLANS, by_plan):
        assert got_ids == ids, plan
        torch.testing.assert_close(got_old, old, rtol=1e-5, atol=1e-5, msg=plan)
        assert got_loss == pytest.approx(loss, rel=1e-5, abs=1e-7), plan


REWARDS = """
def reward_ae(prompts, completions, completion_ids=None, **columns):
    return [sum(ch in "ae" for ch in c) / max(len(c), 1) for c in completions]

def short(prompts, completions, **columns):
    return [1.0]
"""


def test_cli_beta_with_lora_logs_kl(qwen2, tmp_path, capsys):
    """``cuboid finetune --task grpo --reward FILE:FN --beta 0.04 --lora ...`` (dr_grpo, scale_rewards none): kl
    0 at step 1 (the adapters start at zero), above 0 after; a reward function of the wrong length stops the
    run with exit 2 and one sentence naming it."""
    from cuboid.cli import main

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    (tmp_path / "rewards.py").write_text(REWARDS)
    args = ["finetune", "--model", str(qwen2), "--task", "grpo", "--data", str(tmp_path / "prompts.jsonl"),
            "--num-generations", str(G), "--max-completion-length", str(LENGTH), "--batch-size", str(BATCH),
            "--lr", str(LR), "--log-every", "1", "--no-progress", "--no-plot"]
    code = main(args + ["--reward", f"{tmp_path / 'rewards.py'}:reward_ae", "--steps", "3", "--beta", "0.04",
                        "--loss-type", "dr_grpo", "--scale-rewards", "none", "--lora", "r=4,alpha=8,targets=attn+mlp",
                        "--output-dir", str(tmp_path / "kl")])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kl"] == 0.0
    assert all(r["kl"] > 0 for r in rows[1:]), [r["kl"] for r in rows]
    capsys.readouterr()
    assert main(args + ["--reward", f"{tmp_path / 'rewards.py'}:short", "--steps", "1", "--output-dir",
                        str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "reward function short returned 1 rewards for 8 completions" in err


def test_resume_is_exact_gspo(qwen2, tmp_path):
    from safetensors.torch import load_file

    task = dict(importance_sampling_level="sequence", num_iterations=2)
    finetune(qwen2, tmp_path / "whole", steps=4, task=grpo(**task), save_every=2, keep=2)
    rows = finetune(qwen2, tmp_path / "part", steps=4, task=grpo(**task),
                    resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert [r["step"] for r in rows] == [3, 4]
    whole, part = ({k: v for f in sorted((tmp_path / run / "final").glob("*.safetensors")) for k, v in
                    load_file(str(f)).items()} for run in ("whole", "part"))
    assert whole
    assert whole.keys() == part.keys()
    for k in whole:
        torch.testing.assert_close(part[k], whole[k], rtol=0, atol=0)
