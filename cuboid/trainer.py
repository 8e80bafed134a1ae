"""The fine-tune loop: a zoo model, a plan, a dataset -> a trained, checkpointed model.

``cuboid.finetune(model, data, plan=..., ...)`` is the Python API; ``cuboid finetune``
(cuboid/cli.py) calls it with the flags. Every rank runs this same code; rank 0
prints, logs and draws. Outputs in ``output_dir``:

- ``checkpoint-<step>/``: sharded safetensors + optimizer + training state
  (the last ``keep`` are kept), written through ``cuboid.zoo.checkpoint``;
- ``final/``: the trained model as a Hugging Face folder (config.json +
  safetensors [+ tokenizer]) that ``transformers`` loads;
- ``metrics.jsonl``: one JSON object per logged step and per eval;
- ``curves.png``: train/eval loss and the task metric (needs matplotlib).

Surviving faults: under torch's elastic launcher with ``--max-restarts`` a
dead rank makes the agent restart every worker; a restarted worker
(``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest *complete*
checkpoint in ``output_dir`` (model, optimizer, scheduler, RNG, data
position; checksums verified), so the run ends with the parameters of an
uninterrupted one. A checkpoint interrupted mid-write is never picked: saves
go to a hidden temporary folder renamed into place when complete
(:mod:`cuboid.zoo.checkpoint.folder`). ``timeout_s`` bounds every collective,
so a hang becomes an error, and so a restart. ``CUBOID_FAULT`` (:class:`Fault`)
is the tests' deterministic SIGKILL.
"""
from __future__ import annotations

import dataclasses

import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from cuboid import data as D
from cuboid.schedule import LR_SCALINGS, SCHEDULES, lr_lambda, scaled_lr, warmup_steps
from cuboid.parallel import Mesh, Plan, comm, init_distributed, prepare
from cuboid.step import evaluate, train_step

TASK_OF_HEAD = {("gpt", "lm"): "causal", ("bert", "mlm"): "mlm", ("bert", "cls"): "seqcls", ("vit", "cls"): "imgcls",
                ("llama", "lm"): "causal", ("llama", "cls"): "seqcls"}
TASK_ALIASES = {"clm": "causal"}  # the name transformers' run_clm.py gives causal language modelling
HEAD_OF_TASK = {"causal": "lm", "mlm": "mlm", "seqcls": "cls", "imgcls": "cls"}
OPTIMIZERS = ("adamw", "lamb", "lars")


@dataclass
class FinetuneConfig:
    """Every knob of a run; the CLI's flags and ``--config`` files map onto these names."""

    model: str = "vit-debug"
    data: Any = "digits"
    plan: Any = None
    task: Optional[str] = None            # default: from the model's head
    steps: Optional[int] = None           # optimizer steps; default from epochs
    epochs: Optional[float] = None        # default 1 when steps is not given
    batch_size: int = 32                  # global batch (all dp ranks, all micro-batches)
    micro_batch_size: Optional[int] = None  # per rank; default batch_size / dp (no accumulation)
    lr: float = 1e-3                      # peak lr at reference_batch (scaled to batch_size by lr_scaling)
    optimizer: str = "adamw"              # adamw | lamb | lars (1-D params: no decay, no trust ratio)
    weight_decay: float = 0.01
    warmup: float = 0.1                   # fraction of steps (< 1) or a step count (>= 1)
    schedule: str = "cosine"              # after warmup: cosine | linear | constant | poly (cuboid/schedule.py)
    decay_power: float = 1.0              # poly: lr * (1 - progress) ** decay_power
    lr_scaling: str = "none"              # none | linear | sqrt: lr * (batch_size / reference_batch) [** 0.5]
    reference_batch: int = 256            # the global batch lr was tuned at
    max_grad_norm: Optional[float] = 1.0
    dtype: Optional[str] = None           # fp32 | bf16 | fp16 (autocast); default: the plan's
    eval_every: Optional[int] = None      # default: 4 evals per run
    save_every: Optional[int] = None      # default: at the end only
    keep: int = 2                         # checkpoints kept
    output_dir: str = "runs/finetune"
    resume: Optional[str] = None          # "latest", a checkpoint folder, or None
    lora: Any = None                      # LoRA adapters only: "r=16,alpha=32[,dropout=0.05][,targets=attn+mlp]"
    seed: int = 0
    timeout_s: Optional[float] = None     # process-group timeout (CUBOID_TIMEOUT_S; default 300 s)
    seq_len: Optional[int] = None
    tokenizer: Optional[str] = None
    text_column: str = "text"
    label_column: str = "label"
    image_column: str = "image"
    eval_fraction: float = 0.1
    log_every: int = 10
    progress: bool = True
    plot: bool = True


