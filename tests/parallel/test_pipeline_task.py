"""A task with its own loss and target tensor trains under pp through ``cuboid.train_step(..., task=)``.

The task (:class:`WeightedLM`) weighs each next-token log-probability by a
per-token float ``weights`` (B, T) the batch carries and the model does not
read: its loss is ``-sum(token_logps * weights[:, 1:])`` over the label
positions (``logprobs=True``; the labels read from the batch, as on one
device), its count the label positions. The pipeline carries the
micro-batch, ``weights`` with it, to the last stage in the stream and calls
the task's loss there on one device's layout. :class:`LogitsLM` reads the
lazily gathered whole ``logits`` and a second target instead (the labels
under another key), so the gathers behind ``out.logits`` must be
differentiable.

For 1f1b, zbv and interleaved schedules, a routed mixture of experts under
gpipe (router statistics in the stream beside the targets), pp=2 x tp=2,
pp=2 x sp=2 and dp=2 x pp=2: 2 SGD steps give one device's loss and
parameters (one device running the same task over the plan's micro-batches;
fp32, 1e-5, the parameters' norm without the largest 0.1% of differences),
and the parameters moved. A loss's targets that are not per-row tensors of
the batch, or targets without a loss, are one-sentence errors on every rank.
"""
import torch

from cuboid.tasks import Task

from .launch import run_world
from .test_data_parallel import global_batch
from .test_plans import params_err, rel_norm, worst

LR, STEPS = 0.5, 2


class WeightedLM(Task):
    """Per-token weighted next-token loss: ``weights`` (B, T) floats, weight t + 1 on the prediction of
    token t + 1."""

    targets = ("weights",)
    forward_kwargs = {"logprobs": True}

    def count(self, batch: dict, model=None) -> int:
        return int((batch["labels"][:, 1:] != -100).sum())

    def loss(self, out, batch: dict) -> tuple:
        weights = batch["weights"][:, 1:] * (batch["labels"][:, 1:] != -100)  # (B, T - 1)
        return -(out.token_logps * weights).sum(), {"weight": weights.sum()}


class LogitsLM(WeightedLM):
    """The same loss from the whole logits (gathered when read) and the labels copied to ``next``."""

    targets = ("weights", "next")
    forward_kwargs = {}

    def loss(self, out, batch: dict) -> tuple:
        y = batch["next"][:, 1:]  # (B, T - 1)
        logp = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, y.clamp(min=0).unsqueeze(-1))[..., 0]
        return -(logp * (y != -100) * batch["weights"][:, 1:]).sum(), {}


def task_batch(name: str, model, step: int, task=WeightedLM) -> dict:
    """global_batch (uneven label counts per row) with per-token weights (and the labels as ``next`` where
    the task reads them)."""
    batch = global_batch(name, model, 8)
    batch["weights"] = torch.rand(batch["labels"].shape, generator=torch.Generator().manual_seed(step))
    if "next" in task.targets:
        batch["next"] = batch["labels"].clone()
    return batch


def refusals(model) -> list:
    """The errors of a pipeline asked for targets that are not per-row tensors, or for targets without a
    loss (raised before any schedule runs, on every rank alike)."""
    from cuboid.parallel.state import state_of

    pipe = state_of(model).pipeline
    batch = task_batch("gpt", model, 0)
    w = torch.ones(pipe.microbatches)
    errors = []
    for kwargs in (dict(loss=lambda out, t: out.loss, targets=("rewards",)),
                   dict(loss=lambda out, t: out.loss, targets=("weights",), batch=dict(batch, weights=torch.ones(3))),
                   dict(targets=("weights",))):
        try:
            pipe.run(kwargs.pop("batch", batch), w, **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return errors


def task_worker(cases) -> dict:
    """Each case (plan, model name, load overrides, task class): STEPS SGD steps of the plan against one
    device."""
    import torch.distributed as dist

    import cuboid
    from cuboid.parallel import Mesh, Plan

    report = {}
    for plan_text, name, extra, task_cls in cases:
        plan = Plan.parse(plan_text)
        task = task_cls()
        ref = cuboid.load(name, seed=0, **extra).train()
        model = cuboid.load(name, plan, seed=0, mesh=Mesh.build(plan), **extra).train()
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=LR), torch.optim.SGD(model.parameters(), lr=LR)
        init = torch.cat([p.detach().flatten() for p in ref.parameters()])
        loss_err, counts = 0.0, []
        for step in range(STEPS):
            batch = task_batch(name, ref, step, task)
            a = cuboid.train_step(ref, opt_ref, batch, task=task, microbatches=plan.microbatches)
            b = cuboid.train_step(model, opt, batch, task=task)
            loss_err = worst(loss_err, abs(a.loss - b.loss) / abs(a.loss),
                             *(abs(a.metrics[k] - b.metrics[k]) / abs(a.metrics[k]) for k in a.metrics))
            assert set(a.metrics) == set(b.metrics) == ({"weight"} if task_cls is WeightedLM else set()), (a, b)
            counts.append((a.targets, b.targets))
        moved = rel_norm(torch.cat([p.detach().flatten() for p in ref.parameters()]), init)
        report[f"{plan_text}/{name}/{task_cls.__name__}"] = dict(
            loss=loss_err, params=params_err(model, ref), moved=moved, counts=counts)
        if plan_text == "pp=2,microbatches=2":
            report["errors"] = refusals(model)
        dist.barrier()
    return report


def check(reports, cases) -> None:
    for rank, report in enumerate(reports):
        assert len(report) >= len(cases), (rank, sorted(report))
        for key, r in report.items():
            if key == "errors":
                assert len(r) == 3, (rank, r)
                assert "['rewards'] are not" in r[0] and "['weights'] are not" in r[1], (rank, r)
                assert "give loss=" in r[2], (rank, r)
                continue
            assert r["loss"] < 1e-5 and r["params"] < 1e-5, (rank, key, r)
            assert r["moved"] > 1e-3, (rank, key, "the steps moved the parameters", r)
            assert all(a == b > 0 for a, b in r["counts"]), (rank, key, r)


CASES_2 = (("pp=2,microbatches=2", "gpt-debug", {}, WeightedLM),  # 1f1b; GPT's tied embedding
           ("pp=2,microbatches=2,schedule=zbv", "llama-debug", {"n_layers": 4}, WeightedLM),
           ("pp=2,microbatches=2,schedule=interleaved", "gpt-debug", {"n_layers": 4}, LogitsLM),
           ("pp=2,microbatches=2,schedule=gpipe", "qwen3-moe-debug",
            {"output_router_logits": True, "router_aux_loss_coef": 0.5}, WeightedLM))
CASES_4 = (("pp=2,tp=2,microbatches=2", "llama-debug", {}, WeightedLM),  # vocab-parallel log-probs
           ("pp=2,sp=2,microbatches=2", "gpt-debug", {}, WeightedLM),
           ("dp=2,pp=2,microbatches=2", "llama-debug", {}, WeightedLM))


def test_task_loss_under_pp2_schedules_and_moe_on_2_ranks():
    check(run_world(task_worker, 2, CASES_2, timeout=300), CASES_2)


def test_task_loss_under_pp2_with_tp_sp_dp_on_4_ranks():
    check(run_world(task_worker, 4, CASES_4, timeout=300), CASES_4)
