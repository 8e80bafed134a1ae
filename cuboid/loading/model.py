"""``cuboid.load``: a zoo model by preset name or folder, built for a plan and ready to train.

The steps, in order: the plan read once at the door (:func:`plan_of`), the model built on the meta device
and cut for the plan (:mod:`cuboid.loading.builder`), allocated or read from the folder (only this rank's
slices), LoRA adapters attached, and :func:`cuboid.parallel.prepare` for training. A ``device="meta"``
load stops before allocating and carries its plan in its parallel state
(:mod:`cuboid.parallel.state`).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from torch import nn

from cuboid.zoo import READY_PLANS, build, from_hf, materialize
import cuboid.zoo as zoo  # zoo.spec_of looked up at call time (a test swaps it)
from cuboid.loading.builder import ModelBuilder, cut, is_folder
from cuboid.parallel import Mesh, Plan, prepare
from cuboid.parallel.state import ParallelState, attach

_PLAN_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}  # torch dtype names -> the plan's names


LOCAL_PROCESSES_ENV = "CUBOID_MAX_LOCAL_PROCESSES"
PROCESSES_PER_DEVICE = 8  # a few ranks per GPU or core is a test or a small run; more is a mistyped plan


def local_process_limit() -> int:
    """How many processes one machine may start for a plan: ``PROCESSES_PER_DEVICE`` x the CUDA devices (or
    the CPU cores without CUDA), or the whole number in ``$CUBOID_MAX_LOCAL_PROCESSES`` (the override)."""
    raw = os.environ.get(LOCAL_PROCESSES_ENV)
    if raw is not None:
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ValueError(f"{LOCAL_PROCESSES_ENV}={raw!r}: give a whole number of processes >= 1")
        return int(raw)
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    return PROCESSES_PER_DEVICE * max(1, devices)


def check_local_processes(n: int, plan: Optional[Plan] = None) -> None:
    """Refuse, before any process starts, to launch ``n`` local processes past :func:`local_process_limit`
    (``cuboid finetune --plan dp=100000`` would otherwise start 100,000 of them)."""
    limit = local_process_limit()
    if n > limit:
        what = f"plan {plan.describe()} needs" if plan is not None else "the run needs"
        raise ValueError(f"{what} {n} processes, more than this machine's limit of {limit} ({PROCESSES_PER_DEVICE} "
                         f"per {'GPU' if _has_cuda() else 'CPU core'}): check the plan, or set "
                         f"{LOCAL_PROCESSES_ENV}={n} to start them anyway")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_of(spec: Any, model: Any = None, *, dtype=None, **search) -> Plan:
    """The plan at the door, checked against what this build implements: a :class:`Plan` as it is; ``None``
    one device; a ready-plan name, a .json / .toml file, ``"dp=2,tp=2"`` or a dict parsed;
    ``"auto[,...]"`` searched for ``model`` (a preset, folder or :class:`~cuboid.loading.builder.ModelBuilder`) by
    :func:`cuboid.loading.planner.resolve` with ``search``'s options (``batch``, ``seq``, ``world``). Lower layers
    take the Plan this returns and never parse again."""
    if isinstance(spec, Plan):
        return spec.require_implemented()
    from cuboid.loading.planner import is_auto

    if is_auto(spec):
        from cuboid.loading.planner import resolve

        if not isinstance(dtype, (str, type(None))):  # a torch dtype: the plan's name for it
            dtype = _PLAN_DTYPES.get(str(dtype).replace("torch.", ""))
        builder = model if isinstance(model, ModelBuilder) else ModelBuilder(model)
        return resolve(spec, builder, dtype=dtype, **search).require_implemented()
    return Plan.parse(spec, READY_PLANS).require_implemented()


class _Fit:
    """The transform a meta model goes through before allocation: cut for ``plan`` on ``mesh``, the mesh
    built from the first model's config when none was given."""

    def __init__(self, plan: Plan, mesh: Optional[Mesh]) -> None:
        self.plan = plan
        self.mesh = Mesh.layout(plan) if mesh is None and plan.world_size == 1 else mesh  # one device: no group

    def __call__(self, model: nn.Module) -> nn.Module:
        if self.mesh is None:
            self.mesh = Mesh.build(self.plan, model.config)
        else:  # a mesh built without the model: the plan must still fit its shapes (heads, key/value heads, dim)
            self.plan.validate(model.config)
        return cut(model, self.plan, self.mesh)


