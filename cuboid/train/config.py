"""What a fine-tune run is asked to do: :class:`FinetuneConfig` (every knob; the CLI's flags and
``--config`` files map onto its names), the task names, and the checks that need no model or data."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cuboid.data.formats import TASKS
from cuboid.train.schedule import LR_SCALINGS, SCHEDULES, lr_lambda

TASK_OF_HEAD = {("gpt", "lm"): "causal", ("bert", "mlm"): "mlm", ("bert", "cls"): "seqcls", ("vit", "cls"): "imgcls",
                ("llama", "lm"): "causal", ("llama", "cls"): "seqcls"}
TASK_ALIASES = {"clm": "causal"}  # the name transformers' run_clm.py gives causal language modelling
HEAD_OF_TASK = {"causal": "lm", "sft": "lm", "mlm": "mlm", "seqcls": "cls", "imgcls": "cls"}
ALSO_DOES = {"causal": ("sft",)}  # a head's task -> the other tasks it takes when asked (--task sft: an LM head)
OPTIMIZERS = ("adamw", "lamb", "lars")
PYTHON_ONLY = ("callbacks",)  # fields that no flag or --config file sets


@dataclass
class FinetuneConfig:
    """Every knob of a run; the CLI's flags and ``--config`` files map onto these names."""

    model: Any = "vit-debug"              # a preset, a local Hugging Face folder, or a zoo module
    data: Any = "digits"
    plan: Any = None                      # a Plan, or what cuboid.loading.model.plan_of reads (names, files, "auto")
    task: Optional[str] = None            # default: from the model's head
    steps: Optional[int] = None           # optimizer steps; default from epochs
    epochs: Optional[float] = None        # default 1 when steps is not given
    batch_size: int = 32                  # global batch (all dp ranks, all micro-batches)
    micro_batch_size: Optional[int] = None  # per rank; default batch_size / dp (no accumulation)
    lr: float = 1e-3                      # peak lr at reference_batch (scaled to batch_size by lr_scaling)
    optimizer: str = "adamw"              # adamw | lamb | lars (1-D params: no decay, no trust ratio)
    weight_decay: float = 0.01
    warmup: float = 0.1                   # fraction of steps (< 1) or a step count (>= 1)
    schedule: str = "cosine"              # after warmup: cosine | linear | constant | poly (cuboid/train/schedule.py)
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
    overwrite_output_dir: bool = False    # a fresh run into an output_dir an earlier run left files in
    lora: Any = None                      # LoRA adapters only: "r=16,alpha=32[,dropout=0.05][,targets=attn+mlp]"
    seed: int = 0
    timeout_s: Optional[float] = None     # process-group timeout (CUBOID_TIMEOUT_S; default 300 s)
    seq_len: Optional[int] = None         # tokens per row of a text task (packing: the packed row's length)
    packing: bool = False                 # causal LM / sft: each record a document, packed into rows (cuboid.data.packing)
    train_on_prompt: bool = False         # sft: train every token, not only the answers
    template: Optional[str] = None        # sft: a named prompt template for instruction data (alpaca)
    data_format: Optional[str] = None     # sft: messages | prompt_completion | alpaca | text; default from the columns
    chat_template: Optional[str] = None   # sft: a Jinja chat template file instead of the tokenizer's
    streaming: bool = False               # read local files as a stream (datasets IterableDataset)
    shuffle_buffer: int = 1000            # streaming: examples in the shuffle buffer
    tokenizer: Optional[str] = None
    text_column: str = "text"
    label_column: str = "label"
    image_column: str = "image"
    eval_fraction: float = 0.1
    log_every: int = 10
    progress: bool = True
    plot: bool = True
    callbacks: Sequence[Any] = ()         # cuboid.train.callbacks.TrainerCallback instances (Python API only)


def checked(cfg: FinetuneConfig) -> FinetuneConfig:
    """``cfg`` with its task alias resolved; a one-sentence ValueError for an unknown optimizer, schedule,
    lr scaling or task, a bad decay power, or packing for a task other than causal LM, before any work."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; optimizers: {', '.join(OPTIMIZERS)}")
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; schedules: {', '.join(SCHEDULES)}")
    if cfg.lr_scaling not in LR_SCALINGS:
        raise ValueError(f"unknown lr scaling {cfg.lr_scaling!r}; scalings: {', '.join(LR_SCALINGS)}")
    lr_lambda(cfg.schedule, 0, 1, cfg.decay_power)  # a bad --decay-power is an error here
    if cfg.task in TASK_ALIASES:
        cfg = dataclasses.replace(cfg, task=TASK_ALIASES[cfg.task])
    if cfg.task is not None and cfg.task not in TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; tasks: {', '.join(TASKS)} (clm: causal)")
    if cfg.packing and cfg.task not in (None, "causal", "sft"):
        raise ValueError(f"--packing packs documents for causal language modelling or sft (--task clm or sft), "
                         f"not {cfg.task}")
    _check_sft(cfg)
    return cfg


def _check_sft(cfg: FinetuneConfig) -> None:
    from cuboid.data.sft import FORMATS, TEMPLATES

    if cfg.template is not None and cfg.template not in TEMPLATES:
        raise ValueError(f"unknown --template {cfg.template!r}; templates: {', '.join(TEMPLATES)}")
    if cfg.data_format is not None and cfg.data_format not in FORMATS:
        raise ValueError(f"unknown --data-format {cfg.data_format!r}; formats: {', '.join(FORMATS)}")
    sft_only = [flag for flag, value in (("--train-on-prompt", cfg.train_on_prompt), ("--template", cfg.template),
                                         ("--data-format", cfg.data_format), ("--chat-template", cfg.chat_template))
                if value]
    if sft_only and cfg.task != "sft":
        raise ValueError(f"{' and '.join(sft_only)} apply to --task sft, not "
                         f"{cfg.task or 'the task of the model head'}")
    if cfg.shuffle_buffer < 1:
        raise ValueError(f"--shuffle-buffer {cfg.shuffle_buffer}: the buffer holds at least 1 example")


def task_fits_head(task: str, inferred: Optional[str]) -> bool:
    """Whether a model whose head does ``inferred`` takes ``task`` (an LM head does causal and sft)."""
    return task == inferred or task in ALSO_DOES.get(inferred, ())


def data_options(cfg: FinetuneConfig, config, tokenizer=None) -> dict:
    """The keyword arguments of :func:`cuboid.data.formats.prepare` for this run (the task is passed beside them):
    the columns, the row length, packing, and for sft the :class:`cuboid.data.sft.SFTOptions`."""
    out = dict(config=config, tokenizer=tokenizer, seq_len=cfg.seq_len, text_column=cfg.text_column,
               label_column=cfg.label_column, image_column=cfg.image_column,
               num_labels=getattr(config, "num_labels", None), packing=cfg.packing)
    if cfg.task == "sft":
        out["sft"] = sft_options(cfg, config)
    return out


def sft_options(cfg: FinetuneConfig, config=None):
    """The :class:`cuboid.data.sft.SFTOptions` of a run: max length ``seq_len`` (default 1024, at most the
    model's positions), the text column when it is not the default ``text``."""
    from cuboid.data.sft import SFTOptions

    max_length = cfg.seq_len or 1024
    if config is not None and getattr(config, "n_positions", None):
        max_length = min(max_length, config.n_positions)
    return SFTOptions(format=cfg.data_format, template=cfg.template, train_on_prompt=cfg.train_on_prompt,
                      max_length=max_length, text_column=None if cfg.text_column == "text" else cfg.text_column,
                      chat_template=cfg.chat_template)
