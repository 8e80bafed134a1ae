"""GRPO: cuboid's task against TRL 1.16's ``GRPOTrainer`` on one machine, the same policy, prompts, reward and
hyper-parameters, in one run.

The policy is a small random Qwen2-shaped model (a Hugging Face folder both load: grouped-query attention,
q/k/v biases, tied embeddings; a byte-level BPE tokenizer trained on the tests' sentences), the reward the
share of a completion's characters that are ``a`` or ``e`` (a Python function over the text). cuboid runs its
own step as ``cuboid finetune --task grpo`` does (the task's ``before_step``: rollouts with the KV cache, then
``cuboid.train_step``); TRL runs ``trainer.train()`` with ``transformers.generate`` rollouts (no vLLM on CPU).
Each step is split into generation (sampling, scoring, advantages; TRL's ``_generate_and_score_completions``)
and training (forward, backward, optimizer step), both timed with ``time.perf_counter``.

Prints a table (per-step generation and training time, rollout tokens/s, the mean reward of the first and last
five steps) and the two reward curves, and writes ``bench/grpo.json``.

    python bench/grpo.py [--steps 20] [--batch 16] [--generations 4] [--length 32] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ["alpha beta", "gamma delta epsilon", "zeta", "eta theta", "iota", "kappa lambda", "mu nu", "xi omicron",
           "pi rho sigma", "tau upsilon", "phi chi", "psi omega"]


def reward_ae(prompts, completions, **columns):
    """The share of a completion's characters that are ``a`` or ``e``."""
    return [sum(ch in "ae" for ch in c) / max(len(c), 1) for c in completions]


def policy_folder(folder: Path, dim: int, layers: int) -> Path:
    import transformers as T

    from tests.front.fixtures import bpe_tokenizer

    tok = bpe_tokenizer(folder)
    cfg = T.Qwen2Config(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=dim // 32,
                        num_key_value_heads=max(dim // 64, 1), intermediate_size=dim * 2, vocab_size=len(tok),
                        max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.Qwen2ForCausalLM(cfg).save_pretrained(str(folder))
    return folder


def dataset(n: int):
    import datasets

    return datasets.Dataset.from_dict({"prompt": (PROMPTS * (n // len(PROMPTS) + 1))[:n]})


def run_cuboid(folder: Path, a) -> dict:
    import cuboid
    from cuboid.data.formats import GlobalBatches, load_tokenizer
    from cuboid.tasks.grpo import GRPO
    from cuboid.train.loop import make_optimizer

    tokenizer = load_tokenizer(str(folder))
    model = cuboid.load(str(folder), seed=0)
    task = GRPO(reward_funcs=[reward_ae], num_generations=a.generations, max_completion_length=a.length)
    rows = task.rows(dataset(a.prompts), tokenizer=tokenizer)
    task.with_model(model, [rows, None])
    batches = GlobalBatches(rows, a.batch // a.generations, seed=0)
    opt = make_optimizer("adamw", model, a.lr, 0.0)
    gen, train, tokens, rewards = [], [], 0, []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        batch = task.before_step(batches.next(), step, tokenizer=tokenizer, seed=0)
        t1 = time.perf_counter()
        cuboid.train_step(model, opt, batch, task=task, max_grad_norm=1.0)  # TRL's default clipping
        t2 = time.perf_counter()
        gen.append(t1 - t0)
        train.append(t2 - t1)
        tokens += sum(len(c) for c in task.rollout["completion_ids"])
        rewards.append(task.rollout["metrics"]["reward"])
    return summary(gen, train, tokens, rewards)


def run_trl(folder: Path, a) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, per_device_train_batch_size=a.batch,
                      num_generations=a.generations, max_completion_length=a.length, learning_rate=a.lr,
                      max_steps=a.steps, logging_steps=1, report_to=[], save_strategy="no",
                      lr_scheduler_type="constant", warmup_steps=0, seed=0, disable_tqdm=True, weight_decay=0.0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(folder)), reward_funcs=[reward_ae],
                          args=args, train_dataset=dataset(a.prompts),
                          processing_class=AutoTokenizer.from_pretrained(str(folder)))
    gen, steps, tokens = [], [], [0]
    inner = trainer._generate_and_score_completions

    def timed(inputs):
        t = time.perf_counter()
        out = inner(inputs)
        gen.append(time.perf_counter() - t)
        tokens[0] += int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            steps.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return summary(gen, [s - g for s, g in zip(steps, gen)], tokens[0], rewards)


def summary(gen: list, train: list, tokens: int, rewards: list) -> dict:
    later = slice(1, None)  # the first step warms caches up
    g, t = sum(gen[later]) / len(gen[later]), sum(train[later]) / len(train[later])
    return {"generation_s": g, "training_s": t, "step_s": g + t, "rollout_tokens_per_s": tokens / sum(gen),
            "reward_first5": sum(rewards[:5]) / 5, "reward_last5": sum(rewards[-5:]) / 5, "rewards": rewards}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="completions a step")
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--length", type=int, default=32, help="max_completion_length")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "bench" / "grpo.json"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = policy_folder(Path(tmp), a.dim, a.layers)
        results = {"cuboid": run_cuboid(folder, a), "trl": run_trl(folder, a)}
    c, t = results["cuboid"], results["trl"]
    print(f"GRPO, Qwen2-shaped policy dim {a.dim} x {a.layers} layers, {a.steps} steps of {a.batch} completions "
          f"(G {a.generations}, up to {a.length} tokens), torch threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'':8} {'gen s/step':>11} {'train s/step':>13} {'step s':>8} {'rollout tok/s':>14} {'reward 1-5':>11} "
          f"{'reward last 5':>14}")
    for name, r in results.items():
        print(f"{name:8} {r['generation_s']:11.3f} {r['training_s']:13.3f} {r['step_s']:8.3f} "
              f"{r['rollout_tokens_per_s']:14.0f} {r['reward_first5']:11.3f} {r['reward_last5']:14.3f}")
    print(f"cuboid's step is {t['step_s'] / c['step_s']:.2f}x TRL's speed (generation "
          f"{t['generation_s'] / c['generation_s']:.2f}x, training {t['training_s'] / c['training_s']:.2f}x); "
          f"reward rise cuboid "
          f"{c['reward_last5'] - c['reward_first5']:+.3f}, TRL {t['reward_last5'] - t['reward_first5']:+.3f}")
    for name, r in results.items():
        print(f"{name} rewards: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    Path(a.out).write_text(json.dumps({"args": vars(a), **results}, indent=1))


if __name__ == "__main__":
    main()
