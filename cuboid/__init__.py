"""cuboid: Triton kernels, parallel layers and a declarative model zoo for PyTorch.

The front door. Lower floors are importable on their own as
``cuboid.kernels``, ``cuboid.parallel`` and ``cuboid.zoo``.
"""
__version__ = "0.1.0"

import os as _os


def load(name_or_path, plan=None, *, dtype=None, device=None, seed: int = 0, mesh=None, **overrides):
    """Load a zoo model: a preset name builds a fresh one, a local HF folder loads its weights.

    ``plan``: how to spread the model (a :class:`cuboid.parallel.Plan`, a ready
    plan name such as ``"tp1d"``, a .json/.toml file or ``"dp=2,tp=2"``;
    ``None`` for one device). The model is built on the meta device, sharded
    for the plan's tensor mode, and only then allocated, so each rank holds and
    initialises (or reads from the folder) just its own slices, with the same
    values as the single-device model of the same seed. Multi-process plans run
    under ``torchrun``; data parallelism is applied by
    :func:`cuboid.parallel.parallelize` when training.

    ``dtype`` casts parameters; ``device`` defaults to CPU (``"meta"``: no
    memory, materialise later with ``cuboid.zoo.materialize``); ``seed``
    drives a fresh model's initialisation; ``overrides`` change preset fields
    (``num_labels=10``).
    """
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan, shard

    device = device or "cpu"
    plan = None if plan is None else Plan.parse(plan, zoo.READY_PLANS).require_implemented()

    transform = None if plan is None else (  # runs on the meta model, before anything is allocated
        lambda model: shard(model, plan, mesh or Mesh.build(plan, model.config), zoo.spec_of(model)))
    if isinstance(name_or_path, (str, _os.PathLike)) and _os.path.isdir(name_or_path):
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} apply to presets, not to a checkpoint folder")
        return zoo.from_hf(name_or_path, dtype=dtype, device=device, transform=transform)
    if isinstance(name_or_path, str) and name_or_path not in zoo.PRESETS and (
            _os.sep in name_or_path or name_or_path.startswith(".")):
        raise FileNotFoundError(f"{name_or_path}: no such model folder")
    model = zoo.build(name_or_path, **overrides)
    if transform is not None:
        model = transform(model)
    if str(device) == "meta":  # shapes only: count parameters, plan memory, materialise later
        return model if dtype is None else model.to(dtype)
    return zoo.materialize(model, device, seed=seed, dtype=dtype)


def finetune(model="vit-debug", data="digits", **options) -> dict:
    """Fine-tune a zoo model (preset, HF folder or module) on a dataset; returns the final metrics.

    The Python face of ``cuboid finetune``; options are the fields of
    :class:`cuboid.trainer.FinetuneConfig` (``plan``, ``steps``, ``batch_size``,
    ``lr``, ``output_dir``, ...). Run it under ``torchrun`` for multi-process
    plans.
    """
    from cuboid.trainer import finetune as _finetune

    return _finetune(model, data, **options)