def load(name_or_path, plan=None, *, dtype=None, device=None, seed: int = 0, mesh=None, lora=None, quantize=None,
         **overrides):
    """Load a zoo model, ready to train under ``plan``: a preset name builds a fresh one, a local HF
    or cuboid checkpoint folder loads its weights, and so does a hub id ``org/name`` (from the Hugging Face
    cache, downloaded when not there and the hub is on: :mod:`cuboid.loading.hub`).

    ``plan``: how to spread the model (a :class:`cuboid.parallel.Plan`, a ready
    plan name such as ``"tp1d"``, a .json/.toml file or ``"dp=2,tp=2"``;
    ``None`` for one device; ``"auto"``: the fastest plan the cost model finds
    for the world size, the detected hardware and free memory, constrained by
    any fields given, ``"auto,tp=2,batch=16,seq=512"``: :func:`cuboid.loading.planner.resolve`).
    The model is built on the meta device, sharded
    for the plan's tensor mode, and only then allocated, so each rank holds and
    initialises (or reads from the folder) just its own slices, with the same
    values as the single-device model of the same seed. Multi-process plans run
    under ``torchrun``.

    The returned model is a drop-in for the single-device one
    (:func:`cuboid.parallel.prepare`): it carries its plan and mesh in
    ``model.parallel`` (:func:`cuboid.parallel.state.state_of`), takes this
    rank's dp share (:func:`cuboid.rank_share`) in the single-device format,
    returns single-device outputs, and averages gradients over ``dp`` in
    backward; cuboid's optimizers and clipping find each parameter's sharding
    themselves.

    ``dtype`` casts parameters; ``device`` defaults to CPU (``"meta"``: no
    memory, shapes only; materialise with ``cuboid.zoo.materialize`` and then
    ``cuboid.parallel.prepare``); ``seed`` drives a fresh model's
    initialisation; ``overrides`` change preset fields (``num_labels=10``). A folder takes ``head="cls"`` and
    ``num_labels``: a causal LM's folder (``*ForCausalLM``) read as a sequence classifier, its body loaded and a
    new ``score`` head of ``num_labels`` outputs initialised from ``seed``, the LM head dropped, as
    ``AutoModelForSequenceClassification.from_pretrained`` does (a reward model: ``num_labels=1``), said in one
    line (:mod:`cuboid.zoo.heads`).

    ``lora``: train LoRA adapters instead of the weights: ``dict(r=16, alpha=32, dropout=0.05,
    targets=("attn", "mlp"))``, a ``"r=16,alpha=32"`` string, or a peft adapter folder (its config and
    weights). The adapters follow each adapted layer's layout under the plan, start as peft's (the same
    under every plan for a seed), and are the only parameters that require gradients
    (:mod:`cuboid.zoo.lora`; save them with ``cuboid.zoo.lora.save_adapters``).

    ``quantize="nf4"``: the blocks' linears become a frozen 4-bit NF4 base (QLoRA; bitsandbytes' layout with
    double quantization), quantized while a folder is read, one tensor at a time
    (:mod:`cuboid.loading.quantize`); train it with ``lora``.

    A folder of LoRA adapters alone (``checkpoint.save`` of a LoRA model, a fine-tune's ``final/``) loads as the
    base its adapter config names with the adapters on (``quantize`` applies to that base); one that names no
    base is refused in one sentence.
    """
    from cuboid.loading.hub import locate
    from cuboid.parallel.quant import check_quantize

    quantize = check_quantize(quantize)
    name_or_path = locate(name_or_path)  # a hub id: its folder in the Hugging Face cache (cuboid.loading.hub)
    if is_folder(name_or_path) and lora is None:
        from cuboid.zoo.checkpoint.lora_state import adapter_base, is_adapter_folder

        if is_adapter_folder(name_or_path):  # a LoRA model's save: the base it names, with the adapters on
            return load(adapter_base(name_or_path), plan, dtype=dtype, device=device, seed=seed, mesh=mesh,
                        lora=str(name_or_path), quantize=quantize, **overrides)
    device = device or "cpu"
    if is_folder(name_or_path):  # the config against the weights' names, before anything is built from it
        from cuboid.zoo.checkpoint.precheck import check_folder

        check_folder(name_or_path)
    fit = _Fit(plan_of(plan, ModelBuilder(name_or_path, overrides=overrides), dtype=dtype), mesh)
    if quantize:  # a grid refused from the plan, on every rank
        from cuboid.parallel.quant import check_plan

        check_plan(fit.plan)
    if str(device) == "meta":
        return _meta(name_or_path, fit, dtype=dtype, lora=lora, seed=seed, overrides=overrides, quantize=quantize)
    if is_folder(name_or_path) and not quantize:
        from cuboid.loading.quantize import folder_is_4bit

        quantize = "nf4" if folder_is_4bit(name_or_path) else None  # a bitsandbytes 4-bit folder reads as it is
    if is_folder(name_or_path) and overrides:  # a new head (cuboid.zoo.heads), said in one line
        _say_new_head(name_or_path, overrides)
    if quantize and is_folder(name_or_path):
        from cuboid.loading.quantize import from_folder

        model = from_folder(name_or_path, dtype=dtype, device=device, transform=fit, seed=seed, **overrides)
    elif is_folder(name_or_path):
        model = from_hf(name_or_path, dtype=dtype, device=device, transform=fit, seed=seed, **overrides)
    else:
        model = materialize(fit(build(name_or_path, **overrides)), device, seed=seed, dtype=dtype)
        if quantize:
            from cuboid.loading.quantize import quantize_model

            quantize_model(model)
    _attach_lora(model, lora, seed)
    return prepare(model, fit.plan, fit.mesh, zoo.spec_of(model))


