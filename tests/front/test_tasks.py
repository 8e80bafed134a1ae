"""The task seam: tasks are objects (cuboid/tasks/), spelled with their options, and a user's own task trains.

The generated plan test (tests/parallel/test_plans.py) runs a user's task (plan_tasks.WeightedLM) under every
plan it enumerates, turned by the plan's index; here: the room keeps every task's name, the spelling of options,
and one device's step and ``cuboid.finetune`` with a user's task against plain torch.
"""
from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest
import torch

import cuboid
from cuboid import tasks
from cuboid.kernels import use_backend
from cuboid.train.config import FinetuneConfig, checked

from ..parallel.plan_tasks import WeightedLM, task_batch
from . import fixtures as F

ROOT = Path(__file__).resolve().parents[2]
FLOORS = ("cuboid", "zoo", "parallel", "kernels")


def task_literals(source: str, names: set) -> list:
    """(line, text) of every string literal in ``source`` that is one of ``names`` (a branch on a task's name
    needs one)."""
    return [(node.lineno, node.value) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_no_task_name_outside_the_tasks_room():
    names = set(tasks.names()) | {a for n in tasks.names() for a in tasks.get(n).aliases}
    heads = {h for n in tasks.names() for h in tasks.get(n).heads}  # a head may share a task's name (mlm)
    found = []
    for floor in FLOORS:
        for path in sorted((ROOT / floor).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("cuboid", "tasks"):
                continue
            looked_for = names if floor == "cuboid" else names - heads  # below the door: heads are zoo's words
            found += [f"{rel}:{line} {text!r}" for line, text in task_literals(path.read_text(), looked_for)]
    assert not found, "task names outside cuboid/tasks/: " + ", ".join(found)
    assert len(names) >= 6 and "mlm" in heads
    probe = 'def prep(task):\n    if task == "sft":\n        return 1\n'  # what the rule exists to catch
    assert task_literals(probe, names) == [(2, "sft")]


def test_task_options_are_spelled_like_plans():
    sft = tasks.parse("sft,train_on_prompt=true,template=alpaca")
    assert isinstance(sft, tasks.SFT) and sft.options.train_on_prompt and sft.options.template == "alpaca"
    assert sft.describe() == "sft,train_on_prompt=true,template=alpaca"
    assert tasks.resolve({"name": "sft", "train_on_prompt": True}).describe() == "sft,train_on_prompt=true"
    assert tasks.resolve("clm").name == "causal" and tasks.resolve(tasks.MaskedLM).name == "mlm"
    for spec, message in (("sft,train_on_promt=true", "task sft has no option train_on_promt; its options: "
                                                      "train_on_prompt, template"),
                          ("sft,train_on_prompt=maybe", "option train_on_prompt takes true or false"),
                          ("sft,train_on_prompt", "'train_on_prompt' is not option=value"),
                          ("ppo", "unknown task 'ppo'; tasks: causal, sft, mlm, grpo, seqcls, imgcls, dpo, reward"),
                          ("sft,template=vicuna", "unknown --template 'vicuna'")):
        with pytest.raises(ValueError, match=message):
            tasks.resolve(spec)
    with pytest.raises(ValueError, match="task sft: option train_on_prompt is given twice"):
        tasks.parse("sft,train_on_prompt=true", train_on_prompt=False)
    assert tasks.for_model("vit", "cls").name == "imgcls" and tasks.for_model("bert", "cls").name == "seqcls"
    with pytest.raises(ValueError, match="task seqcls does not fit the vit model with head 'cls' .it does imgcls"):
        tasks.for_model("vit", "cls", "seqcls")
    with pytest.raises(ValueError, match="task WeightedLM does not fit the bert model"):
        tasks.for_model("bert", "mlm", WeightedLM())
    # the SFT flags are spellings of the task's options; a flag of another task's option is refused
    cfg = checked(FinetuneConfig(task="sft,template=alpaca", train_on_prompt=True))
    assert cfg.task.describe() == "sft,train_on_prompt=true,template=alpaca"
    with pytest.raises(ValueError, match="--train-on-prompt apply to --task sft, not causal"):
        checked(FinetuneConfig(task="causal", train_on_prompt=True))


def test_a_config_file_task_table_and_the_task_help(tmp_path, capsys):
    from cuboid.cli import main
    from cuboid.cli.finetune import read_config_file

    path = tmp_path / "run.toml"
    path.write_text('[finetune]\nsteps = 2\n\n[finetune.task]\nname = "sft"\ntrain_on_prompt = true\n')
    values = read_config_file(str(path))
    assert checked(FinetuneConfig(**values)).task.describe() == "sft,train_on_prompt=true"
    with pytest.raises(SystemExit) as e:
        main(["finetune", "--task", "sft", "--help"])
    assert e.value.code == 0
    help_ = capsys.readouterr().out
    assert help_.startswith("task sft: ") and "train_on_prompt=false" in help_ and "chat_template=none" in help_


def _manual_loss(model, batch):
    """WeightedLM's loss of ``batch`` on one device from the whole logits in float64, and its count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = torch.log_softmax(logits[:, :-1].double(), -1)
    labels = batch["labels"][:, 1:]
    trained = labels != -100
    picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    weights = batch["weights"][:, 1:].double() * trained
    return -(picked * weights).sum(), int(trained.sum()), float(weights.sum())


def test_a_users_task_trains_through_train_step_as_plain_torch():
    with use_backend("torch"):
        model = cuboid.load("gpt-debug", seed=0).train()
        ref = copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 9:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[2, :5] = -100
        batch = task_batch("weighted", {"input_ids": ids, "attention_mask": mask, "labels": labels})
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        result = cuboid.train_step(model, opt, batch, task=WeightedLM(), microbatches=2)
        total, count, weight = _manual_loss(ref, batch)
        (total / count).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.5 * p.grad
    assert result.targets == count and abs(result.loss - float(total.detach()) / count) < 1e-6 * abs(result.loss)
    assert abs(result.metrics["weight"] - weight / count) < 1e-9
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q.to(p.dtype), rtol=1e-5, atol=1e-6), name


class DoubledCausal(tasks.Causal):
    """Causal LM on plain text with every token weighed 2 (a user's task: its own rows, target and loss)."""

    name = ""  # not registered: passed as an object
    own_loss = True
    targets = ("weights",)
    forward_kwargs = {"logprobs": True}

    def rows(self, ds, **prep):
        rows = super().rows(ds, **prep)
        return dict(rows, weights=torch.full(rows["input_ids"].shape, 2.0))

    def count(self, batch, model=None):
        return int((batch["labels"][:, 1:] != -100).sum())

    def loss(self, out, batch):
        trained = batch["labels"][:, 1:] != -100
        return -(out.token_logps * batch["weights"][:, 1:] * trained).sum(), {}


def test_a_users_task_trains_through_cuboid_finetune(tmp_path):
    import datasets

    data = tmp_path / "text.jsonl"
    datasets.Dataset.from_dict({"text": [t for t, _ in F.sentences(60)]}).to_json(str(data))
    model = F.hf_gpt2_folder(tmp_path / "gpt")
    common = dict(steps=2, batch_size=4, seq_len=32, eval_every=2, progress=False, plot=False, lr=1e-3)
    plain = cuboid.finetune(str(model), str(data), output_dir=str(tmp_path / "plain"), **common)
    doubled = cuboid.finetune(str(model), str(data), output_dir=str(tmp_path / "doubled"), task=DoubledCausal(),
                              **common)
    rows = {k: [json.loads(line) for line in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("plain", "doubled")}
    # step 1 is the same model on the same batch: the user's loss is twice the causal LM's
    assert abs(rows["doubled"][0]["loss"] - 2 * rows["plain"][0]["loss"]) < 1e-5 * rows["plain"][0]["loss"]
    assert plain["task"] == "causal" and doubled["task"] == "DoubledCausal"
    assert abs(doubled["eval_loss"] / plain["eval_loss"] - 2) < 0.2  # its eval loss is its own loss too
