"""What a fine-tune run is asked to do: :class:`FinetuneConfig` (every knob; the CLI's flags and
``--config`` files map onto its names) and the checks that need no model or data."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cuboid import tasks
from cuboid.train.schedule import LR_SCALINGS, SCHEDULES, lr_lambda

OPTIMIZERS = ("adamw", "lamb", "lars", "muon")
PYTHON_ONLY = ("callbacks",)  # fields that no flag or --config file sets


@dataclass
class FinetuneConfig:
    """Every knob of a run; the CLI's flags and ``--config`` files map onto these names."""

    model: Any = "vit-debug"              # a preset, a local Hugging Face folder, or a zoo module
    data: Any = "digits"
    plan: Any = None                      # a Plan, or what cuboid.loading.model.plan_of reads (names, files, "auto")
    task: Any = None                      # a task name with options ("sft,train_on_prompt=true"), a table or a
                                          # cuboid.tasks.Task; default: the task of the model's head
    steps: Optional[int] = None           # optimizer steps; default from epochs
    epochs: Optional[float] = None        # default 1 when steps is not given
    batch_size: int = 32                  # global batch (all dp ranks, all micro-batches)
    micro_batch_size: Optional[int] = None  # per rank; default batch_size / dp (no accumulation)
    lr: float = 1e-3                      # peak lr at reference_batch (scaled to batch_size by lr_scaling)
    optimizer: str = "adamw"              # adamw | lamb | lars | muon (1-D params: no decay, no trust ratio;
                                          # muon: hidden matrices orthogonalised, the rest AdamW at the same lr)
    weight_decay: float = 0.01
    warmup: float = 0.1                   # fraction of steps (< 1) or a step count (>= 1)
    schedule: str = "cosine"              # after warmup: cosine | linear | constant | poly (cuboid/train/schedule.py)
    decay_power: float = 1.0              # poly: lr * (1 - progress) ** decay_power
    lr_scaling: str = "none"              # none | linear | sqrt: lr * (batch_size / reference_batch) [** 0.5]
    reference_batch: int = 256            # the global batch lr was tuned at
    max_grad_norm: Optional[float] = 1.0
    moe_bias_update_rate: float = 0.0     # DeepSeek-V3's routers: bias += rate * sign(mean load - load) after each
                                          # step, loads summed over dp, ep and sp (0: off)
    dtype: Optional[str] = None           # fp32 | bf16 | fp16 (autocast); default: the plan's
    eval_every: Optional[int] = None      # default: 4 evals per run
    save_every: Optional[int] = None      # default: at the end only
    keep: int = 2                         # checkpoints kept
    output_dir: str = "runs/finetune"
    resume: Optional[str] = None          # "latest", a checkpoint folder, or None
    overwrite_output_dir: bool = False    # a fresh run into an output_dir an earlier run left files in
    lora: Any = None                      # LoRA adapters only: "r=16,alpha=32[,dropout=0.05][,targets=attn+mlp]"
    quantize: Optional[str] = None        # "nf4": a frozen 4-bit base under the LoRA adapters (QLoRA)
    seed: int = 0
    timeout_s: Optional[float] = None     # process-group timeout (CUBOID_TIMEOUT_S; default 300 s)
    seq_len: Optional[int] = None         # tokens per row of a text task (packing: the packed row's length)
    packing: bool = False                 # causal LM / sft: each record a document, packed into rows (cuboid.data.packing)
    # options of the task (spelled as flags of their own; cuboid.tasks.lm.SFTOptions says what they do)
    train_on_prompt: bool = False
    template: Optional[str] = None
    data_format: Optional[str] = None
    chat_template: Optional[str] = None
    task_options: dict = dataclasses.field(default_factory=dict)  # other task options given as flags of their
                                          # own ({"beta": 0.1}: task_flags() lists them; the task's Options decide)
    streaming: bool = False               # read local files as a stream (datasets IterableDataset)
    shuffle_buffer: int = 1000            # streaming: examples in the shuffle buffer
    tokenizer: Optional[str] = None
    text_column: str = "text"
    label_column: str = "label"
    image_column: str = "image"
    eval_fraction: Optional[float] = None  # held out without a validation split (None: the task's, 0.1; GRPO 0;
                                          # 0: no eval)
    eval_data: Any = None                 # a source of its own for the eval split (a file, a folder, a Dataset)
    log_every: int = 10
    progress: bool = True
    plot: bool = True
    report_to: Any = None                 # experiment trackers: none | all | trackio,tensorboard,wandb,mlflow (a
                                          # comma string or a list; cuboid.train.trackers)
    callbacks: Sequence[Any] = ()         # cuboid.train.callbacks.TrainerCallback instances (Python API only)


