"""The ``dpo`` task's loss family and metrics against TRL 1.16's own ``DPOTrainer._compute_loss`` on fixed
per-token log-probabilities (no model: TRL's method runs on a stand-in trainer whose model returns them).

TRL lays a batch out as [chosen rows..., rejected rows...]; cuboid interleaves them (row 2i chosen, 2i + 1
rejected, :mod:`cuboid.data.pairs`): the same numbers are fed in each layout. The task's loss is a sum over
pairs (the step divides by the step's pairs), TRL's a mean: compared as sum / P, and so are the metric sums.
"""
import types
from collections import defaultdict

import pytest
import torch

from cuboid.tasks import TaskError, get
from cuboid.tasks.dpo_loss import LOSS_TYPES

P, T = 5, 11


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * P, T, dtype=torch.long)  # TRL's completion mask, [chosen..., rejected...]
    for i in range(2 * P):
        mask[i, 2 + i % 3:T - (i % 2) - (i % 4 == 3)] = 1
    token_logps = -torch.rand(2 * P, T - 1, generator=g, dtype=torch.float64).float() * 2 * mask[:, 1:]
    ref_c = token_logps[:P].sum(1) + torch.randn(P, generator=g) * 3
    ref_r = token_logps[P:].sum(1) + torch.randn(P, generator=g) * 3
    return token_logps, mask, ref_c, ref_r


def trl(loss_types, weights, beta, smoothing, token_logps, mask, ref_c, ref_r, tau=0.05):
    """TRL's loss and eval metrics of one batch, from its own method on a stand-in trainer."""
    from trl.trainer.dpo_trainer import DPOTrainer

    B = mask.shape[0]
    acc = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x)
    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    fake = types.SimpleNamespace(
        model=types.SimpleNamespace(training=False), accelerator=acc, aux_loss_enabled=False,
        precompute_ref_logps=True, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=loss_types,
        loss_weights=weights, beta=beta, label_smoothing=smoothing, args=types.SimpleNamespace(discopop_tau=tau),
        use_weighting=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1)
    out = types.SimpleNamespace(log_probs=token_logps, entropy=torch.zeros(B, T - 1),
                                mean_logits=torch.zeros(B, T - 1), is_top1=torch.zeros(B, T - 1, dtype=torch.bool))
    inputs = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.ones(B, T, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = DPOTrainer._compute_loss(fake, lambda **kw: out, inputs, False)
    return float(loss), {k: v[-1] for k, v in metrics["eval"].items()}


def ours(task, token_logps, mask, ref_c, ref_r):
    """The task's (loss / P, {metric: sum / P}) of the same numbers, interleaved."""
    order = torch.stack([torch.arange(P), torch.arange(P) + P], 1).reshape(-1)  # chosen 0, rejected 0, ...
    ids = torch.arange(2 * P * T).reshape(2 * P, T) % 50
    labels = torch.where(mask == 1, ids, -100)[order]
    batch = {"input_ids": ids[order], "attention_mask": torch.ones(2 * P, T, dtype=torch.long), "labels": labels,
             "ref_logps": torch.stack([ref_c, ref_r], 1).reshape(-1)}
    assert task.count(batch) == P
    loss, sums = task.loss(types.SimpleNamespace(token_logps=token_logps[order]), batch)
    return float(loss) / P, {k: float(v) / P for k, v in sums.items()}


CASES = [(k, None, 0.0) for k in LOSS_TYPES if k != "exo_pair"] + [
    ("exo_pair", None, 0.1), ("robust", None, 0.2), ("aot", None, 0.1), ("aot_unpaired", None, 0.15),
    ("sigmoid+bco_pair+sft", "0.8+0.2+1.0", 0.0), ("ipo+hinge", None, 0.0)]


@pytest.mark.parametrize("loss_type,weights,smoothing", CASES, ids=[f"{k}-{s}" for k, _, s in CASES])
def test_loss_and_metrics_equal_trl(loss_type, weights, smoothing):
    data = _data()
    beta = 0.3
    kinds = loss_type.split("+")
    w = [float(x) for x in weights.split("+")] if weights else [1.0] * len(kinds)
    want, want_metrics = trl(kinds, w, beta, smoothing, *data)
    task = get("dpo")(beta=beta, loss_type=loss_type, loss_weights=weights, label_smoothing=smoothing)
    got, metrics = ours(task, *data)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    for key, value in metrics.items():
        assert value == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    assert sorted(metrics) == sorted(k for k in want_metrics if k.startswith(("rewards/", "logps/")))


def test_gradient_flows_to_the_token_logps_and_odd_rows_are_refused():
    token_logps, mask, ref_c, ref_r = _data(1)
    task = get("dpo")()
    x = token_logps.clone().requires_grad_(True)
    order = torch.stack([torch.arange(P), torch.arange(P) + P], 1).reshape(-1)
    labels = torch.where(mask == 1, 1, -100)[order]
    batch = {"input_ids": labels.clamp(min=0), "labels": labels, "ref_logps": torch.stack([ref_c, ref_r], 1).reshape(-1)}
    task.loss(types.SimpleNamespace(token_logps=x[order]), batch)[0].backward()
    assert x.grad.abs().sum() > 0 and torch.all(x.grad[:P].sum(1) < 0)  # sigmoid: chosen up
    with pytest.raises(ValueError, match="even number of rows"):
        task.count({k: v[:3] for k, v in batch.items()})


@pytest.mark.parametrize("spec,match", [("dpo,loss_type=nope", "unknown DPO loss type nope"),
                                        ("dpo,beta=0", "beta must be positive"),
                                        ("dpo,loss_type=exo_pair", "needs label_smoothing"),
                                        ("dpo,loss_type=ipo+sft,loss_weights=1", "1 weights for 2 loss types"),
                                        ("dpo,label_smoothing=0.5", r"in \[0, 0.5\)")])
def test_bad_options_are_one_sentence(spec, match):
    from cuboid.tasks import parse

    with pytest.raises(TaskError, match=match):
        parse(spec)


def test_task_options_as_flags_of_their_own(tmp_path):
    """``--beta`` / ``--loss-type`` are dpo's options (its defaults stand when unset), join ``--task dpo,...``,
    are refused for a task without them, and are keys of a --config file."""
    import argparse

    from cuboid.cli import finetune as F
    from cuboid.train.config import FinetuneConfig, checked

    parser = argparse.ArgumentParser()
    F.add_parser(parser.add_subparsers())
    args = parser.parse_args(["finetune", "--model", "m", "--data", "d", "--task", "dpo,label_smoothing=0.1",
                              "--beta", "0.25", "--loss-type", "robust"])
    values = F.resolve(args)
    assert values["task_options"] == {"beta": 0.25, "loss_type": "robust"}
    task = checked(FinetuneConfig(**values)).task
    assert (task.options.beta, task.options.loss_type, task.options.label_smoothing) == (0.25, "robust", 0.1)
    assert checked(FinetuneConfig(task="dpo")).task.options.beta == 0.1  # unset: the task's default
    with pytest.raises(ValueError, match="--beta apply to --task .*dpo"):
        checked(FinetuneConfig(task="sft", task_options={"beta": 0.2}))
    with pytest.raises(ValueError, match="given twice"):
        checked(FinetuneConfig(task="dpo,beta=0.3", task_options={"beta": 0.2}))
    config = tmp_path / "run.toml"
    config.write_text('task = "dpo"\nbeta = 0.5\nloss_type = "ipo"\n')
    values = F.resolve(parser.parse_args(["finetune", "--config", str(config), "--model", "m"]))
    assert checked(FinetuneConfig(**values)).task.options.loss_type == "ipo"
