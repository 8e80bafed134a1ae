"""cuboid: Triton kernels, parallel layers and a declarative model zoo for PyTorch.

The front door. Lower floors are importable on their own as
``cuboid.kernels``, ``cuboid.parallel`` and ``cuboid.zoo``.
"""
__version__ = "0.1.0"

import os as _os


def load(name_or_path, plan=None, *, dtype=None, device=None, seed: int = 0, **overrides):
    """Load a zoo model: a preset name builds a fresh one, a local HF folder loads its weights.

    ``plan``: how to spread the model over devices; ``None`` or ``"single"``
    for one device (the parallel plans arrive with ``cuboid.parallel``).
    ``dtype`` casts parameters; ``device`` defaults to CPU (``"meta"``: no memory,
    materialise later with ``cuboid.zoo.materialize``); ``seed`` drives
    the initialisation of a fresh model; ``overrides`` change preset fields
    (``num_labels=10``).
    """
    from cuboid import zoo

    if plan not in (None, "single"):
        raise NotImplementedError(f"plan {plan!r}: parallel plans are not available in this build yet")
    device = device or "cpu"
    if isinstance(name_or_path, (str, _os.PathLike)) and _os.path.isdir(name_or_path):
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} apply to presets, not to a checkpoint folder")
        return zoo.from_hf(name_or_path, dtype=dtype, device=device)
    if isinstance(name_or_path, str) and name_or_path not in zoo.PRESETS and (
            _os.sep in name_or_path or name_or_path.startswith(".")):
        raise FileNotFoundError(f"{name_or_path}: no such model folder")
    model = zoo.build(name_or_path, **overrides)
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