TASK_FLAGS = ("train_on_prompt", "template", "data_format", "chat_template")  # task options that are config fields


def task_flags() -> dict:
    """The task options that are flags of their own (beyond the run's own fields, such as :data:`TASK_FLAGS`):
    ``{option: [(task name, dataclasses.Field), ...]}`` over the registered tasks, in registration order.

    A task adds a flag by marking an option of its ``Options`` dataclass with ``metadata={"flag": True}``
    (``help``: its text; ``choices``: the values it takes, for the help; ``append``: the flag may be given
    again, its values a list): ``beta: float =
    field(default=0.1, metadata={"help": "...", "flag": True})`` is ``--beta`` on ``cuboid finetune`` and
    ``cuboid eval``. The flag has no default of its own: unset, the chosen task's ``Options`` default
    stands, so two tasks may share a flag name with their own defaults and choices (``--beta`` of dpo and
    grpo); a flag given for a task that has no such option is refused (:func:`with_flags`). Its value is
    parsed as the option's type (bool: a switch)."""
    out: dict = {}
    for name in tasks.names():
        for f in dataclasses.fields(tasks.get(name).Options):
            if f.metadata.get("flag") and f.name not in FinetuneConfig.__dataclass_fields__:  # (those have theirs)
                out.setdefault(f.name, []).append((name, f))
    return out