# ---------------------------------------------------------------- pieces


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log(msg: str) -> None:
    if _is_main():
        print(msg, file=sys.stderr, flush=True)


def make_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float):
    """AdamW / LAMB / LARS with biases and norms excluded from decay (and from LAMB/LARS trust ratios).

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
    raise ValueError(f"unknown optimizer {name!r}; optimizers: {', '.join(OPTIMIZERS)}")


def _checkpoints(out: Path) -> list[Path]:
    found = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def _complete(path: Path) -> bool:
    """A training checkpoint with its commit file (the model index, or the single model file)."""
    from cuboid.zoo.checkpoint.format import INDEX, TRAINER_STATE

    from cuboid.zoo import lora

    return (path / TRAINER_STATE).is_file() and ((path / INDEX).is_file() or (path / "model.safetensors").is_file()
                                                 or lora.is_checkpoint(path))


def _resolve_resume(resume: Optional[str], out: Path) -> Optional[Path]:
    """The folder to resume from. 'latest' is the newest complete ``checkpoint-<step>`` (None if none).

    Saves are renamed into place only when complete, so an interrupted one is a
    hidden temporary folder that the ``checkpoint-*`` pattern never matches;
    the completeness check also skips folders a crash left half-deleted.
    """
    if resume in (None, "", "none"):
        return None
    if resume == "latest":
        found = [p for p in _checkpoints(out) if _complete(p)]
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume {resume}: no such checkpoint folder")
    return path


def _interrupted(out: Path) -> list[str]:
    """Names of the saves a crash interrupted in ``out`` (temporary folders, incomplete checkpoints)."""
    if not out.is_dir():
        return []
    tmp = sorted(p.name for p in out.iterdir() if p.is_dir() and p.name.startswith(".checkpoint-")
                 and ".tmp-" in p.name)
    return tmp + [p.name for p in _checkpoints(out) if not _complete(p)]


def _decided_on_rank0(mesh: Mesh, decide, errors=(ValueError,)):
    """``decide()`` run on rank 0 only and its answer sent to every rank; an error of ``errors`` there is
    raised on every rank (as a ValueError), so no rank goes on alone."""
    answer: tuple = ("ok", None)
    if mesh.is_main:
        try:
            answer = ("ok", decide())
        except errors as e:
            answer = ("error", str(e.args[0]) if e.args else str(e))
    if mesh.world_size > 1:
        import torch.distributed as dist

        box = [answer]
        with comm.guarded("broadcast_object_list (rank 0's decision)", None):
            dist.broadcast_object_list(box, src=0)
        answer = box[0]
    if answer[0] == "error":
        raise ValueError(answer[1])
    return answer[1]


def _agreed_resume(resume: Optional[str], out: Path, mesh: Mesh) -> Optional[Path]:
    """:func:`_resolve_resume` decided on rank 0 and sent to every rank, so no two ranks resume differently."""
    found = _decided_on_rank0(mesh, lambda: _resolve_resume(resume, out))
    return None if found is None else Path(found)


def _verify_once(ckpt, path: Path, mesh: Mesh) -> None:
    """``ckpt.verify(path)`` on rank 0 (one read of every byte, not one per rank); every rank raises its error."""
    try:
        _decided_on_rank0(mesh, lambda: ckpt.verify(path) and None, errors=(ValueError, OSError))
    except ValueError as e:  # CheckpointError is a ValueError; the other ranks hear of it too
        raise ckpt.CheckpointError(e.args[0]) from None


def _restart_count(mesh: Mesh) -> int:
    """How often the job has been restarted: the largest ``TORCHELASTIC_RESTART_COUNT`` of any rank.

    Each node's agent counts its own restarts; a node restarted because another
    failed (a membership change) does not count one, so ranks take the maximum.
    """
    mine = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if mesh.world_size == 1:
        return mine
    import torch.distributed as dist

    counts: list = [None] * mesh.world_size
    with comm.guarded("all_gather_object (restart counts)", None):
        dist.all_gather_object(counts, mine)
    return max(counts)


# ---------------------------------------------------------------- fault injection


FAULT_ENV = "CUBOID_FAULT"
FAULT_POINTS = ("step", "save", "saved")


@dataclass(frozen=True)
class Fault:
    """``CUBOID_FAULT=rank:step:where[,rank:step:where...]``: the fault tests' deterministic SIGKILL.

    Rank ``rank`` kills itself (SIGKILL, as an out-of-memory killer or a lost
    node would). The k-th entry acts on attempt k only (:func:`_restart_count`
    is k), so one entry kills the first attempt and the restarted workers run
    through, and a list kills one attempt after another. ``where``:

    - ``step``: in the model's forward of step ``step`` (1-based), while the
      other ranks are in that step's collectives;
    - ``save``: while ``checkpoint-<step>`` is being written: the writing rank
      (rank 0) once the second file is in the temporary folder, any other
      rank as the save begins;
    - ``saved``: once ``checkpoint-<step>`` is committed and every rank has
      returned from the save.
    """

    rank: int
    step: int
    where: str

    @classmethod
    def from_env(cls, rank: int, restart: int) -> Optional["Fault"]:
        """This attempt's fault if it is this rank's, else None. A malformed value is an error on every attempt."""
        spec = os.environ.get(FAULT_ENV, "").strip()
        if not spec:
            return None
        faults = []
        for entry in spec.split(","):
            parts = entry.strip().split(":")
            if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_POINTS:
                raise ValueError(f"{FAULT_ENV}={spec!r}: expected rank:step:where entries, where one of "
                                 f"{', '.join(FAULT_POINTS)}, separated by commas (e.g. 1:3:step)")
            faults.append(cls(int(parts[0]), int(parts[1]), parts[2]))
        fault = faults[restart] if restart < len(faults) else None
        return fault if fault is not None and fault.rank == rank else None

    def at(self, where: str, step: int) -> bool:
        return self.where == where and self.step == step

    @staticmethod
    def kill() -> None:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _load_model(cfg: FinetuneConfig, task: Optional[str], num_labels: Optional[int], device, plan: Plan,
                mesh: Mesh):
    """(model, tokenizer, task): a preset gets the task's head; a folder keeps its own.

    Presets and folders are built on meta and sharded for ``plan`` before
    allocation (:func:`cuboid.load`); a module passed in is sharded as it is.
    """
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import shard

    if isinstance(cfg.model, nn.Module):
        model = shard(cfg.model, plan, mesh, zoo.spec_of(cfg.model))
        if cfg.lora is not None:
            from cuboid.zoo.lora import attach

            attach(model, cfg.lora, seed=cfg.seed)
        tokenizer = D.load_tokenizer(cfg.tokenizer)
    elif os.path.isdir(str(cfg.model)):
        model = cuboid.load(cfg.model, plan, device=device, mesh=mesh, seed=cfg.seed, lora=cfg.lora)
        tokenizer = D.load_tokenizer(cfg.tokenizer or cfg.model)
    else:
        if cfg.model not in zoo.PRESETS:
            raise ValueError(f"unknown model {cfg.model!r}: give a preset ({', '.join(zoo.PRESETS)}) "
                             "or a local Hugging Face folder")
        base = zoo.config_of(cfg.model)
        overrides = {}
        if task is not None:
            overrides["head"] = HEAD_OF_TASK[task]
        if num_labels is not None and hasattr(base, "num_labels"):
            overrides["num_labels"] = num_labels
        model = cuboid.load(cfg.model, plan, device=device, seed=cfg.seed, mesh=mesh, lora=cfg.lora, **overrides)
        tokenizer = D.load_tokenizer(cfg.tokenizer)
    family = zoo.family_of(model).name
    inferred = TASK_OF_HEAD.get((family, model.config.head))
    if task is None:
        if inferred is None:
            raise ValueError(f"the {family} model has head {model.config.head!r}: no task to fine-tune; set --task")
        task = inferred
    elif inferred != task:
        raise ValueError(f"task {task} does not fit the {family} model with head {model.config.head!r}"
                         + (f" (it does {inferred})" if inferred else ""))
    return model, tokenizer, task


# ---------------------------------------------------------------- the loop


def finetune(model: Union[str, nn.Module] = "vit-debug", data: Any = "digits", **options) -> dict:
    """Fine-tune ``model`` on ``data``; returns the final metrics. Options: :class:`FinetuneConfig`."""
    unknown = sorted(set(options) - set(FinetuneConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"finetune() got unknown options: {', '.join(unknown)}")
    cfg = FinetuneConfig(model=model, data=data, **options)
    return run(cfg)


def run(cfg: FinetuneConfig) -> dict:
    from cuboid.planner import is_auto, resolve as resolve_plan
    from cuboid.zoo import READY_PLANS, checkpoint as ckpt

    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; optimizers: {', '.join(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if cfg.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {cfg.lr_scaling!r}; scalings: {', '.join(LR_SCALINGS)}")
    peak_lr = scaled_lr(cfg.lr, cfg.batch_size, cfg.reference_batch, cfg.lr_scaling)
    lr_lambda(cfg.schedule, 0, 1, cfg.decay_power)  # a bad --decay-power is an error before any work
    if cfg.task in TASK_ALIASES:
        cfg = dataclasses.replace(cfg, task=TASK_ALIASES[cfg.task])
    if cfg.task is not None and cfg.task not in D.TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; tasks: {', '.join(D.TASKS)} (clm: causal)")
    if is_auto(cfg.plan):  # searched for this world, decided on rank 0 (after the timeout's process group)
        if cfg.timeout_s is not None and cfg.timeout_s > 0:
            init_distributed(timeout_s=cfg.timeout_s)
        cfg = dataclasses.replace(cfg, plan=resolve_plan(cfg.plan, cfg.model, batch=cfg.batch_size, seq=cfg.seq_len,
                                                         dtype=cfg.dtype))
    plan = Plan.parse(cfg.plan, READY_PLANS)
    if cfg.dtype is not None:
        plan = plan.replace(dtype=cfg.dtype)
    dtype = plan.dtype
    plan.require_implemented()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan.validate(None, world)
    if cfg.timeout_s is not None:
        if not cfg.timeout_s > 0:
            raise ValueError(f"--timeout-s {cfg.timeout_s}: the process-group timeout must be positive seconds")
        init_distributed(timeout_s=cfg.timeout_s)  # before the mesh: every group it makes gets this timeout
    mesh = Mesh.build(plan)
    restart = _restart_count(mesh)
    fault = Fault.from_env(mesh.rank, restart)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")

    # data first: the number of classes decides a fresh model's head
    source = D.load_source(cfg.data)
    train_ds, eval_ds = D.train_eval_split(source, cfg.eval_fraction, cfg.seed)
    num_labels = None
    if cfg.task in ("seqcls", "imgcls") or (cfg.task is None and cfg.label_column in train_ds.column_names):
        num_labels = D.num_classes(train_ds, cfg.label_column)
    model, tokenizer, task = _load_model(cfg, cfg.task, num_labels, device, plan, mesh)
    plan.validate(model.config, world)
    if task in ("seqcls", "imgcls") and num_labels is None:
        num_labels = D.num_classes(train_ds, cfg.label_column)
    prep = dict(config=model.config, tokenizer=tokenizer, seq_len=cfg.seq_len, text_column=cfg.text_column,
                label_column=cfg.label_column, image_column=cfg.image_column,
                num_labels=getattr(model.config, "num_labels", None))
    train_t, eval_t = D.prepare(train_ds, task, **prep), D.prepare(eval_ds, task, **prep)

    dp = mesh.size("dp")
    micro = cfg.micro_batch_size or cfg.batch_size // (dp * (plan.microbatches if plan.pp > 1 else 1))
    if plan.pp > 1 and cfg.batch_size != dp * micro * plan.microbatches:
        raise ValueError(f"under pipeline parallelism a step runs the plan's {plan.microbatches} micro-batches: "
                         f"the global batch {cfg.batch_size} must be dp ({dp}) x {plan.microbatches} x the "
                         f"micro-batch ({micro})")
    if cfg.batch_size % (dp * micro):
        raise ValueError(f"global batch {cfg.batch_size} is not a multiple of dp ({dp}) x micro-batch ({micro})")
    accumulate = cfg.batch_size // (dp * micro)
    batches = D.GlobalBatches(train_t, cfg.batch_size, seed=cfg.seed)
    steps = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * batches.per_epoch))
    warmup = warmup_steps(cfg.warmup, steps)
    eval_every = cfg.eval_every or max(1, steps // 4)

    out = Path(cfg.output_dir)
    if mesh.is_main:
        out.mkdir(parents=True, exist_ok=True)
    from cuboid import zoo

    model = prepare(model, plan, mesh, zoo.spec_of(model))  # a no-op for what cuboid.load returned
    optimizer = make_optimizer(cfg.optimizer, model, peak_lr, cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.schedule, warmup, steps, cfg.decay_power))
    scaler = torch.amp.GradScaler(device.type) if dtype == "fp16" else None

    start = 0
    resume_from = _agreed_resume(cfg.resume, out, mesh) if restart == 0 else \
        _agreed_resume("latest", out, mesh) or _agreed_resume(cfg.resume, out, mesh)  # a restart resumes by itself
    if resume_from is not None and cfg.lora is not None:  # the adapters, their optimizer state, the RNG
        from cuboid.zoo.lora import load_checkpoint

        saved = load_checkpoint(model, resume_from, optimizer=optimizer, scheduler=scheduler)
    if resume_from is not None and cfg.lora is None:
        _verify_once(ckpt, resume_from, mesh)  # every file against its SHA-256 before any value is used
        ckpt.load(model, resume_from)
        saved = ckpt.load_training_state(resume_from, model, optimizer=optimizer, scheduler=scheduler)["state"]
    if resume_from is not None:
        start = int(saved["step"])
        batches.position = int(saved["data"]["position"])
        log(f"resumed from {resume_from} at step {start}" + (f" (restart {restart})" if restart else ""))
    elif restart:
        log(f"restart {restart}: no complete checkpoint in {out}, starting from step 0")
    skipped = _interrupted(out) if restart and mesh.is_main else []
    if skipped:
        log(f"restart {restart}: ignored the interrupted save(s) {', '.join(skipped)}")

    n_params = zoo.count_parameters(zoo.build(model.config))  # the whole model (a pp stage holds part of it)
    name = cfg.model if isinstance(cfg.model, str) else type(cfg.model).__name__
    timeout = f" (collective timeout {comm.timeout_s():g} s)" if mesh.world_size > 1 else ""
    log(f"cuboid finetune: {name} ({n_params:,} parameters), task {task}, plan {plan.describe()} "
        f"on {mesh.world_size} process(es){timeout}, {len(train_ds)} train / {len(eval_ds)} eval examples, "
        f"{steps} steps of {cfg.batch_size} (micro-batch {micro} x {accumulate} per rank), {cfg.optimizer} at peak "
        f"lr {peak_lr:.3g}" + (f" ({cfg.lr_scaling} scaling of {cfg.lr:g} at batch {cfg.reference_batch})"
                                if cfg.lr_scaling != "none" else "")
        + f", {warmup} warmup steps, {cfg.schedule} decay")
    metrics_path = out / "metrics.jsonl"
    if mesh.is_main and metrics_path.exists():
        # a fresh run starts a fresh log; a resumed one keeps the rows up to where it resumes
        kept = [line for line in metrics_path.read_text().splitlines()
                if resume_from is not None and line.strip() and json.loads(line)["step"] <= start]
        metrics_path.write_text("".join(line + "\n" for line in kept))
    history: list[dict] = []
    bar = None
    if mesh.is_main and cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, initial=start, desc="finetune", unit="step", dynamic_ncols=True)
    unit = "tokens" if task in ("causal", "mlm") else "samples"
    gen = torch.Generator()
    last_eval: dict = {}
    t0, seen = time.perf_counter(), 0
    for step in range(start, steps):
        model.train()
        batch = batches.next()
        if task == "mlm":
            gen.manual_seed(cfg.seed * 1_000_003 + step)
            batch = D.mask_tokens(batch, tokenizer, gen)
        dying = model.register_forward_pre_hook(lambda *_: Fault.kill()) if fault and fault.at("step", step + 1) \
            else None
        result = train_step(model, optimizer, batch, microbatches=accumulate, max_grad_norm=cfg.max_grad_norm,
                            dtype=dtype, scaler=scaler, mesh=mesh)
        if dying is not None:
            dying.remove()
        scheduler.step()
        seen += batch["input_ids"].numel() if unit == "tokens" else cfg.batch_size
        rate = seen / max(time.perf_counter() - t0, 1e-9)
        row = {"step": step + 1, "loss": result.loss, "lr": scheduler.get_last_lr()[0], "epoch": batches.epoch,
               f"{unit}_per_s": rate}
        if result.grad_norm is not None:
            row["grad_norm"] = result.grad_norm
        if not math.isfinite(result.loss):
            raise FloatingPointError(f"loss is {result.loss} at step {step + 1}: lower --lr or use --dtype fp32")
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            last_eval = evaluate(model, D.eval_batches(eval_t, max(micro, 64), mesh.coords["dp"], dp), mesh, dtype)
            row.update(last_eval)
        if mesh.is_main:
            history.append(row)
            if (step + 1) % cfg.log_every == 0 or "eval_loss" in row or step + 1 == steps:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
        if bar is not None:
            post = {"loss": f"{result.loss:.4f}", "lr": f"{row['lr']:.2e}", unit[:3] + "/s": f"{rate:.0f}"}
            if "accuracy" in last_eval:
                post["acc"] = f"{last_eval['accuracy']:.3f}"
            elif "perplexity" in last_eval:
                post["ppl"] = f"{last_eval['perplexity']:.1f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < steps:
            _save(ckpt, model, optimizer, scheduler, out / f"checkpoint-{step + 1}", step + 1, batches, plan, cfg, mesh,
                  fault)
    if bar is not None:
        bar.close()
    final_ckpt = out / f"checkpoint-{steps}"
    _save(ckpt, model, optimizer, scheduler, final_ckpt, steps, batches, plan, cfg, mesh, fault)
    final = out / "final"
    if cfg.lora is not None:  # the adapters in peft's layout (peft.PeftModel.from_pretrained(base, final))
        from cuboid.zoo.lora import save_adapters

        save_adapters(model, final, base=str(Path(cfg.model).resolve()) if isinstance(cfg.model, str)
                      and os.path.isdir(cfg.model) else None)
    else:
        ckpt.save(model, final)  # every rank takes part (gathers); one writes; replaced atomically
    if mesh.is_main and tokenizer is not None:
        tokenizer.save_pretrained(str(final))
    mesh.barrier()
    summary = {"step": steps, "task": task, **last_eval, "checkpoint": str(final_ckpt.resolve()),
               "model": str(final.resolve())}
    if mesh.is_main:
        if cfg.plot:
            summary["plot"] = plot_curves(metrics_path, (out / "curves.png").resolve())
        log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary


def _save(ckpt, model, optimizer, scheduler, path: Path, step: int, batches, plan: Plan, cfg: FinetuneConfig,
          mesh: Mesh, fault: Optional[Fault] = None) -> None:
    from cuboid.zoo.checkpoint import folder

    state = {"step": step, "data": {"position": batches.position}, "plan": plan.to_dict()}
    restore = folder.hook
    if fault is not None and fault.at("save", step):
        if not mesh.is_main:
            Fault.kill()
        files: list = []

        def die_on_second_file(stage: str) -> None:  # the writer: half the checkpoint is in the temporary folder
            files.extend([stage] if stage.startswith("file:") else [])
            if len(files) == 2:
                Fault.kill()
        folder.hook = die_on_second_file
    try:
        if cfg.lora is not None:  # adapters only, in peft's layout, with their optimizer state
            from cuboid.zoo.lora import save_checkpoint

            save_checkpoint(model, path, optimizer=optimizer, scheduler=scheduler, state=state)
        else:
            ckpt.save(model, path, optimizer=optimizer, scheduler=scheduler, state=state)
    finally:
        folder.hook = restore
    if mesh.is_main:
        for old in _checkpoints(path.parent)[:-max(cfg.keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
    mesh.barrier()
    if fault is not None and fault.at("saved", step):
        Fault.kill()


def plot_curves(metrics_path: Path, png: Path) -> Optional[str]:
    """Train/eval loss and the task metric against steps; None (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("note: matplotlib is not installed, so no plot (pip install 'cuboid[plot]')")
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows]
    evals = [r for r in rows if "eval_loss" in r]
    metric = "accuracy" if any("accuracy" in r for r in evals) else "perplexity"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(*zip(*train), label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        ax2.plot([r["step"] for r in evals], [r.get(metric) for r in evals], "o-", color="C2")
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel(f"eval {metric}"), ax2.grid(alpha=0.3)
    fig.suptitle(f"cuboid finetune: {metrics_path.parent}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)
