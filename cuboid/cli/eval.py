"""``cuboid eval``: loss and perplexity of a causal language model on a held-out text, or a task's metrics.

    cuboid eval --model FOLDER|PRESET --data corpus.txt [--max-length N] [--stride S] [--json]
    cuboid eval --task dpo --model P [--ref-model R] --data pairs.jsonl [--beta B] [--loss-type L] [--json]
    cuboid eval --model FOLDER --harness hellaswag,my_task.yaml [--num-fewshot K] [--limit N] [--json]

The text (a .txt file, or any source ``cuboid finetune --data`` reads, its
text column joined by blank lines) is one token sequence, scored with
transformers' documented sliding window: windows of ``max_length`` tokens
start every ``stride`` tokens, and each window scores only the tokens the
previous one did not, so every token after the first window is predicted
from at least ``max_length - stride`` tokens of context. Under torchrun with
``--plan``, data-parallel ranks share the windows and the sums are reduced.
Errors are one line on stderr and exit code 2.

With ``--task`` the data is the task's records (DPO: prompt/chosen/rejected
pairs) prepared as ``cuboid finetune`` prepares them, completed with what
needs a model (the reference's log-probabilities), and scored by
:func:`cuboid.train.step.evaluate` through the task's ``eval_sums`` and
``eval_metrics``, in batches of ``--batch-size`` examples (dp ranks share
them): the task's figures over the whole file, means over its units, as
TRL's ``evaluate`` reports them for one batch. ``--json`` prints one JSON
line (the keys without the ``eval_`` prefix). DPO's reference without
``--ref-model``: the model the fine-tune of ``--model`` started from, where its
run recorded one (``final/``, ``checkpoint-N/``), else the policy itself (every
reward 0), one line says which.

With ``--harness`` the model answers lm-evaluation-harness's tasks
(:mod:`cuboid.cli.harness`; a task YAML over a local jsonl runs offline).
``--model`` may be a hub id ``org/name`` (read from the Hugging Face cache,
:mod:`cuboid.loading.hub`) or a LoRA run's adapter folder (its base from
``adapter_config.json`` or ``--base``), here and in ``cuboid generate``.
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch


def sliding_windows(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) of each window over ``n_tokens``: tokens [begin, end) go in, the last ``scored``
    of them are targets (transformers' perplexity recipe)."""
    if max_length < 2 or stride < 1 or stride > max_length:
        raise ValueError(f"need max_length >= 2 and 1 <= stride <= max_length, got max_length={max_length}, "
                         f"stride={stride}")
    if n_tokens < 2:
        raise ValueError(f"the text has {n_tokens} token(s): perplexity needs at least 2")
    out, previous_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + max_length, n_tokens)
        out.append((begin, end, end - previous_end))
        previous_end = end
        if end == n_tokens:
            break
    return out


