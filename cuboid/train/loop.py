"""The fine-tune loop: a zoo model, a plan, a dataset -> a trained, checkpointed model.

``cuboid.finetune(model, data, plan=..., ...)`` is the Python API; ``cuboid finetune``
(cuboid/cli/__init__.py) calls it with the flags. Every rank runs this same code; rank 0
prints, logs and draws. Outputs in ``output_dir``:

- ``checkpoint-<step>/``: sharded safetensors + optimizer + training state
  (the last ``keep`` of this run are kept), written through ``cuboid.zoo.checkpoint``
  (a LoRA run's: the adapters and their state, :mod:`cuboid.zoo.checkpoint.lora_state`);
  every one records the run's id, so pruning and ``--resume latest`` leave other runs'
  checkpoints alone, and a fresh run refuses a folder an earlier run used unless
  ``overwrite_output_dir`` (:mod:`cuboid.train.resume`);
- ``cuboid-run.json``: the id of the run that last started here;
- ``final/``: the trained model as a Hugging Face folder (config.json +
  safetensors [+ tokenizer]) that ``transformers`` loads, or a LoRA run's adapters (+ tokenizer) that
  ``peft`` loads; either written atomically under a commit record of every file's SHA-256;
- ``metrics.jsonl``: one JSON object per logged step and per eval;
- ``curves.png``: train/eval loss and the task metric (needs matplotlib, :mod:`cuboid.train.curves`).

:func:`run` reads as its steps: the plan and the mesh (:func:`start`), the data and the model
(:func:`load_data_and_model`), the batching (:func:`batching`), the optimizer (:func:`optimization`),
resuming (:func:`resume`), the loop (:func:`train`, one :func:`train_one_step` each) and the final
save (:func:`finish`). The run's state is one :class:`Run`, which callbacks
(:mod:`cuboid.train.callbacks`) see at each event.

Surviving faults: under torch's elastic launcher with ``--max-restarts`` a
dead rank makes the agent restart every worker; a restarted worker resumes
from the newest *complete* checkpoint of its run in ``output_dir`` (model, optimizer,
scheduler, RNG, data position; checksums verified; :mod:`cuboid.train.resume`),
so the run ends with the parameters of an uninterrupted one. ``timeout_s``
bounds every collective, so a hang becomes an error, and so a restart.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from cuboid.train.callbacks import Callbacks
from cuboid.train.curves import plot_curves
from cuboid import tasks
from cuboid.data.formats import (PREPARED_FLAGS, GlobalBatches, check_prepared, eval_batches, load_source,
                                 model_inputs, num_classes, real_tokens, train_eval_split)
from cuboid.train.config import FinetuneConfig, checked, data_options
from cuboid.loading.model import plan_of
from cuboid.parallel import Mesh, Plan, comm, init_distributed, prepare, unwrap
from cuboid.train.interrupt import Interrupted, StopOnInterrupt
from cuboid.train.models import load_model, make_optimizer
from cuboid.train.resume import (changed_settings, check_output_dir, decided_on_rank0, holds_output_dir,
                                 interrupted, keep_metrics, load_checkpoint, lock_output_dir, new_recipe,
                                 own_checkpoints, restart_count, resume_folder, run_id_of, run_settings,
                                 starting_folder, tidied_on_failure, unlock_output_dir, write_run_file)
from cuboid.train.schedule import lr_lambda, scaled_lr, warmup_steps
from cuboid.train.sizes import padding_line, set_cpu_threads, threads_kept, width_multiple
from cuboid.train.step import all_reduce_sum, evaluate, train_step
from cuboid.zoo import after_step, build, count_parameters, spec_of

__all__ = ["FinetuneConfig", "Run", "finetune", "run", "make_optimizer"]


def _is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log(msg: str) -> None:
    if _is_main():
        print(msg, file=sys.stderr, flush=True)


@dataclass
class Run:
    """One fine-tune's state, filled in by :func:`run`'s steps in order (None until its step ran)."""

    cfg: FinetuneConfig
    plan: Plan
    mesh: Mesh
    restart: int                          # how often the job was restarted (cuboid.train.resume.restart_count)
    device: torch.device
    callbacks: Callbacks
    output_dir: Path
    task: Optional[tasks.Task] = None
    model: Any = None
    tokenizer: Any = None
    train_examples: int = 0               # examples in the training and eval splits
    eval_examples: int = 0
    eval_data: Any = None                 # the prepared eval split
    batches: Any = None                   # GlobalBatches, or a StreamBatches (--streaming: this dp rank's share)
    steps: int = 0                        # optimizer steps of the whole run
    micro: int = 0                        # rows per rank per forward
    accumulate: int = 1                   # forwards per optimizer step
    warmup: int = 0
    eval_every: int = 1
    peak_lr: float = 0.0
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    start: int = 0                        # the step training starts after (resumed runs: the checkpoint's)
    resumed_from: Optional[Path] = None
    run_id: Optional[str] = None          # this run's id (a resumed run keeps its checkpoint's; cuboid.train.resume)
    last_eval: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    hf_fields: dict = field(default_factory=dict)  # special token ids config.json gains (cuboid.train.generation_config)
    generation_config: Optional[dict] = None       # generation_config.json of a causal LM's folders
    threads: Optional[str] = None         # the line that says a CPU run's intra-op threads (cuboid.train.sizes)

    @property
    def unit(self) -> str:
        """What the throughput counts: tokens (not padding) or samples (the task's unit)."""
        return self.task.unit

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / "metrics.jsonl"

    @property
    def streaming(self) -> bool:
        return bool(self.cfg.streaming)


# ---------------------------------------------------------------- the steps of a run


def finetune(model: Union[str, nn.Module] = "vit-debug", data: Any = "digits", **options) -> dict:
    """Fine-tune ``model`` on ``data``; returns the final metrics. Options: :class:`FinetuneConfig`."""
    unknown = sorted(set(options) - set(FinetuneConfig.__dataclass_fields__))
    if unknown:
        raise TypeError(f"finetune() got unknown options: {', '.join(unknown)}")
    return run(FinetuneConfig(model=model, data=data, **options))


def run(cfg: FinetuneConfig) -> dict:
    """The whole run (module docstring); the final metrics. A run that fails before it wrote anything of use
    leaves its output folder as it found it (:func:`cuboid.train.resume.tidied_on_failure`)."""
    with tidied_on_failure(Path(cfg.output_dir)), threads_kept():  # (a CPU run sets its own for its length)
        return _run(cfg)


def _run(cfg: FinetuneConfig) -> dict:
    """:func:`run`'s steps. The output folder's run lock, taken first (:func:`start`), is let go of however the
    run ends."""
    cfg = checked(cfg)
    outer = holds_output_dir(Path(cfg.output_dir))  # a run started inside another leaves the other's lock be
    try:
        r = start(cfg)
        load_data_and_model(r)
        special_tokens(r)
        batching(r)
        optimization(r)
        resume(r)
        announce(r)
        with StopOnInterrupt() as stop:  # a first Ctrl-C stops after a step (or lets the final save end the run)
            try:
                train(r, stop)
                return finish(r)
            except BaseException as e:  # (the trackers end their runs: killed, failed)
                r.callbacks.fire("on_train_abort", r, e)
                raise
    finally:
        if not outer:
            unlock_output_dir(Path(cfg.output_dir))


def start(cfg: FinetuneConfig) -> Run:
    """The plan (read once, here: an ``auto`` one searched after the timeout's process group), the
    collective timeout, the mesh, the restart count and the seeds."""
    peak_lr = scaled_lr(cfg.lr, cfg.batch_size, cfg.reference_batch, cfg.lr_scaling)  # a bad value: an error now
    if cfg.streaming and (not cfg.steps or cfg.epochs is not None):
        raise ValueError("--streaming needs --steps (and no --epochs): a stream has no length to count epochs in")
    if cfg.timeout_s is not None and not cfg.timeout_s > 0:
        raise ValueError(f"--timeout-s {cfg.timeout_s}: the process-group timeout must be positive seconds")
    from cuboid.loading.planner import is_auto

    if is_auto(cfg.plan) and cfg.timeout_s is not None:  # the search may start the process group
        init_distributed(timeout_s=cfg.timeout_s)
    plan = plan_of(cfg.plan, cfg.model, dtype=cfg.dtype, batch=cfg.batch_size, seq=cfg.seq_len)
    if cfg.dtype is not None:
        plan = plan.replace(dtype=cfg.dtype)
    plan.validate(None, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.timeout_s is not None:
        init_distributed(timeout_s=cfg.timeout_s)  # before the mesh: every group it makes gets this timeout
    mesh = Mesh.build(plan)
    restart = restart_count(mesh)
    decided_on_rank0(mesh, lambda: lock_output_dir(Path(cfg.output_dir)))  # one run at a time, before any write
    run_id = check_output_dir(Path(cfg.output_dir), cfg.resume, cfg.overwrite_output_dir, mesh, restart)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    return Run(cfg=cfg, plan=plan, mesh=mesh, restart=restart, device=device, callbacks=Callbacks(cfg.callbacks),
               output_dir=Path(cfg.output_dir), peak_lr=peak_lr, run_id=run_id,
               threads=set_cpu_threads() if device.type == "cpu" else None)


def load_data_and_model(r: Run) -> None:
    """The dataset first (its number of classes decides a fresh model's head), then the model and the
    task, then both splits prepared for the task."""
    cfg = r.cfg
    if cfg.streaming:
        return load_stream_and_model(r)
    check_prepared(cfg.data, {f: getattr(cfg, f) for f, *_ in PREPARED_FLAGS.values()})  # flags it cannot apply
    train_ds, eval_ds = train_eval_split(load_source(cfg.data), eval_fraction(cfg), cfg.seed, cfg.eval_data)
    if eval_ds is None:
        log("cuboid finetune: --eval-fraction 0 and no validation split: this run evaluates nothing"
            if cfg.eval_fraction is not None else f"cuboid finetune: task {cfg.task.label} trains on every example "
            "and the data has no validation split: no eval (--eval-fraction F holds some out)")
    num_labels = None
    if (cfg.task.classes if cfg.task is not None else cfg.label_column in train_ds.column_names):
        # a preset's head is sized by the data (ids 0..K-1 over both splits); a folder's is its own
        preset = isinstance(cfg.model, str) and not os.path.isdir(cfg.model)
        num_labels = num_classes(train_ds, cfg.label_column, *[eval_ds] * (eval_ds is not None), dense=preset)
    r.model, r.tokenizer, r.task = load_model(cfg, cfg.task, num_labels, r.device, r.plan, r.mesh)
    prep = data_options(cfg, r.model.config, r.tokenizer)
    train_data = tasks.prepare(train_ds, r.task, **prep)
    if cfg.eval_data is not None:  # a bad eval record's error names the eval file, not the training data's
        prep = dict(prep, source=cfg.eval_data if isinstance(cfg.eval_data, (str, os.PathLike)) else None)
    r.eval_data = None if eval_ds is None else model_inputs(tasks.prepare(eval_ds, r.task, **prep), routes(r.model))
    per = r.task.rows_per_example  # GRPO: completions a prompt; the batch size counts rows
    if cfg.batch_size % per:
        raise ValueError(f"--batch-size {cfg.batch_size} counts rows: it must be a multiple of the {per} the task "
                         f"{r.task.describe()} makes of each example")
    fit_to_data(r, len(next(iter(train_data.values()))) if train_data else 0)
    r.batches = GlobalBatches(train_data, r.cfg.batch_size // per, seed=cfg.seed,
                              width_multiple=width_multiple(r.plan))
    r.train_examples, r.eval_examples = len(train_ds), len(eval_ds) if eval_ds is not None else 0


def eval_fraction(cfg: FinetuneConfig) -> float:
    """The fraction held out for evaluation: ``--eval-fraction``, else the task's (0.1; GRPO trains on every
    prompt, as TRL does, unless a fraction is asked for)."""
    if cfg.eval_fraction is not None:
        return cfg.eval_fraction
    return cfg.task.eval_fraction if cfg.task is not None else tasks.Task.eval_fraction


def fit_to_data(r: Run, examples: int) -> None:
    """A global batch larger than the training split reduced to it (:func:`cuboid.train.sizes.fit_batch`);
    the peak lr follows the new batch under ``--lr-scaling``."""
    from cuboid.train.sizes import fit_batch

    cfg, plan = r.cfg, r.plan
    batch, line = fit_batch(cfg.batch_size, examples, per=r.task.rows_per_example, dp=r.mesh.size("dp"),
                            pipeline_microbatches=plan.microbatches if plan.pp > 1 else 1,
                            micro=cfg.micro_batch_size, unit_name="rows" if cfg.packing else "examples")
    if line is not None:
        log(line)
        r.cfg = dataclasses.replace(cfg, batch_size=batch)
        r.peak_lr = scaled_lr(cfg.lr, batch, cfg.reference_batch, cfg.lr_scaling)


def special_tokens(r: Run) -> None:
    """The special token ids and generation config a causal LM's folders carry
    (:mod:`cuboid.train.generation_config`)."""
    from cuboid.parallel import unwrap
    from cuboid.train.generation_config import special_ids

    options = getattr(r.task, "options", None)
    r.hf_fields, r.generation_config = special_ids(unwrap(r.model).config, r.tokenizer, r.cfg.model,
                                                   getattr(options, "chat_template", None) or r.cfg.chat_template)


def load_stream_and_model(r: Run) -> None:
    """:func:`load_data_and_model` for ``--streaming``: the model first (a stream is a text task's), then
    this dp rank's stream and the eval rows (:mod:`cuboid.data.streaming`)."""
    from cuboid.data.streaming import setup

    cfg = r.cfg
    r.model, r.tokenizer, r.task = load_model(cfg, cfg.task, None, r.device, r.plan, r.mesh)
    dp = r.mesh.size("dp")
    r.batches, eval_tensors, r.eval_examples = setup(
        data_options(cfg, r.model.config, r.tokenizer), cfg.data, r.task, rank=r.mesh.coords["dp"], world=dp,
        rows=max(cfg.batch_size // dp, 1), shuffle_buffer=cfg.shuffle_buffer, seed=cfg.seed,
        width_multiple=width_multiple(r.plan))
    r.eval_data = model_inputs(eval_tensors, routes(r.model))


def batching(r: Run) -> None:
    """Rows per rank per forward, forwards per step, the step count, warmup and the eval interval."""
    cfg, plan = r.cfg, r.plan
    dp = r.mesh.size("dp")
    micro = cfg.micro_batch_size or cfg.batch_size // (dp * (plan.microbatches if plan.pp > 1 else 1))
    if plan.pp > 1 and cfg.batch_size != dp * micro * plan.microbatches:
        raise ValueError(f"under pipeline parallelism a step runs the plan's {plan.microbatches} micro-batches: "
                         f"the global batch {cfg.batch_size} must be dp ({dp}) x {plan.microbatches} x the "
                         f"micro-batch ({micro})")
    if cfg.batch_size % (dp * micro):
        raise ValueError(f"global batch {cfg.batch_size} is not a multiple of dp ({dp}) x micro-batch ({micro})")
    r.micro, r.accumulate = micro, cfg.batch_size // (dp * micro)
    r.steps = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * r.batches.per_epoch))  # (a stream: --steps)
    r.warmup = warmup_steps(cfg.warmup, r.steps)
    r.eval_every = cfg.eval_every or max(1, r.steps // 4)


def optimization(r: Run) -> None:
    """The output folder, the model prepared for its plan, the optimizer, the lr schedule and (fp16) the
    gradient scaler."""
    cfg = r.cfg
    if r.mesh.is_main:
        r.output_dir.mkdir(parents=True, exist_ok=True)
    r.model = prepare(r.model, r.plan, r.mesh, spec_of(r.model))  # a no-op for what cuboid.load returned
    r.optimizer = make_optimizer(cfg.optimizer, r.model, r.peak_lr, cfg.weight_decay)
    r.scheduler = torch.optim.lr_scheduler.LambdaLR(r.optimizer, lr_lambda(cfg.schedule, r.warmup, r.steps,
                                                                           cfg.decay_power))
    r.scaler = torch.amp.GradScaler(r.device.type) if r.plan.dtype == "fp16" else None
    if not r.streaming:  # what the data gains from the model as it starts (DPO: the reference's log-probs)
        r.batches.tensors, r.eval_data = r.task.with_model(r.model, [r.batches.tensors, r.eval_data], device=r.device,
                                                           dtype=r.plan.dtype, lora=cfg.lora is not None,
                                                           reference=reference_copy(r))


def reference_copy(r: Run) -> Optional[nn.Module]:
    """A frozen copy of the policy as it starts, loaded again for the same plan (so sharded as the policy is),
    for a task that asks for one (GRPO's beta > 0 without LoRA: TRL's reference model); None otherwise."""
    if not r.task.wants_reference(lora=r.cfg.lora is not None):
        return None
    if isinstance(r.cfg.model, nn.Module):
        raise ValueError(f"task {r.task.label} with a reference model loads it again: give the model as a preset "
                         "or a folder (or train LoRA adapters: the reference is the base)")
    reference = load_model(r.cfg, r.task, None, r.device, r.plan, r.mesh)[0]
    reference.requires_grad_(False)
    return reference.eval()


def resume(r: Run) -> None:
    """Continue from ``cfg.resume`` (a restart: from the newest complete checkpoint): model, optimizer,
    scheduler, RNG and data position; the metrics log keeps its rows up to there (a fresh run starts a
    fresh log)."""
    restart = r.restart
    r.resumed_from = resume_folder(r.cfg.resume, r.output_dir, r.mesh, restart)
    if r.resumed_from is not None:
        settings = run_settings(r.cfg, r.task, r.steps)
        changed = None if restart else decided_on_rank0(r.mesh, lambda: changed_settings(r.resumed_from, settings))
        saved = load_checkpoint(r.resumed_from, r.model, r.optimizer, r.scheduler, r.mesh, r.cfg.lora is not None)
        if changed:
            log(changed)
            new_recipe(r.optimizer, r.scheduler, r.peak_lr)
        r.start = int(saved["step"])
        if r.start > r.steps:
            raise ValueError(f"--steps {r.steps} is below step {r.start} of {r.resumed_from}, which this run "
                             f"resumes from: nothing is left to train; give --steps above {r.start}")
        if r.streaming:
            from cuboid.data.streaming import saved_position

            r.batches.position = saved_position(saved["data"], r.mesh)
        elif "position" not in saved["data"]:
            raise ValueError(f"{r.resumed_from} was written by a --streaming run: resume it with --streaming")
        else:
            r.batches.position = int(saved["data"]["position"])
        r.task.load_state_dict(saved.get("task", {}))  # GRPO: the generation the next step reuses
        log(f"resumed from {r.resumed_from} at step {r.start}" + (f" (restart {restart})" if restart else ""))
    elif restart:
        log(f"restart {restart}: no complete checkpoint in {r.output_dir}, starting from step 0")
    r.run_id = decided_on_rank0(r.mesh, lambda: run_of(r, restart))
    if r.mesh.is_main:
        write_run_file(r.output_dir, r.run_id, model=starting_folder(r.cfg.model))
    skipped = interrupted(r.output_dir) if restart and r.mesh.is_main else []
    if skipped:
        log(f"restart {restart}: ignored the interrupted save(s) {', '.join(skipped)}")
    if r.mesh.is_main and r.metrics_path.exists():
        note = keep_metrics(r.metrics_path, r.start if r.resumed_from is not None else None)
        if note:
            log(note)


def routes(model) -> bool:
    """Whether ``model`` routes tokens to experts (its packed batches keep their padding mask)."""
    from cuboid.parallel import unwrap

    return bool(getattr(unwrap(model).config, "sparse_layers", None))


def run_of(r: Run, restart: int) -> str:
    """This run's id: the resumed checkpoint's, or a new one when the resume is a rewind (the run has newer
    checkpoints in the output folder: they stay the abandoned branch's, so ``--keep``, ``--resume latest``
    and restarts never take them for this run's); a fresh run's, the one :func:`start` recorded; a
    restart's, the one its first attempt recorded in the output folder (a rewind's branch too)."""
    from cuboid.train.resume import folder_run_id, newer_checkpoints

    found = run_id_of(r.resumed_from) if r.resumed_from is not None else None
    if restart:
        return folder_run_id(r.output_dir) or found or r.run_id or uuid.uuid4().hex
    if found is not None and newer_checkpoints(r.output_dir, found, r.start):
        log(f"resuming step {r.start} of a run with newer checkpoints: a new branch of the run, which leaves "
            f"them ({', '.join(p.name for p in newer_checkpoints(r.output_dir, found, r.start))}) to the old one")
        return uuid.uuid4().hex
    return found or r.run_id or uuid.uuid4().hex


def announce(r: Run) -> None:
    """The run in one line on rank 0: model, task, plan, data, steps, batch and learning rate."""
    cfg = r.cfg
    n_params = count_parameters(build(r.model.config))  # the whole model (a pp stage holds part of it)
    name = cfg.model if isinstance(cfg.model, str) else type(cfg.model).__name__
    timeout = f" (collective timeout {comm.timeout_s():g} s)" if r.mesh.world_size > 1 else ""
    train = "streamed" if r.streaming else str(r.train_examples)
    log(f"cuboid finetune: {name} ({n_params:,} parameters), task {r.task.describe()}, plan {r.plan.describe()} "
        f"on {r.mesh.world_size} process(es){timeout}, {train} train / {r.eval_examples} eval examples, "
        f"{r.steps} steps of {cfg.batch_size} (micro-batch {r.micro} x {r.accumulate} per rank), {cfg.optimizer} "
        f"at peak lr {r.peak_lr:.3g}" + (f" ({cfg.lr_scaling} scaling of {cfg.lr:g} at batch {cfg.reference_batch})"
                                         if cfg.lr_scaling != "none" else "")
        + f", {r.warmup} warmup steps, {cfg.schedule} decay")
    if r.threads is not None:
        log(r.threads)
    if r.streaming:
        log(r.batches.describe() + "; tokens/s counts real tokens")
    elif "input_ids" in r.batches.tensors:
        log(padding_line(r.batches.tensors, cfg.batch_size) + ("; tokens/s counts real tokens"
                                                              if r.unit == "tokens" else ""))


def train(r: Run, stop: StopOnInterrupt) -> None:
    """Steps ``start + 1 .. steps``: each one logged, evaluated and checkpointed on its interval; ``stop``
    says whether Ctrl-C asked for the run to stop (:func:`steps`)."""
    r.callbacks.fire("on_train_begin", r)
    bar = None
    if r.mesh.is_main and r.cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=r.steps, initial=r.start, desc="finetune", unit="step", dynamic_ncols=True)
    try:
        steps(r, bar, stop)
    finally:
        if bar is not None:
            bar.close()


def steps(r: Run, bar, stop: StopOnInterrupt) -> None:
    """The steps of :func:`train`; after each, every rank learns whether Ctrl-C asked any to stop, and all
    save that step and raise :class:`~cuboid.train.interrupt.Interrupted` (:mod:`cuboid.train.interrupt`)."""
    t0, seen = time.perf_counter(), 0
    for step in range(r.start + 1, r.steps + 1):
        r.callbacks.fire("on_step_begin", r, step)
        result, counted = train_one_step(r, step)
        seen += counted
        rate = seen / max(time.perf_counter() - t0, 1e-9)
        row = {"step": step, "loss": result.loss, "lr": r.scheduler.get_last_lr()[0], "epoch": r.batches.epoch,
               f"{r.unit}_per_s": rate}
        if result.grad_norm is not None:
            row["grad_norm"] = result.grad_norm
        row.update(r.task.step_log(result, step, r.output_dir if r.mesh.is_main else None))  # a task's own
        if not math.isfinite(result.loss):
            raise FloatingPointError(f"loss is {result.loss} at step {step}: lower --lr or use --dtype fp32")
        if r.eval_data is not None and (step % r.eval_every == 0 or step == r.steps):
            own = r.task.evaluate(r.model, r.eval_data, tokenizer=r.tokenizer, step=step)  # (GRPO's rewards)
            r.last_eval = own if own is not None else evaluate(
                r.model, eval_batches(r.eval_data, max(r.micro, 64), r.mesh.coords["dp"], r.mesh.size("dp")), r.mesh,
                r.plan.dtype, task=r.task)
            row.update(r.last_eval)
        record(r, row)
        if bar is not None:
            show_progress(bar, row, r.last_eval.get(r.task.metric, row.get(r.task.metric)), r.task.metric, r.unit,
                          rate)
        r.callbacks.fire("on_step_end", r, step, row)
        saved = r.cfg.save_every and step % r.cfg.save_every == 0 and step < r.steps
        if saved:
            save(r, step)
        if stop.agreed(r.mesh.world_size, r.device) and step < r.steps:
            raise Interrupted(step, r.steps, (r.output_dir / f"checkpoint-{step}") if saved else save(r, step))


def train_one_step(r: Run, step: int):
    """Optimizer step ``step`` (1-based) on the next global batch (as the task makes it: MLM masks it), the
    lr schedule stepped: (the :class:`cuboid.train.step.StepResult`, the samples or real tokens it trained on)."""
    r.model.train()
    data = r.batches.next() if r.task.takes_data(step) else None  # (GRPO's later iterations: None)
    batch = r.task.before_step(data, step, tokenizer=r.tokenizer, seed=r.cfg.seed)
    counted = real_tokens(batch) if r.unit == "tokens" else r.cfg.batch_size
    if r.streaming:  # the batch is this dp rank's share: the step's tokens are summed over dp
        counted = int(all_reduce_sum([counted], r.mesh, r.device)[0])
    result = train_step(r.model, r.optimizer, model_inputs(batch, routes(r.model)), microbatches=r.accumulate,
                        max_grad_norm=r.cfg.max_grad_norm, dtype=r.plan.dtype, scaler=r.scaler, mesh=r.mesh,
                        share=r.streaming, task=r.task)
    after_step(unwrap(r.model))  # the family's own (DeepSeek-V3: the routers' biases, from this step's loads)
    r.scheduler.step()
    return result, counted


def record(r: Run, row: dict) -> None:
    """Rank 0 keeps the row and writes it to ``metrics.jsonl`` every ``log_every`` steps, at evals and last."""
    if not r.mesh.is_main:
        return
    r.history.append(row)
    if row["step"] % r.cfg.log_every == 0 or "eval_loss" in row or row["step"] == r.steps:
        with open(r.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        r.callbacks.fire("on_log", r, row)  # the trackers (--report-to) get the rows metrics.jsonl gets


def show_progress(bar, row: dict, figure: Optional[float], metric: str, unit: str, rate: float) -> None:
    """The bar's step and its line: loss, lr, throughput and the last eval's ``metric`` (``figure``)."""
    post = {"loss": f"{row['loss']:.4f}", "lr": f"{row['lr']:.2e}", unit[:3] + "/s": f"{rate:.0f}"}
    if figure is not None:
        post[metric] = f"{figure:.4g}"
    bar.set_postfix(post, refresh=False)
    bar.update(1)


def save(r: Run, step: int) -> Path:
    """``checkpoint-<step>``: model (LoRA: the adapters, in peft's layout), optimizer, scheduler, RNG and data
    position, written atomically; the oldest beyond ``keep`` removed."""
    from cuboid.zoo import checkpoint as ckpt

    path = r.output_dir / f"checkpoint-{step}"
    if r.streaming:  # every dp rank's stream position (a collective), so each resumes where it was
        from cuboid.data.streaming import gather_positions

        data = {"stream": gather_positions(r.batches, r.mesh)}
    else:
        data = {"position": r.batches.position}
    state = {"step": step, "data": data, "plan": r.plan.to_dict(), "run_id": r.run_id,
             "run": run_settings(r.cfg, r.task, r.steps)}
    kept = r.task.state_dict()  # what the task holds between steps (GRPO's rollouts)
    if kept:
        state["task"] = kept
    r.callbacks.fire("on_save_begin", r, step, path)
    with r.callbacks.save_files(r, step):
        if r.cfg.lora is not None:
            from cuboid.zoo.lora import save_checkpoint

            save_checkpoint(r.model, path, optimizer=r.optimizer, scheduler=r.scheduler, state=state,
                            base=starting_folder(r.cfg.model), tokenizer=r.tokenizer,
                            generation_config=r.generation_config)
        else:
            ckpt.save(r.model, path, optimizer=r.optimizer, scheduler=r.scheduler, state=state,
                      tokenizer=r.tokenizer, config_fields=r.hf_fields, generation_config=r.generation_config)
    if r.mesh.is_main:
        for old in own_checkpoints(path.parent, r.run_id)[:-max(r.cfg.keep, 1)]:  # never another run's
            shutil.rmtree(old, ignore_errors=True)
    r.mesh.barrier()
    r.callbacks.fire("on_save", r, step, path)
    return path


def finish(r: Run) -> dict:
    """The last checkpoint, ``final/`` (a Hugging Face folder with the tokenizer, or LoRA adapters in peft's
    layout), the plot and the summary line; returns the summary."""
    from cuboid.zoo import checkpoint as ckpt

    cfg = r.cfg
    final_ckpt = save(r, r.steps)
    final = r.output_dir / "final"
    # every rank takes part (gathers); one writes, the tokenizer inside the commit; replaced atomically
    if cfg.lora is not None:  # peft.PeftModel.from_pretrained(base, final) reads it
        from cuboid.zoo.lora import save_adapters

        save_adapters(r.model, final, base=starting_folder(cfg.model), tokenizer=r.tokenizer,
                      generation_config=r.generation_config)
    else:
        ckpt.save(r.model, final, tokenizer=r.tokenizer, config_fields=r.hf_fields,
                  generation_config=r.generation_config)
    r.mesh.barrier()
    summary = {"step": r.steps, "task": r.task.describe(), **r.task.summary(r.history), **r.last_eval,
               "checkpoint": str(final_ckpt.resolve()), "model": str(final.resolve())}
    if r.mesh.is_main:
        if cfg.plot:
            summary["plot"] = plot_curves(r.metrics_path, (r.output_dir / "curves.png").resolve(), r.task.metric)
        log("done: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    r.callbacks.fire("on_train_end", r, summary)
    return summary
