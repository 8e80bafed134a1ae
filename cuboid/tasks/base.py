"""What a training objective is: :class:`Task`, its options, and the registry of named tasks.

A task is a small object, not a string: which model heads it trains
(``heads``, and ``families`` where a head means different things), what its
step's denominator counts (``unit``: tokens, samples, pairs; :meth:`count`,
decided from the batch before the forward), the eval figure it reports
(``metric``), the batch keys its loss reads that are not model inputs
(``targets``), its own frozen :class:`Options` dataclass, and four methods:

- :meth:`check`: one-sentence refusals that need no data (packing, streaming);
- :meth:`rows` / :meth:`example`: records into rows, offline (a whole split)
  and streaming (one record at a time), the same code ``cuboid prepare`` runs;
- :meth:`with_model`: what the prepared data gains from the model once,
  before training (DPO's reference log-probs);
- :meth:`before_step`: what happens to a global batch before a step (MLM
  masks; DPO's pairs made rows; GRPO's rollouts), and :meth:`step_log`:
  what the step's metrics row gains after it;
- :meth:`loss`: ``(summed loss, summed metrics)`` of one micro-batch's
  outputs. The step (:func:`cuboid.train.step.train_step`) divides by the
  global count over micro-batches and dp ranks, so each step is one device's.

Built-in tasks whose loss is the model's own (``own_loss = False``: causal
LM, SFT, MLM, classification) keep the model's mean loss, weighed by
:meth:`count`; a task with ``own_loss = True`` backpropagates its
:meth:`loss` instead, on one device's outputs (the model gathers what its
plan split). A user's task subclasses :class:`Task` and is passed as an object
(``cuboid.train_step(..., task=MyTask())``, ``cuboid.finetune(..., task=MyTask())``);
named tasks are looked up with :func:`get` and spelled with their options
like plans and LoRA: ``sft,train_on_prompt=true``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from cuboid.data.formats import DataError

__all__ = ["Task", "NoOptions", "TaskError", "register", "get", "names", "resolve", "class_of", "for_model", "parse"]


class TaskError(DataError):
    """A task name, an option or a task/model pairing that is refused (one sentence; a ValueError, and a
    :class:`~cuboid.data.formats.DataError` where the refusal is of what the data is made into)."""


@dataclass(frozen=True)
class NoOptions:
    """A task without options."""


class Task:
    """One training objective (module docstring). Subclass it; class attributes describe it."""

    name: ClassVar[str] = ""                 # the registry's key ("" for a user's unregistered task)
    aliases: ClassVar[tuple] = ()            # other spellings of the name (clm: causal)
    heads: ClassVar[tuple] = ("lm",)         # the model heads it trains; the first is a fresh preset's
    families: ClassVar[Optional[tuple]] = None  # the model families it fits (None: any with one of ``heads``)
    default: ClassVar[bool] = False          # the task of a model whose head fits, when none is named
    unit: ClassVar[str] = "tokens"           # what count() counts, and the throughput's unit
    metric: ClassVar[str] = "perplexity"     # the eval figure beside eval_loss
    eval_keys: ClassVar[tuple] = ()          # the sums eval_sums() returns (reduced over dp in this order)
    targets: ClassVar[tuple] = ()            # batch keys the loss reads that are not model inputs
    forward_kwargs: ClassVar[dict] = {}      # keyword arguments of the model's forward (logprobs=True)
    own_loss: ClassVar[bool] = True          # False: the model's mean loss, weighed by count()
    classes: ClassVar[bool] = False          # one class label per example: a fresh head is sized by the data
    packs: ClassVar[bool] = False            # rows may be packed documents (--packing)
    streams: ClassVar[bool] = False          # records may be streamed (--streaming)
    Options: ClassVar[type] = NoOptions

    def __init__(self, options: Any = None, **fields) -> None:
        if options is not None and fields:
            raise TaskError(f"task {self.label}: give options or keyword fields, not both")
        if options is None:
            options = _options_from(type(self), fields)
        elif not isinstance(options, self.Options):
            raise TaskError(f"task {self.label}: options must be {self.Options.__name__}, "
                            f"got {type(options).__name__}")
        self.options = options

    @property
    def label(self) -> str:
        """The name a message gives the task (a user's class: its class name)."""
        return self.name or type(self).__name__

    def __repr__(self) -> str:
        fields = dataclasses.asdict(self.options) if dataclasses.is_dataclass(self.options) else {}
        return f"{self.label}(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"

    def describe(self) -> str:
        """The task as a user spells it: ``sft,train_on_prompt=true`` (only options off their defaults)."""
        parts = [self.label]
        for f in dataclasses.fields(self.options) if dataclasses.is_dataclass(self.options) else ():
            value = getattr(self.options, f.name)
            if value != f.default:
                parts.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
        return ",".join(parts)

    @classmethod
    def help(cls) -> str:
        """The task and its options in a few lines (``cuboid finetune --task NAME --help``)."""
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        lines = [f"task {cls.name or cls.__name__}: {doc}",
                 f"  trains the {' or '.join(cls.heads)} head; counts {cls.unit}; eval metric {cls.metric}"]
        fields = dataclasses.fields(cls.Options)
        if not fields:
            lines.append("  no options")
        for f in fields:
            default = "none" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) \
                else f.default
            lines.append(f"  {f.name + '=' + str(default):<28}  {f.metadata.get('help', '')}".rstrip())
        return "\n".join(lines)

    # ------------------------------------------------------------ what it fits

    @classmethod
    def fits(cls, family: str, head: str) -> bool:
        """Whether a model of ``family`` with ``head`` trains under this task."""
        return head in cls.heads and (cls.families is None or family in cls.families)

    def check(self, *, packing: bool = False, streaming: bool = False) -> None:
        """One-sentence refusals that need no data or model (packing, streaming)."""
        if packing and not self.packs:
            packers = " or ".join(n for n in names() if get(n).packs)
            raise TaskError(f"--packing puts whole documents into rows for language modelling (--task "
                            f"{packers}), not for task {self.label}")
        if streaming and not self.streams:
            streamed = " and ".join(t.name for t in _REGISTRY.values() if t.streams)
            raise TaskError(f"--streaming streams text for {streamed}, not for task {self.label}")

    # ------------------------------------------------------------ data

    def rows(self, ds, **prep) -> dict:
        """A split (a ``datasets.Dataset``) as a dict of equal-length tensors; ``prep``: config, tokenizer,
        seq_len, the columns, packing (:func:`cuboid.tasks.prepare`)."""
        raise TaskError(f"task {self.label} does not prepare rows from records: give prepared tensors")

    def row_length(self, prep: dict) -> int:
        """Tokens per streamed row for the model in ``prep["config"]``."""
        return min(prep.get("seq_len") or 128, prep["config"].n_positions)

    def example(self, prep: dict, row_length: int) -> Callable[[dict], Optional[dict]]:
        """One raw record -> ``{"input_ids", "labels"}`` lists (None: nothing to learn), for streaming."""
        raise TaskError(f"task {self.label} does not stream records")

    def model_config(self, config, tokenizer) -> dict:
        """Config fields the task gives the model it trains, beside its head (a preset's before it is built,
        a folder's after it is read; reward: one output and the tokenizer's pad id). By default none."""
        return {}

    def with_model(self, model, splits: list, **run) -> list:
        """The prepared splits (dicts of tensors) completed with what needs the model, once before training or
        evaluation (DPO: the reference policy's log-probabilities, TRL's ``precompute_ref_log_probs``); every
        rank calls it alike. ``run``: ``device``, ``dtype`` (the plan's), ``lora`` (the model carries
        adapters). By default the splits as they are."""
        return splits

    def before_step(self, batch: dict, step: int, *, tokenizer=None, seed: int = 0) -> dict:
        """The global batch of optimizer step ``step`` (1-based) as the step trains on it."""
        return batch

    @property
    def rows_per_example(self) -> int:
        """Training rows a step makes of each example it reads (GRPO: ``num_generations`` completions a
        prompt); the batch size counts rows, so a step reads ``batch_size / rows_per_example`` examples."""
        return 1

    def takes_data(self, step: int) -> bool:
        """Whether step ``step`` reads the next batch of examples (GRPO's ``num_iterations``: a generation's
        later steps reuse its rollouts; :meth:`before_step` is then given None)."""
        return True

    eval_fraction = 0.1  # held out for evaluation when the data has no validation split and none is asked for

    def evaluate(self, model, data: dict, *, tokenizer=None, step: int = 0) -> Optional[dict]:
        """The eval metrics of a task that evaluates in its own way (GRPO: rewards of greedy completions), or
        None: the loop's :func:`cuboid.train.step.evaluate` of the task's loss and metric (the default)."""
        return None

    def summary(self, history: Sequence[dict]) -> dict:
        """What the run's ``done:`` line adds from the metrics rows (``history``, rank 0's); by default nothing."""
        return {}

    def wants_reference(self, lora: bool) -> bool:
        """Whether the loop gives :meth:`with_model` a frozen copy of the starting model (``reference=``);
        ``lora``: the model carries adapters (its base, adapters off, is a reference already)."""
        return False

    def state_dict(self) -> dict:
        """JSON values a checkpoint keeps for an exact resume of what the task holds between steps (GRPO: the
        generation a later step reuses); by default nothing."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s values on resume."""

    def step_log(self, result, step: int, output_dir=None) -> dict:
        """What the metrics row of step ``step`` gains from the step's
        :class:`~cuboid.train.step.StepResult` (by default its metrics, means over the counted units); the
        writing rank passes ``output_dir`` (a task may write files of its own there, GRPO's completions)."""
        return dict(result.metrics)

    # ------------------------------------------------------------ the step

    def inputs(self, batch: dict) -> dict:
        """The model's keyword arguments for ``batch``: every key but the targets, plus forward_kwargs."""
        out = {k: v for k, v in batch.items() if k not in self.targets}
        out.update(self.forward_kwargs)
        return out

    def count(self, batch: dict, model=None) -> int:
        """The units of ``batch`` the loss sums over (the step's denominator), decided before the forward:
        by default the model's label positions (``model.num_targets``)."""
        if model is None:
            raise TaskError(f"task {self.label}: count() needs the model or an override")
        return int(model.num_targets(batch))

    def loss(self, out, batch: dict) -> tuple:
        """``(summed loss, {metric: summed value})`` of one micro-batch's outputs ``out`` (one device's
        layout) and its ``batch``, for a task with ``own_loss`` (the others train on the model's loss). The
        metric names are the same for every batch: the step sums them over the ranks by name."""
        raise NotImplementedError(f"task {self.label} sets own_loss but defines no loss()")

    # ------------------------------------------------------------ evaluation

    def eval_sums(self, out, batch: dict) -> dict:
        """Sums over one eval batch that :meth:`eval_metrics` turns into figures (beside the loss)."""
        return {}

    def eval_metrics(self, loss: float, sums: dict) -> dict:
        """The eval figures: ``eval_loss`` (the mean over counted units) and the task's ``metric``."""
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def _options_from(cls, fields: dict):
    """``cls.Options(**fields)``, with a one-sentence error naming the unknown fields."""
    known = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(fields) - known)
    if unknown:
        label = cls.name or cls.__name__
        raise TaskError(f"task {label} has no option {', '.join(unknown)}; its options: "
                        f"{', '.join(sorted(known)) or 'none'}")
    return cls.Options(**fields)