def perplexity(model, input_ids: torch.Tensor, max_length: Optional[int] = None, stride: Optional[int] = None,
               progress: bool = False) -> dict:
    """Mean negative log-likelihood (``loss``) and ``perplexity`` of a (1, N) token sequence under a causal LM
    (a cuboid model under any plan: every rank of a tensor or pipeline group passes the same windows), with
    the sliding window of :func:`sliding_windows`; ``max_length`` defaults to the model's positions and
    ``stride`` to half of it. Each window's mean loss is weighted by the targets it really averages over."""
    from cuboid.parallel import comm, state_of, unwrap

    core = unwrap(model)
    if getattr(core.config, "head", None) != "lm":
        raise ValueError(f"perplexity needs a causal LM head, got head {getattr(core.config, 'head', None)!r}")
    ids = input_ids.reshape(1, -1)
    max_length = max_length or core.config.n_positions
    stride = stride or max(1, max_length // 2)
    windows = sliding_windows(ids.shape[1], max_length, stride)
    mesh = state_of(core).mesh
    dp, rank = mesh.size("dp"), mesh.coords.get("dp", 0)
    # the same number of forwards on every dp rank (a ZeRO-3 forward gathers over dp): a rank short of windows
    # scores its first one again with weight 0
    mine = windows[rank::dp]
    mine = [(w, 1) for w in mine] + [(windows[rank % len(windows)], 0)] * (-(-len(windows) // dp) - len(mine))
    if progress and rank == 0:
        from tqdm.auto import tqdm

        mine = tqdm(mine, desc="perplexity", unit="window")
    was_training = core.training
    core.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for (begin, end, scored), weight in mine:
            window = ids[:, begin:end].to(next(core.parameters()).device)
            labels = window.clone()
            labels[:, :-scored] = -100
            loss = core(input_ids=window, labels=labels).loss  # every window runs: the calls match across ranks
            n = int((labels[:, 1:] != -100).sum()) * weight  # the shifted targets the loss averages over
            if n:
                sums += torch.tensor([float(loss) * n, n], dtype=torch.float64)
    if dp > 1:
        comm.all_reduce_(sums, mesh.group("dp"))
    if was_training:
        core.train()
    loss = (sums[0] / sums[1]).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(sums[1]), "windows": len(windows)}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--base``, ``--tokenizer`` and ``--plan``, as the text commands (``eval``, ``generate``)
    take them."""
    p.add_argument("--model", required=True, help="a local folder with its tokenizer, a hub id org/name (from the "
                                                  "Hugging Face cache; downloaded unless HF_HUB_OFFLINE=1), a LoRA "
                                                  "run's adapter folder (its base from adapter_config.json or "
                                                  "--base), or a preset with --tokenizer")
    p.add_argument("--base", help="--model is a LoRA adapter folder: its base model (a folder or hub id; default: "
                                  "the adapter config's base_model_name_or_path)")
    p.add_argument("--tokenizer", help="a tokenizer folder or tokenizer.json (default: the model folder's)")
    p.add_argument("--plan", help="a plan (under torchrun): ready name or spec such as dp=2 or tp=2")


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def is_adapter_folder(folder) -> bool:
    """Whether ``folder`` holds LoRA adapters without a model of its own (a LoRA run's ``final/`` or
    checkpoint: ``adapter_config.json`` and no model weights)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return False
    has = lambda f: os.path.isfile(os.path.join(folder, f))  # noqa: E731
    return has("adapter_config.json") and not (has("model.safetensors") or has("model.safetensors.index.json"))


def model_source(model: str, base=None) -> tuple:
    """(what to load, LoRA adapters or None, the folder whose tokenizer to read) of ``--model`` and ``--base``:
    a hub id becomes its folder in the Hugging Face cache (:mod:`cuboid.loading.hub`); a LoRA adapter folder
    loads its base (``--base``, else the adapter config's ``base_model_name_or_path``) with the adapters on
    it, and reads its own tokenizer if it holds one, else the base's."""
    from cuboid.loading.hub import locate

    model = locate(model)
    if not is_adapter_folder(model):
        if base is not None:
            raise ValueError(f"--base goes with a LoRA adapter folder (adapter_config.json); {model} is a model")
        return model, None, model if isinstance(model, str) and os.path.isdir(model) else None
    from cuboid.zoo.lora import read_config

    named = base or read_config(model)[2].get("base_model_name_or_path")
    if not named:
        raise ValueError(f"{model} holds LoRA adapters whose adapter_config.json names no base model: give --base")
    source = locate(named)
    if not os.path.isdir(source):
        from cuboid.zoo import PRESETS

        if source not in PRESETS:
            raise FileNotFoundError(f"{model}: the base model {named} of its adapters is not a folder here; give "
                                    f"--base FOLDER")
    return source, model, model if _has_tokenizer(model) or not os.path.isdir(source) else source


def load_model_and_tokenizer(args: argparse.Namespace):
    """(model, tokenizer) of ``add_model_arguments``' flags: the process group first under torchrun with a
    plan, then the tokenizer (a one-line error where there is none), then the model under the plan (a LoRA
    folder: its base with the adapters attached, :func:`model_source`)."""
    from cuboid.data import formats as D
    from cuboid.loading.model import load
    from cuboid.parallel import init_distributed

    if args.plan and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed()
    source, adapters, tokenizer_folder = model_source(args.model, getattr(args, "base", None))
    tokenizer = D.load_tokenizer(args.tokenizer or tokenizer_folder)
    if tokenizer is None:
        raise ValueError(f"no tokenizer for {args.model}: give a folder with tokenizer.json or --tokenizer PATH")
    return load(source, args.plan, lora=adapters), tokenizer


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on an ``add_subparsers()`` object; the handler is ``args.func``."""
    p = subparsers.add_parser("eval", help="perplexity of a causal LM on a held-out text, a task's metrics (--task), or lm-eval's tasks (--harness)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n\n".join(__doc__.split("\n\n")[1:2]))
    from cuboid.train.config import add_task_flags

    add_model_arguments(p)
    p.add_argument("--data", help="a text file, or a source with a text column (with --task: the task's records)")
    p.add_argument("--harness", metavar="TASKS", help="run lm-evaluation-harness tasks instead (comma separated "
                                                      "names, or task YAML files: a local task over a local jsonl "
                                                      "runs offline); needs pip install \"cuboid[harness]\"")
    p.add_argument("--num-fewshot", type=int, help="--harness: few-shot examples per prompt (default: the task's)")
    p.add_argument("--limit", type=float, help="--harness: at most N examples per task (a fraction below 1)")
    p.add_argument("--task", help="score a task's metrics instead of perplexity: dpo[,beta=0.1,...] (its options "
                                  "also as the flags below)")
    p.add_argument("--batch-size", type=int, default=8, help="--task: examples (pairs) per eval batch (default 8)")
    p.add_argument("--chat-template", help="--task: a Jinja chat template file used instead of the tokenizer's")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    add_task_flags(p)
    p.add_argument("--text-column", default="text", help="the text column of a table source (default text)")
    p.add_argument("--max-length", type=int, help="tokens per window (default: the model's positions); --task: "
                                                   "tokens per sequence (longer ones keep their start)")
    p.add_argument("--stride", type=int, help="tokens between window starts (default: half of --max-length)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _text_of(source: str, column: str) -> str:
    from cuboid.data import formats as D

    if os.path.isfile(source) and source.endswith(".txt"):
        from cuboid.data.damage import check_text_file

        check_text_file(source)  # empty, or not UTF-8: one line naming the file and line
        with open(source, encoding="utf-8") as fh:
            return fh.read()
    ds = _first_split(D.load_source(source))  # a file loads as a DatasetDict: its columns are the split's
    if column not in ds.column_names:
        raise ValueError(f"{source} has no column {column!r} (columns: {', '.join(ds.column_names)}); set --text-column")
    return "\n\n".join(t for t in ds[column] if isinstance(t, str))


def task_metrics(model, tokenizer, task, ds, max_length: Optional[int] = None, batch_size: int = 8) -> dict:
    """A task's eval figures over a whole split ``ds`` (module docstring), without the ``eval_`` prefix."""
    from cuboid.data.formats import eval_batches
    from cuboid.parallel import state_of, unwrap
    from cuboid.parallel.lora import carries_adapters
    from cuboid.train.step import evaluate

    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: give 1 or more examples per batch")
    core = unwrap(model)
    state = state_of(core)
    data = task.rows(ds, config=core.config, tokenizer=tokenizer, seq_len=max_length)
    device = next(core.parameters()).device
    data = task.with_model(model, [data], device=device, dtype=state.plan.dtype, lora=carries_adapters(core))[0]
    mesh = state.mesh
    multiple = math.lcm(8, 2 * state.plan.sp * state.plan.tp)
    batches = eval_batches(data, batch_size, mesh.coords.get("dp", 0), mesh.size("dp"), multiple)
    metrics = evaluate(model, batches, task=task)
    return {k.removeprefix("eval_"): v for k, v in metrics.items()}


def with_reference(task, model, folder):
    """``task`` with its ``ref_model`` (DPO's reference) set to the model the fine-tune of ``folder`` started from,
    where its run recorded one (:func:`cuboid.train.resume.starting_model`) and none was given, with one line
    saying so; where none is recorded, one line saying that the reference is the policy itself (every reward
    0). A model with LoRA adapters is left alone: its reference is its base (the adapters off)."""
    import dataclasses
    import sys

    from cuboid.parallel import unwrap
    from cuboid.parallel.lora import carries_adapters
    from cuboid.train.resume import starting_model

    options = getattr(task, "options", None)
    if not dataclasses.is_dataclass(options) or "ref_model" not in {f.name for f in dataclasses.fields(options)} \
            or options.ref_model is not None or carries_adapters(unwrap(model)):
        return task
    found = starting_model(folder) if isinstance(folder, (str, os.PathLike)) and os.path.isdir(folder) else None
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    if found is None:
        say(f"note: no --ref-model, and {folder} records no model its fine-tune started from: the reference is "
            f"the policy itself, so every reward is 0 (give --ref-model FOLDER)", file=sys.stderr, flush=True)
        return task
    start, record = found
    say(f"reference model: {start}, which the fine-tune of {folder} started from ({record}); --ref-model "
        f"gives another", file=sys.stderr, flush=True)
    return type(task)(dataclasses.replace(options, ref_model=start))


def _task_of(args: argparse.Namespace):
    """The ``--task`` with its options given as flags of their own."""
    from cuboid.train.config import task_flags, with_flags

    flags = {k: getattr(args, k, None) for k in task_flags()}
    flags["chat_template"] = args.chat_template
    return with_flags(args.task, flags)


def _first_split(ds):
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        for name in ("test", "validation", "eval", "train"):
            if name in ds:
                return ds[name]
        return ds[next(iter(ds))]
    return ds


def _harness(args: argparse.Namespace) -> int:
    """``--harness TASKS``: the harness's metrics of each task (:mod:`cuboid.cli.harness`), a table or JSON."""
    import json

    from cuboid.cli.harness import run_harness

    if args.data is not None or args.task is not None:
        raise ValueError("--harness runs the harness's tasks: give no --data or --task with it")
    model, tokenizer = load_model_and_tokenizer(args)
    result = run_harness(model, tokenizer, args.harness, num_fewshot=args.num_fewshot, limit=args.limit,
                         max_length=args.max_length)["results"]
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps(result))
        for task, metrics in ({} if args.json else result).items():
            print(f"{task}: " + ", ".join(f"{k.replace(',none', '')} {v:.4f}" for k, v in metrics.items()
                                          if isinstance(v, (int, float)) and "stderr" not in k))
    return 0


def run(args: argparse.Namespace) -> int:
    import json

    if args.harness is not None:
        return _harness(args)
    if args.num_fewshot is not None or args.limit is not None:
        raise ValueError("--num-fewshot and --limit go with --harness")
    if args.data is None:
        raise ValueError("give --data FILE (or --harness TASKS)")
    if args.task is not None:
        from cuboid.data import formats as D

        task = _task_of(args)  # a bad option: an error before any model loads
        model, tokenizer = load_model_and_tokenizer(args)
        from cuboid.train.models import configure

        configure(model, task, tokenizer)  # what the task gives its model (reward: the tokenizer's pad id)
        task = with_reference(task, model, args.model)
        result = task_metrics(model, tokenizer, task, _first_split(D.load_source(args.data)), args.max_length,
                              args.batch_size)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result) if args.json else
                  f"{args.data}: task {task.describe()}: " + ", ".join(f"{k} {v:.6g}" for k, v in result.items()))
        return 0
    if any(getattr(args, k, None) is not None for k in _task_flag_names()):
        raise ValueError("task options (--beta, --loss-type, ...) need --task")
    model, tokenizer = load_model_and_tokenizer(args)
    text = _text_of(args.data, args.text_column)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    vocab = model.config.vocab_size
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"the tokenizer gives ids up to {int(ids.max())}, beyond the model's {vocab} tokens")
    result = perplexity(model, ids, args.max_length, args.stride, progress=not args.no_progress)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result) if args.json else
              f"{args.data}: {result['tokens']} tokens scored in {result['windows']} windows: "
              f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f}")
    return 0


def _task_flag_names() -> list:
    from cuboid.train.config import task_flags

    return list(task_flags())
