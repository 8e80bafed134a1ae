"""cuboid: Triton kernels, parallel layers and a declarative model zoo for PyTorch.

The front door. Lower floors are importable on their own as
``cuboid.kernels``, ``cuboid.parallel`` and ``cuboid.zoo``.
"""
__version__ = "0.1.0"

import os as _os


def load(name_or_path, plan=None, *, dtype=None, device=None, seed: int = 0, mesh=None, lora=None, **overrides):
    """Load a zoo model, ready to train under ``plan``: a preset name builds a fresh one, a local HF
    or cuboid checkpoint folder loads its weights.

    ``plan``: how to spread the model (a :class:`cuboid.parallel.Plan`, a ready
    plan name such as ``"tp1d"``, a .json/.toml file or ``"dp=2,tp=2"``;
    ``None`` for one device; ``"auto"``: the fastest plan the cost model finds
    for the world size, the detected hardware and free memory, constrained by
    any fields given, ``"auto,tp=2,batch=16,seq=512"``: :func:`cuboid.planner.resolve`).
    The model is built on the meta device, sharded
    for the plan's tensor mode, and only then allocated, so each rank holds and
    initialises (or reads from the folder) just its own slices, with the same
    values as the single-device model of the same seed. Multi-process plans run
    under ``torchrun``.

    The returned model is a drop-in for the single-device one
    (:func:`cuboid.parallel.prepare`): it carries ``model.plan`` and
    ``model.mesh``, takes this rank's dp share (:func:`rank_share`) in the
    single-device format, returns single-device outputs, and averages
    gradients over ``dp`` in backward; cuboid's optimizers and clipping find
    each parameter's sharding themselves.

    ``dtype`` casts parameters; ``device`` defaults to CPU (``"meta"``: no
    memory, shapes only; materialise with ``cuboid.zoo.materialize`` and then
    ``cuboid.parallel.prepare``); ``seed`` drives a fresh model's
    initialisation; ``overrides`` change preset fields (``num_labels=10``).

    ``lora``: train LoRA adapters instead of the weights: ``dict(r=16, alpha=32, dropout=0.05,
    targets=("attn", "mlp"))``, a ``"r=16,alpha=32"`` string, or a peft adapter folder (its config and
    weights). The adapters follow each adapted layer's layout under the plan, start as peft's (the same
    under every plan for a seed), and are the only parameters that require gradients
    (:mod:`cuboid.zoo.lora`; save them with ``cuboid.zoo.lora.save_adapters``).
    """
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan, prepare, shard

    device = device or "cpu"
    if isinstance(plan, str) and plan.strip().startswith("auto"):  # "auto[,tp=2,batch=16,seq=512]": searched
        from cuboid.planner import resolve

        plan = resolve(plan, name_or_path, dtype={None: None, "bfloat16": "bf16", "float16": "fp16"}.get(
            str(dtype).replace("torch.", "") if dtype is not None else None))
    plan = Plan() if plan is None else Plan.parse(plan, zoo.READY_PLANS).require_implemented()
    single = plan.world_size == 1
    if mesh is None and single:
        mesh = Mesh.layout(plan)  # no process group, even under torchrun

    def transform(model):  # runs on the meta model, before anything is allocated
        nonlocal mesh
        if mesh is None:
            mesh = Mesh.build(plan, model.config)
        else:  # a mesh built without the model: the plan must still fit its shapes (heads, key/value heads, dim)
            plan.validate(model.config)
        model = shard(model, plan, mesh, zoo.spec_of(model))
        if plan.pp > 1:  # keep only this rank's stages: blocks balanced with the embedding and head costs
            from cuboid.parallel.pipeline import cut_model

            cut_model(model, zoo.spec_of(model), mesh, zoo.plans.stage_costs(model.config))
        return model

    if isinstance(name_or_path, (str, _os.PathLike)) and _os.path.isdir(name_or_path):
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} apply to presets, not to a checkpoint folder")
        model = zoo.from_hf(name_or_path, dtype=dtype, device=device, transform=transform)
    else:
        if isinstance(name_or_path, str) and name_or_path not in zoo.PRESETS and (
                _os.sep in name_or_path or name_or_path.startswith(".")):
            raise FileNotFoundError(f"{name_or_path}: no such model folder")
        model = transform(zoo.build(name_or_path, **overrides))
        if str(device) == "meta":  # shapes only: count parameters, plan memory, materialise later
            model.plan, model.mesh = plan, mesh
            if lora is not None:
                from cuboid.zoo.lora import attach

                attach(model, lora, seed=seed)
            return model if dtype is None else model.to(dtype)
        model = zoo.materialize(model, device, seed=seed, dtype=dtype)
    if lora is not None:
        from cuboid.zoo.lora import attach

        attach(model, lora, seed=seed)
    if str(device) == "meta":
        model.plan, model.mesh = plan, mesh
        return model
    return prepare(model, plan, mesh, zoo.spec_of(model))


def rank_share(model_or_mesh, global_batch: dict) -> dict:
    """This rank's dp share of a global batch (the whole batch on one device).

    ``model_or_mesh``: a model from :func:`load` (its ``mesh``), a
    :class:`~cuboid.parallel.Mesh` or None. Every tensor is cut along dim 0
    into ``dp`` equal contiguous parts; a batch that does not divide is a
    ``ValueError``.
    """
    from cuboid.step import rank_share as _share

    return _share(global_batch, getattr(model_or_mesh, "mesh", model_or_mesh))


def train_step(model, optimizer, global_batch: dict, **options):
    """One optimizer step of ``model`` on ``global_batch``: exactly the single-device step, under any plan.

    Every rank passes the same global batch; the step takes this rank's dp
    share, runs ``microbatches`` forward/backward passes (default: the
    plan's), clips (``max_grad_norm``), steps the optimizer and zeroes the
    gradients. Returns a :class:`cuboid.step.StepResult` whose ``loss`` is
    the single-device loss of the global batch. Options: ``microbatches``,
    ``max_grad_norm``, ``scaler`` (a ``torch.amp.GradScaler`` for fp16),
    ``dtype`` (autocast: ``bf16`` / ``fp16``; default the plan's).
    """
    from cuboid.step import train_step as _step

    return _step(model, optimizer, global_batch, **options)


def evaluate(model, batches, **options) -> dict:
    """Mean loss (and accuracy for one-label-per-example tasks) over ``batches`` of this rank's data,
    reduced over dp: see :func:`cuboid.step.evaluate`."""
    from cuboid.step import evaluate as _evaluate

    return _evaluate(model, batches, **options)


def finetune(model="vit-debug", data="digits", **options) -> dict:
    """Fine-tune a zoo model (preset, HF folder or module) on a dataset; returns the final metrics.

    The Python face of ``cuboid finetune``; options are the fields of
    :class:`cuboid.trainer.FinetuneConfig` (``plan``, ``steps``, ``batch_size``,
    ``lr``, ``output_dir``, ...; the large-batch recipe: ``optimizer="lamb"``,
    ``lr_scaling="sqrt"``, ``reference_batch``, ``warmup``, ``schedule="poly"``,
    ``decay_power``). Run it under ``torchrun`` for multi-process plans.
    """
    from cuboid.trainer import finetune as _finetune

    return _finetune(model, data, **options)