def _meta(source, fit: _Fit, *, dtype, lora, seed: int, overrides: dict, quantize=None) -> nn.Module:
    """Shapes only: the cut meta model with its plan and mesh, adapters attached, parameters in ``dtype``
    (a folder's are read in ``dtype``; a preset's are cast after the adapters are attached)."""
    if is_folder(source):
        model = from_hf(source, dtype=dtype, device="meta", transform=fit, **overrides)
    else:
        model = fit(build(source, **overrides))
    if quantize:  # the NF4 layers' shapes, no values
        from cuboid.parallel.quant import block_linears, quantize_linears

        quantize_linears(model, block_linears(model))
    attach(model, ParallelState(plan=fit.plan, mesh=fit.mesh, spec=zoo.spec_of(model)))
    _attach_lora(model, lora, seed)
    return model if dtype is None or is_folder(source) else model.to(dtype)


def head_for(folder, task, num_labels: Optional[int], tokenizer, lora=None) -> dict:
    """The overrides :func:`load` reads ``folder`` with for ``task`` (a :class:`cuboid.tasks.Task` or None) beyond
    its own head: a causal LM's folder under a task that trains a classifier (reward, seqcls) gets a new one
    (:mod:`cuboid.zoo.heads`) of the outputs the task gives (reward: 1; seqcls: its ``num_labels``, else the
    data's ``num_labels`` classes), as TRL's RewardTrainer starts from ``AutoModelForSequenceClassification`` on
    that folder; ``{}`` otherwise. Under ``lora`` a new head is refused in one sentence: it would stay untrained."""
    if task is None or not os.path.isfile(os.path.join(folder, "config.json")):
        return {}
    from cuboid.zoo.heads import folder_config

    family, config, _ = folder_config(folder)
    head = getattr(config, "head", None)
    if task.fits(family.name, head) or not task.fits(family.name, "cls") or not hasattr(config, "num_labels"):
        return {}
    if lora is not None:
        raise ValueError(f"--lora on {folder}: task {task.label} needs a new score head in place of its {head} "
                         "head, which LoRA would leave untrained (peft's modules_to_save is not supported): "
                         "fine-tune it in full, or start from a sequence-classification folder")
    n = task.model_config(config, tokenizer).get("num_labels", num_labels)
    return {"head": "cls", **({"num_labels": n} if n is not None else {})}


def _say_new_head(folder, overrides: dict) -> None:
    """The one line (rank 0, stderr) of a folder read under a new head: the head dropped, the one made."""
    import sys

    from cuboid.zoo.heads import describe

    line = describe(folder, overrides.get("head"), overrides.get("num_labels"))
    if line is not None and int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)


def _attach_lora(model: nn.Module, lora, seed: int) -> None:
    if lora is not None:
        from cuboid.zoo.lora import attach as attach_adapters

        attach_adapters(model, lora, seed=seed)
