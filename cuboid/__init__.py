"""cuboid: Triton kernels, parallel layers and a declarative model zoo for PyTorch.

The front door. Lower floors are importable on their own as
``cuboid.kernels``, ``cuboid.parallel`` and ``cuboid.zoo``.
"""
__version__ = "0.1.0"


def load(name_or_path, plan=None, *, dtype=None, device=None, seed: int = 0, mesh=None, lora=None, **overrides):
    """Load a zoo model by preset name or folder, ready to train under ``plan``: :func:`cuboid.loading.model.load`."""
    from cuboid.loading.model import load as _load

    return _load(name_or_path, plan, dtype=dtype, device=device, seed=seed, mesh=mesh, lora=lora, **overrides)


def rank_share(model_or_mesh, global_batch: dict) -> dict:
    """This rank's dp share of a global batch (the whole batch on one device).

    ``model_or_mesh``: a model (the mesh of its parallel state: one device for
    a model no plan was given to), a :class:`~cuboid.parallel.Mesh` or None.
    Every tensor is cut along dim 0 into ``dp`` equal contiguous parts; a
    batch that does not divide is a ``ValueError``.
    """
    from torch import nn

    from cuboid.parallel.state import state_of
    from cuboid.train.step import rank_share as _share

    mesh = state_of(model_or_mesh).mesh if isinstance(model_or_mesh, nn.Module) else model_or_mesh
    return _share(global_batch, mesh)


def train_step(model, optimizer, global_batch: dict, **options):
    """One optimizer step of ``model`` on ``global_batch``: exactly the single-device step, under any plan.

    Every rank passes the same global batch; the step takes this rank's dp
    share, runs ``microbatches`` forward/backward passes (default: the
    plan's), clips (``max_grad_norm``), steps the optimizer and zeroes the
    gradients. Returns a :class:`cuboid.train.step.StepResult` whose ``loss`` is
    the single-device loss of the global batch. Options: ``microbatches``,
    ``max_grad_norm``, ``scaler`` (a ``torch.amp.GradScaler`` for fp16),
    ``dtype`` (autocast: ``bf16`` / ``fp16``; default the plan's), ``task`` (a :class:`cuboid.tasks.Task`:
    its count, inputs and, for a task with a loss of its own, its summed loss; default the model's loss).
    """
    from cuboid.train.step import train_step as _step

    return _step(model, optimizer, global_batch, **options)


def evaluate(model, batches, **options) -> dict:
    """Mean loss (and accuracy for one-label-per-example tasks) over ``batches`` of this rank's data,
    reduced over dp: see :func:`cuboid.train.step.evaluate`."""
    from cuboid.train.step import evaluate as _evaluate

    return _evaluate(model, batches, **options)


def finetune(model="vit-debug", data="digits", **options) -> dict:
    """Fine-tune a zoo model (preset, HF folder or module) on a dataset; returns the final metrics.

    The Python face of ``cuboid finetune``; options are the fields of
    :class:`cuboid.train.config.FinetuneConfig` (``plan``, ``steps``, ``batch_size``,
    ``lr``, ``output_dir``, ...; the large-batch recipe: ``optimizer="lamb"``,
    ``lr_scaling="sqrt"``, ``reference_batch``, ``warmup``, ``schedule="poly"``,
    ``decay_power``). Run it under ``torchrun`` for multi-process plans.
    """
    from cuboid.train.loop import finetune as _finetune

    return _finetune(model, data, **options)


def adapters_off(model):
    """A context under which a LoRA model computes its base model's outputs (no copy of the weights), under
    any plan: :func:`cuboid.parallel.lora.adapters_off`."""
    from cuboid.parallel.lora import adapters_off as _off

    return _off(model)