# ---------------------------------------------------------------- the registry

_REGISTRY: dict = {}
_ALIASES: dict = {}


def register(cls: type) -> type:
    """Add a task class under its ``name`` and ``aliases`` (a class decorator)."""
    if not cls.name:
        raise TaskError(f"{cls.__name__}: a registered task needs a name")
    _REGISTRY[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name
    return cls


def names() -> list:
    """The registered task names."""
    return list(_REGISTRY)


def get(name: str) -> type:
    """The task class named ``name`` (or an alias of it)."""
    key = _ALIASES.get(name, name)
    if key not in _REGISTRY:
        spelled = ", ".join(list(_REGISTRY) + [f"{a}: {t}" for a, t in _ALIASES.items()])
        raise TaskError(f"unknown task {name!r}; tasks: {spelled}")
    return _REGISTRY[key]


def _value(field: dataclasses.Field, text: str, task: str):
    """An option's text as its field's type (bool, int, float, optional str)."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if "bool" in kind:
        low = text.lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise TaskError(f"task {task}: option {field.name} takes true or false, not {text!r}")
        return low in ("true", "1", "yes")
    for typ in (int, float):
        if typ.__name__ in kind and "str" not in kind:
            try:
                return typ(text)
            except ValueError:
                raise TaskError(f"task {task}: option {field.name} takes a number, not {text!r}") from None
    return None if text.lower() == "none" and "Optional" in kind else text


def parse(spec: str, **extra) -> Task:
    """``"sft,train_on_prompt=true"`` -> the task object; ``extra`` fields (from other spellings, such as
    ``--train-on-prompt``) join the ones in the text."""
    name, *pairs = [p.strip() for p in spec.split(",") if p.strip()] or [""]
    cls = get(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    values = {}
    for pair in pairs:
        key, eq, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq:
            raise TaskError(f"task {cls.name}: {pair!r} is not option=value")
        if key not in fields:
            raise TaskError(f"task {cls.name} has no option {key}; its options: {', '.join(fields) or 'none'}")
        values[key] = _value(fields[key], text.strip(), cls.name)
    for key, value in extra.items():
        if key in values and values[key] != value:
            raise TaskError(f"task {cls.name}: option {key} is given twice, as {values[key]!r} and {value!r}")
        values[key] = value
    return cls(**values)


def class_of(task: Any) -> type:
    """The task class of what :func:`resolve` takes (an object, a class, a spelled name, a table)."""
    if isinstance(task, Task):
        return type(task)
    if isinstance(task, type) and issubclass(task, Task):
        return task
    if isinstance(task, dict) and isinstance(task.get("name"), str):
        return get(task["name"])
    if isinstance(task, str):
        return get(task.split(",")[0].strip())
    return resolve(task).__class__  # (its one-sentence refusal)


def resolve(task: Any, **extra) -> Task:
    """A task object from an object, a class, a name with options (``"sft,train_on_prompt=true"``) or a
    dict (a config file's ``[finetune.task]`` table: ``name`` and the options)."""
    if isinstance(task, Task):
        if extra:
            raise TaskError(f"task {task.label}: options are set on the object, not beside it")
        return task
    if isinstance(task, type) and issubclass(task, Task):
        return task(**extra)
    if isinstance(task, dict):
        table = dict(task)
        name = table.pop("name", None)
        if not isinstance(name, str):
            raise TaskError("a task table needs a name (name = \"sft\") beside its options")
        cls = get(name)
        return cls(**{**{k.replace("-", "_"): v for k, v in table.items()}, **extra})
    if isinstance(task, str):
        return parse(task, **extra)
    raise TaskError(f"a task is a name, a table or a Task, got {type(task).__name__}")


def for_model(family: str, head: str, task: Any = None, **extra) -> Task:
    """The task a model of ``family`` with ``head`` trains: ``task`` resolved and checked against the head,
    or the registered default for the head when ``task`` is None."""
    if task is None:
        found = [cls for cls in _REGISTRY.values() if cls.default and cls.fits(family, head)]
        if not found:
            raise TaskError(f"the {family} model has head {head!r}: no task to fine-tune; set --task")
        return found[0](**extra)
    chosen = resolve(task, **extra)
    if not chosen.fits(family, head):
        does = [cls.name for cls in _REGISTRY.values() if cls.default and cls.fits(family, head)]
        raise TaskError(f"task {chosen.label} does not fit the {family} model with head {head!r}"
                        + (f" (it does {does[0]})" if does else ""))
    return chosen
