"""The run's model and optimizer: :func:`load_model` (a preset with the task's head, a folder, or a module,
sharded for the plan; the family's run options set on it), :func:`configure`, :func:`task_of` and
:func:`make_optimizer` (AdamW, LAMB, LARS, Muon), which :mod:`cuboid.train.loop` calls."""
from __future__ import annotations

import os
from typing import Optional

from torch import nn

from cuboid import tasks
from cuboid.data.formats import load_tokenizer
from cuboid.loading.model import load
from cuboid.parallel import Mesh, Plan, unwrap
from cuboid.train.config import OPTIMIZERS, FinetuneConfig
from cuboid.zoo import PRESETS, config_of, family_of, set_options, spec_of

__all__ = ["MODEL_OPTIONS", "load_model", "configure", "task_of", "make_optimizer"]


MODEL_OPTIONS = ("moe_bias_update_rate",)  # run options a family reads off its model's config (zoo.set_options)


def load_model(cfg: FinetuneConfig, task: Optional[tasks.Task], num_labels: Optional[int], device, plan: Plan,
               mesh: Mesh):
    """(model, tokenizer, task): a preset gets the task's head; a folder keeps its own.

    Presets and folders are built on meta and sharded for ``plan`` before
    allocation (:func:`cuboid.loading.model.load`); a module passed in is sharded as it is.
    """
    from cuboid.parallel import shard

    if isinstance(cfg.model, nn.Module):
        plan.validate(cfg.model.config)
        if cfg.quantize is not None:
            raise ValueError("--quantize applies to a preset or a folder that cuboid reads, not to a model object")
        model = shard(cfg.model, plan, mesh, spec_of(cfg.model))
        if cfg.lora is not None:
            from cuboid.zoo.lora import attach

            attach(model, cfg.lora, seed=cfg.seed)
        tokenizer = load_tokenizer(cfg.tokenizer)
    elif os.path.isdir(str(cfg.model)):
        from cuboid.loading.model import head_for

        tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        model = load(cfg.model, plan, device=device, mesh=mesh, seed=cfg.seed, lora=cfg.lora,
                     quantize=cfg.quantize, **head_for(cfg.model, task, num_labels, tokenizer, lora=cfg.lora))
    else:
        if cfg.model not in PRESETS:
            raise ValueError(f"unknown model {cfg.model!r}: give a preset ({', '.join(PRESETS)}) "
                             "or a local Hugging Face folder")
        overrides = {}
        if task is not None:
            overrides["head"] = task.heads[0]
        if num_labels is not None and hasattr(config_of(cfg.model), "num_labels"):
            overrides["num_labels"] = num_labels
        tokenizer = load_tokenizer(cfg.tokenizer)
        if task is not None:  # what the task gives its model beside the head (reward: one output, the pad id)
            overrides.update(task.model_config(config_of(cfg.model, **overrides), tokenizer))
        model = load(cfg.model, plan, device=device, seed=cfg.seed, mesh=mesh, lora=cfg.lora, quantize=cfg.quantize,
                     **overrides)
    task = task_of(model, task)
    configure(model, task, tokenizer)
    options = {k: getattr(cfg, k) for k in MODEL_OPTIONS if getattr(cfg, k)}
    if options:  # the run's options that are the model family's (its config's fields)
        set_options(unwrap(model), **options)
    return model, tokenizer, task


def configure(model: nn.Module, task: tasks.Task, tokenizer) -> None:
    """A loaded model given the config fields its task sets (:meth:`~cuboid.tasks.Task.model_config`: reward's
    pad id, which its head reads each row's last token by); a head of another size is a one-sentence error."""
    from cuboid.parallel import unwrap

    core = unwrap(model)
    changes = {k: v for k, v in task.model_config(core.config, tokenizer).items() if getattr(core.config, k) != v}
    if "num_labels" in changes:
        raise ValueError(f"task {task.label} trains a head of {changes['num_labels']} output(s); this model's has "
                         f"{core.config.num_labels}")
    if changes:
        core.config = core.config.replace(**changes)


def task_of(model: nn.Module, task: Optional[tasks.Task]) -> tasks.Task:
    """The task the model's head does (``task`` when given); a one-sentence error when it is another's."""
    return tasks.for_model(family_of(model).name, model.config.head, task)


def make_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float):
    """AdamW / LAMB / LARS / Muon with biases and norms excluded from decay (and from LAMB/LARS trust ratios).

    Built the plain way: under tensor parallelism the optimizers read each
    parameter's placement to see whole-tensor norms.
    """
    from cuboid.parallel import optim

    groups = optim.exclude_bias_and_norm(model, weight_decay)
    if name == "adamw":
        return optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    if name == "lamb":
        return optim.LAMB(groups, lr=lr, weight_decay=weight_decay)
    if name == "lars":
        return optim.LARS(groups, lr=lr, weight_decay=weight_decay)
    if name == "muon":  # Moonlight's RMS matching: the hidden matrices' steps at AdamW's size, one lr for both
        from cuboid.parallel.muon import Muon

        return Muon(groups, lr=lr, weight_decay=weight_decay, adamw_lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; optimizers: {', '.join(OPTIMIZERS)}")