def flag_type(f: dataclasses.Field):
    """The argparse type of an option's flag (``bool``: a switch)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for typ in (bool, int, float):
        if typ.__name__ in kind and "str" not in kind:
            return typ
    return str


def add_task_flags(parser) -> None:
    """Every :func:`task_flags` option as ``--name`` on ``parser`` (default None: the task's default stands),
    its help naming the tasks that take it, with their defaults and choices."""
    for option, owners in task_flags().items():
        parts = [f"{task}: {option_help(f)}" for task, f in owners]
        flag = "--" + option.replace("_", "-")
        typ = flag_type(owners[0][1])
        if typ is bool:
            parser.add_argument(flag, action="store_true", default=None, help="; ".join(parts))
        elif any(f.metadata.get("append") for _, f in owners):  # given again for more (grpo's --reward): a list
            parser.add_argument(flag, action="append", type=typ, default=None, help="; ".join(parts),
                                metavar=metavar(option, typ))
        else:
            parser.add_argument(flag, type=typ, default=None, help="; ".join(parts), metavar=metavar(option, typ))


def option_help(f: dataclasses.Field) -> str:
    """A task option's help with its default and choices, each said once: a default the text gives already,
    None or a switch's False is not repeated, nor choices the text lists."""
    text, choices = f.metadata.get("help", ""), f.metadata.get("choices")
    extra = []
    if "default" not in text and f.default is not None and f.default is not False \
            and f.default is not dataclasses.MISSING:
        extra.append(f"default {f.default}")
    if choices and not all(c in text for c in choices):
        extra.append(" | ".join(choices))
    return text + (f" ({'; '.join(extra)})" if extra else "")


def metavar(name: str, typ) -> str:
    """The short placeholder a flag's help shows for its value: N (a count), X (a number), or its name."""
    if typ is int:
        return "N"
    if typ is float:
        return "X"
    word = name.rsplit("_", 1)[-1].upper()
    return word if len(word) <= 8 else "VALUE"


def checked(cfg: FinetuneConfig) -> FinetuneConfig:
    """``cfg`` with its task resolved to a :class:`cuboid.tasks.Task` (None: the model's head decides), a hub
    id of a model found in the Hugging Face cache (or downloaded) as its local folder (:mod:`cuboid.loading.hub`)
    and the ``report_to`` trackers' callback added (:mod:`cuboid.train.trackers`); a one-sentence ValueError
    for an unknown optimizer, schedule, lr scaling, task or task option, a bad decay power, packing or
    streaming for a task that does neither, an unknown tracker or one not installed, before any work."""
    from cuboid.train.limits import check_numbers

    check_numbers({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})  # every count and rate in range
    if cfg.quantize is not None:
        from cuboid.parallel.quant import check_quantize

        check_quantize(cfg.quantize)
        if cfg.lora is None:
            raise ValueError(f"--quantize {cfg.quantize} freezes the base in 4 bits, which takes no gradient: full "
                             f"fine-tuning of a 4-bit base is not possible; add --lora (QLoRA)")
    if cfg.lora is not None and not (isinstance(cfg.lora, str) and os.path.isdir(cfg.lora)):  # (a peft folder)
        from cuboid.parallel.lora import LoraConfig

        LoraConfig.parse(cfg.lora)  # a bad --lora value is one sentence now, before any work
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; optimizers: {', '.join(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if cfg.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {cfg.lr_scaling!r}; scalings: {', '.join(LR_SCALINGS)}")
    lr_lambda(cfg.schedule, 0, 1, cfg.decay_power)  # a bad --decay-power is an error here
    if cfg.streaming and cfg.eval_data is not None:
        raise ValueError("--eval-data is not read with --streaming: a stream's eval rows are its folder's eval file "
                         "(validation.jsonl, ...) or its first rows")
    if cfg.shuffle_buffer < 1:
        raise ValueError(f"--shuffle-buffer {cfg.shuffle_buffer}: the buffer holds at least 1 example")
    unknown = sorted(set(cfg.task_options) - set(task_flags()))
    if unknown:
        raise ValueError(f"unknown task option flag(s) {', '.join(unknown)}; they are: {', '.join(task_flags())}")
    task = with_flags(cfg.task, {**{k: getattr(cfg, k) for k in TASK_FLAGS}, **cfg.task_options})
    if task is not None:
        task.check(packing=cfg.packing, streaming=cfg.streaming)
    from cuboid.loading.hub import locate
    from cuboid.train import trackers

    report_to = trackers.parse(cfg.report_to)  # an unknown tracker or a missing package: an error now
    extra = [] if any(isinstance(cb, trackers.Reporter) for cb in cfg.callbacks) else trackers.callbacks(report_to)
    return dataclasses.replace(cfg, task=task, model=locate(cfg.model), report_to=report_to,
                               callbacks=[*cfg.callbacks, *extra])


def _fields(options: type) -> set:
    return {f.name for f in dataclasses.fields(options)}


def with_flags(task, flags: dict):
    """``task`` (a name with options, a table, a Task or None) resolved, with the task options given as flags
    of their own (``flags``: {option: value}, unset ones None or False) joined to it; a one-sentence
    ValueError for a flag its task has no option for."""
    given = {k: v for k, v in flags.items() if v is not None and v is not False}
    if task is not None:
        options = _fields(tasks.class_of(task).Options)
        task = tasks.resolve(task, **{k: v for k, v in given.items() if k in options})
    foreign = [k for k in given if task is None or k not in _fields(task.Options)]
    if foreign:
        takers = [n for n in tasks.names() if set(foreign) <= _fields(tasks.get(n).Options)]
        names = " and ".join("--" + k.replace("_", "-") for k in foreign)
        raise ValueError(f"{names} apply to --task {' or '.join(takers) or 'none'}, not "
                         f"{task.label if task is not None else 'the task of the model head'}")
    return task


def data_options(cfg: FinetuneConfig, config, tokenizer=None) -> dict:
    """The keyword arguments of a task's rows for this run (:func:`cuboid.tasks.prepare`): the model's
    config, the tokenizer, the columns, the row length, packing, and the data's path (``source``: a bad
    record's error names its file and line)."""
    return dict(config=config, tokenizer=tokenizer, seq_len=cfg.seq_len, text_column=cfg.text_column,
                label_column=cfg.label_column, image_column=cfg.image_column,
                num_labels=getattr(config, "num_labels", None), packing=cfg.packing,
                source=cfg.data if isinstance(cfg.data, (str, os.PathLike)) else None)
