"""``cuboid finetune``: flags, ``--config`` files, and the multi-process launch.

Flags override a YAML/TOML ``--config`` file, which overrides the defaults.
With no ``--model`` and no ``--data`` the embedded default runs: ``vit-debug``
on scikit-learn's digits, 400 steps of 64 at lr 1e-2, on the devices present
(:func:`device_default`, one line says which): one process per GPU (plan
``dp=G``; one GPU: a single process), or ``dp=2`` on CPU processes without a
GPU. ``--plan`` or a ``--config`` plan overrides it; ``--nproc-per-node N``
gives ``dp=N``.

A plan with more than one process, run outside ``torchrun``, re-launches this
command through torch's own elastic launcher (the code behind ``torchrun``)
with ``--nproc-per-node`` processes on this machine (loopback rendezvous).
``--max-restarts N`` goes to that launcher (and launches even a one-process
plan through it): when a worker dies, all are restarted, up to N times, and
resume from the newest complete checkpoint in ``--output-dir`` (see
cuboid/train/loop.py). Under ``torchrun`` use its own ``--max-restarts``.
``--timeout-s`` bounds every collective, so a hung rank fails (and restarts).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from cuboid.train.config import PYTHON_ONLY, FinetuneConfig, add_task_flags, metavar, task_flags

# the embedded default job (no --model, no --data); its plan is chosen for the devices present (device_default)
DEFAULT_JOB = {"model": "vit-debug", "data": "digits", "steps": 400, "batch_size": 64, "lr": 1e-2,
               "eval_every": 100, "output_dir": "runs/digits-vit"}
CPU_PROCESSES = 2  # the default job's dp without a GPU: processes on the CPU cores (gloo)

FLAGS = [
    # (flag, type, help)
    ("--model", str, "a preset (vit-debug, gpt2, bert-base, ...) or a local Hugging Face folder"),
    ("--data", str, "a csv/json/jsonl/parquet/txt file, an imagefolder or save_to_disk folder, or 'digits'"),
    ("--plan", str, "a ready plan name (cuboid plans), a .json/.toml plan file, or fields like dp=2"),
    ("--task", str, "a task and its options: sft[,train_on_prompt=true] | causal (or clm) | mlm | seqcls | imgcls "
                    "| dpo[,beta=0.1] | reward | grpo (default: from the model's head; sft: instruction or chat data, "
                    "see DATA FORMATS below; dpo, reward: prompt/chosen/rejected pairs, --batch-size counts pairs; "
                    "grpo: a prompt column and --reward MODULE:FUNCTION, --batch-size counts completions; "
                    "--task NAME --help lists its options, which the task flags below also set)"),
    ("--steps", int, "optimizer steps (default: from --epochs)"),
    ("--epochs", float, "passes over the training split when --steps is not given (default 1)"),
    ("--batch-size", int, "global batch size, over all processes and micro-batches (default 32)"),
    ("--micro-batch-size", int, "per-process micro-batch; smaller than batch/dp accumulates gradients"),
    ("--lr", float, "peak learning rate at --reference-batch (default 1e-3)"),
    ("--optimizer", str, "adamw | lamb | lars | muon (default adamw; LARS wants a large --lr, its step is lr x "
                         "1e-3 x |w|/|g|; muon orthogonalises the hidden matrices' momentum, the rest takes AdamW "
                         "at the same --lr); biases and norms take no decay and no trust ratio"),
    ("--lr-scaling", str, "none | linear | sqrt: scale --lr by (batch / reference batch) or its square root "
                          "(default none)"),
    ("--reference-batch", int, "the global batch --lr was tuned at, for --lr-scaling (default 256)"),
    ("--weight-decay", float, "decoupled weight decay, not applied to biases and norms (default 0.01)"),
    ("--warmup", float, "warmup: a fraction of the steps (< 1) or a step count (default 0.1)"),
    ("--schedule", str, "cosine | linear | constant | poly after warmup (default cosine)"),
    ("--decay-power", float, "poly schedule: lr x (1 - progress) ** power (default 1; LARS's ImageNet runs: 2)"),
    ("--max-grad-norm", float, "clip the global gradient norm (default 1.0; 0 turns it off)"),
    ("--moe-bias-update-rate", float, "DeepSeek-V3: after each step every router's correction bias moves by this "
                                      "toward balance, + for experts under the mean load, - above (default 0: off)"),
    ("--dtype", str, "fp32 | bf16 | fp16 autocast (default: the plan's, fp32)"),
    ("--eval-every", int, "evaluate every N steps (default: 4 times per run)"),
    ("--save-every", int, "checkpoint every N steps (default: at the end only)"),
    ("--keep", int, "checkpoints to keep (default 2)"),
    ("--output-dir", str, "where checkpoints, metrics.jsonl, curves.png and final/ go"),
    ("--resume", str, "continue from a checkpoint (its checksums verified first): bare --resume or 'latest' takes "
                      "the newest complete one in --output-dir"),
    ("--overwrite-output-dir", bool, "start a fresh run in an --output-dir an earlier run left checkpoints, "
                                     "final/ or metrics in (kept; this run prunes and resumes only its own)"),
    ("--seed", int, "seed for initialisation, data order and masking (default 0)"),
    ("--lora", str, "train LoRA adapters only: r=16,alpha=32[,dropout=0.05][,targets=attn+mlp] (targets: attn, "
                    "qkv, q, k, v, o, mlp); checkpoints and final/ hold the adapters in peft's layout"),
    ("--quantize", str, "nf4: the base's block linears frozen in 4-bit NF4 with double quantization (QLoRA, "
                        "bitsandbytes' layout), quantized while the model is read; needs --lora"),
    ("--timeout-s", float, "seconds a collective may wait before the run fails (default 300; a restart follows "
                           "under --max-restarts)"),
    ("--seq-len", int, "tokens per example for text tasks (default 128, sft 1024; at most the model's); sft: "
                       "longer examples are cut, keeping the start; with --packing the length of a packed row"),
    ("--packing", bool, "causal LM and sft: each record is a document; documents are packed into rows of --seq-len "
                        "(best-fit-decreasing) and attend only to themselves"),
    ("--train-on-prompt", bool, "sft: train on every token (system, user, template text), not only the answers"),
    ("--template", str, "sft: the prompt template of instruction data (alpaca: instruction/input/output columns)"),
    ("--data-format", str, "sft: messages | prompt_completion | alpaca | text (default: from the columns)"),
    ("--chat-template", str, "sft: a Jinja chat template file used instead of the tokenizer's"),
    ("--streaming", bool, "read a local jsonl/parquet/txt file as a stream (shuffled in a buffer; needs --steps)"),
    ("--shuffle-buffer", int, "--streaming: examples in the shuffle buffer (default 1000)"),
    ("--tokenizer", str, "a tokenizer folder or tokenizer.json (default: the model folder's)"),
    ("--text-column", str, "text column (default 'text'; sft: the messages, prompt or text column)"),
    ("--label-column", str, "label column (default 'label')"),
    ("--image-column", str, "image column (default 'image')"),
    ("--eval-fraction", float, "held-out fraction when the data has no validation split (default 0.1; task "
                               "grpo: 0, every prompt trains; 0: no eval)"),
    ("--eval-data", str, "the eval split from a file or folder of its own (default: the data's validation split "
                         "(validation.*, valid, dev, test files of a folder, as datasets names them) or --eval-fraction)"),
    ("--log-every", int, "write a metrics line every N steps (default 10)"),
    ("--report-to", str, "experiment trackers that get metrics.jsonl's rows and the run's config: none (default), "
                         "all (those installed), or a comma list of trackio, tensorboard, wandb, mlflow; each "
                         "local/offline with its files in --output-dir (pip install \"cuboid[track]\")"),
]


ALIASES = {"--seq-len": "--max-length", "--output-dir": "--output"}  # other spellings (and --config keys)

DATA_FORMATS = """\
data formats of --task sft (read from the columns, or named by --data-format):
  format             columns                            trained tokens
  messages           messages: [{role, content}, ...]   the assistant turns (rendered with the chat template)
  prompt_completion  prompt, completion                 the completion (strings, or message lists)
  alpaca             instruction, input, output         the output (prompt from --template alpaca)
  text               text                               every token (plain language modelling)
--train-on-prompt trains every token; --text-column names another messages/prompt/text column.

a messages jsonl file, one conversation a line:
  {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
  {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}, \
{"role": "assistant", "content": "4"}]}
Check the trained tokens before a long run: cuboid prepare --model FOLDER --data FILE --output DIR"""


DESCRIPTION = """\
Fine-tune a model (a preset, or a local Hugging Face folder) on a dataset under a parallel plan.

Flags override a YAML/TOML --config file, which overrides the defaults. With no --model and no --data a
small default job runs: vit-debug on scikit-learn's digits, 400 steps of 64 at lr 1e-2, one process per
GPU, or 2 CPU processes without a GPU (one line says which).

A plan of several processes, run outside torchrun, starts them through torch's elastic launcher on this
machine. --max-restarts N restarts them all when one dies, and they resume from the newest complete
checkpoint in --output-dir; --timeout-s bounds every collective, so a hung rank fails (and restarts).
Ctrl-C saves the step it finishes and prints the command that resumes; a second Ctrl-C stops at once."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("finetune", help="fine-tune a zoo model on a dataset (the main job)", add_help=False,
                       description=DESCRIPTION, epilog=DATA_FORMATS, formatter_class=_Formatter,
                       usage="%(prog)s [--model MODEL] [--data DATA] [--task TASK] [--plan PLAN] [--config FILE] "
                             "[options below]")
    p.add_argument("-h", "--help", action=_Help, nargs=0, help="show this help (after --task NAME: the task's options)")
    for flag, typ, help_ in FLAGS:
        shown = metavar(flag[2:].replace("-", "_"), typ)
        if flag in ALIASES:
            p.add_argument(flag, ALIASES[flag], type=typ, default=None, help=help_, metavar=shown)
            continue
        if flag == "--resume":  # a bare --resume means the latest checkpoint in --output-dir
            p.add_argument(flag, type=typ, default=None, nargs="?", const="latest", help=help_, metavar="CKPT")
            continue
        if typ is bool:  # a switch; None when not given, so a --config file's value stands
            p.add_argument(flag, action="store_true", default=None, help=help_)
            continue
        p.add_argument(flag, type=typ, default=None, help=help_, metavar=shown)
    add_task_flags(p)  # the tasks' options with flags of their own (--beta, --loss-type, ...)
    p.add_argument("--config", type=str, default=None, metavar="FILE",
                   help="a YAML or TOML file with any of these keys")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="processes to launch on this machine (default: the plan's world size)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="restart the workers up to N times when one dies; they resume from the newest complete "
                        "checkpoint (default 0; set --save-every)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="no curves.png")
    p.set_defaults(func=cmd_finetune, callbacks=(), module="cuboid")  # main() sets these for a wrapper
    return p


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The flags' help beside them (a column at 30), the description and epilog as written."""

    def __init__(self, prog, **kw):
        super().__init__(prog, max_help_position=30, **kw)


class _Help(argparse.Action):
    """``--help``: the command's help; after ``--task NAME``, that task's options instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        from cuboid import tasks

        spec = getattr(namespace, "task", None)
        if spec is None:
            parser.print_help()
        else:
            from cuboid.cli import plain

            try:
                print(plain(tasks.class_of(spec).help()))
            except ValueError as e:
                parser.exit(2, f"cuboid finetune: error: {e}\n")
        parser.exit()


LAUNCHER_KEYS = ("nproc_per_node", "max_restarts")  # for the launcher, not the trainer
DEVICE_DEFAULT = "device_default"  # resolve's mark of the default job with no plan given (device_default picks it)


def read_config_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = file.read_text()
    if file.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    elif file.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ValueError("YAML configs need PyYAML (pip install pyyaml); or use TOML") from e
        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"--config {path}: use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must hold a table of keys")
    data = {k.replace("-", "_"): v for k, v in data.get("finetune", data).items()}
    for flag, alias in ALIASES.items():
        key, other = flag[2:].replace("-", "_"), alias[2:].replace("-", "_")
        if other in data:
            if key in data:
                raise ValueError(f"--config {path}: give {key} or {other}, not both (they are one setting)")
            data[key] = data.pop(other)
    if isinstance(data.get("plan"), dict):
        data["plan"] = dict(data["plan"])
    options = {k: data.pop(k) for k in list(data) if k in task_flags()}  # a task option's flag as a key
    if options:
        data["task_options"] = {**dict(data.get("task_options") or {}), **options}
    known = set(FinetuneConfig.__dataclass_fields__) - set(PYTHON_ONLY) | set(LAUNCHER_KEYS)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--config {path}: unknown key(s) {', '.join(unknown)}{near_keys(unknown, known)}")
    return data


def near_keys(unknown: list, known: set) -> str:
    """"; did you mean lr? (...)": the known keys nearest the misspelt ones (difflib), or "" when none is near."""
    import difflib

    hints = [f"{k}: did you mean {near[0]}?" for k in unknown
             if (near := difflib.get_close_matches(k, sorted(known | set(task_flags())), n=1, cutoff=0.7))]
    return f"; {'; '.join(hints)} (cuboid finetune --help lists the keys as flags)" if hints else ""


def resolve(args: argparse.Namespace) -> dict:
    """Defaults < --config < flags, as FinetuneConfig keyword arguments (+ LAUNCHER_KEYS)."""
    values: dict[str, Any] = read_config_file(args.config) if args.config else {}
    for flag, _, _ in FLAGS:
        key = flag[2:].replace("-", "_")
        v = getattr(args, key)
        if v is not None:
            values[key] = v
    given = {k: getattr(args, k) for k in task_flags() if getattr(args, k, None) is not None}
    if given:
        values["task_options"] = {**dict(values.get("task_options") or {}), **given}
    for key in LAUNCHER_KEYS:
        if getattr(args, key) is not None:
            values[key] = getattr(args, key)
    if "model" not in values and "data" not in values:
        given_batch = "batch_size" in values
        values = {**DEFAULT_JOB, **values}
        if "plan" not in values:
            values[DEVICE_DEFAULT] = {"batch_given": given_batch}
    if values.get("max_grad_norm") == 0:
        values["max_grad_norm"] = None
    values["progress"] = not args.no_progress
    values["plot"] = not args.no_plot
    return values


def _launch(nproc: int, argv: list[str], max_restarts: int = 0, module: str = "cuboid") -> int:
    """Run ``python -m <module> <argv>`` (``cuboid``, or a wrapper that calls :func:`cuboid.cli.main` with
    its callbacks) in ``nproc`` local processes through torch's elastic launcher.

    With ``max_restarts`` the agent restarts every worker when one fails, up to
    that many times; the workers see ``TORCHELASTIC_RESTART_COUNT`` and resume.
    """
    import logging
    import shutil
    import signal
    import tempfile

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.run import get_args_parser, run

    # the failing rank prints its own one-line error; the agent's report of it (or of a Ctrl-C) is noise. Its
    # modules' loggers set levels of their own, so each one is quieted, not only the parent
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # each restart round gets a fresh store hosted by worker 0: on the store the agent shares by default,
    # a restarted process group can read the previous round's addresses (pytorch/pytorch#135712)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Ctrl-C: the agent sends each worker a SIGINT and waits this long for them to save their step and exit
    # (cuboid.train.interrupt); a second Ctrl-C ends them at once
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    launch = get_args_parser().parse_args(
        ["--standalone", "--nnodes=1", f"--nproc-per-node={nproc}", "--rdzv-endpoint=127.0.0.1:0",
         f"--max-restarts={max_restarts}", "--module", module, *argv])
    os.environ[FAILURES_ENV] = folder = tempfile.mkdtemp(prefix="cuboid-failures-")
    try:
        run(launch)
    except SignalException as e:  # Ctrl-C: the workers were told and said their line; SIGTERM ended them
        return 143 if e.sigval == signal.SIGTERM else 130
    except Exception as e:  # ChildFailedError: the failing rank recorded its error (record_failure)
        failures = getattr(e, "failures", None)
        headline = failure_headline(Path(folder))
        if failures and headline is not None and headline[1]:  # a bad value: one line, exit code 2 (a bug's
            print(headline[0], file=sys.stderr, flush=True)       # traceback, its rank's, ends in its line)
            return 2
        if failures:
            # a rank that failed on a bad value exits 2; the others may be killed after it
            codes = {f.exitcode for f in failures.values()}
            if 2 in codes:
                return 2
            if 130 in codes and codes <= {130, -15}:  # Ctrl-C reached the workers alone: they saved the same step
                return 130  # (rank 0 said where; a rank still exiting when the agent saw the first is SIGTERM'd)
            # the cause: not a rank the agent stopped (SIGTERM) because another had failed
            rank, failure = min(failures.items(), key=lambda rf: (rf[1].exitcode == -15, rf[1].timestamp, rf[0]))
            how = f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0 else \
                f"exited with code {failure.exitcode}"
            used = f" with all {max_restarts} restart(s) used" if max_restarts else " (see --max-restarts)"
            print(f"cuboid finetune: error: worker rank {rank} {how}{used}", file=sys.stderr)
            return 1
        raise
    finally:
        os.environ.pop(FAILURES_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


FAILURES_ENV = "CUBOID_FAILURES"  # the launcher's folder where each failing worker records its error


def collateral(e: BaseException) -> bool:
    """Whether ``e`` (or an error it came from) is a collective that failed because a peer went away or
    stalled: the consequence of another rank's failure, not a cause."""
    from cuboid.parallel.comm import CollectiveError

    seen = 0
    while e is not None and seen < 8:
        low = str(e).lower()
        if isinstance(e, CollectiveError) or any(k in low for k in ("closed by peer", "connection reset",
                                                                    "broken pipe", "connection closed")):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def record_failure(e: BaseException, user: bool) -> bool:
    """Under cuboid's launcher: this worker's error written to the launcher's :data:`FAILURES_ENV` folder, for
    :func:`failure_headline`; the traceback of an error that is neither a bad value (``user``) nor
    :func:`collateral` is printed here, prefixed with the rank. False (nothing done) outside the launcher."""
    import json
    import time
    import traceback

    from cuboid.cli import message

    folder = os.environ.get(FAILURES_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {"rank": rank, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "time": time.time(),
              "type": type(e).__name__, "message": message(e), "user": user, "collateral": collateral(e)}
    if not user and not record["collateral"]:
        lines = traceback.format_exception(type(e), e, e.__traceback__)
        print("".join(f"[rank {rank}] {line}" for line in "".join(lines).splitlines(True)), end="",
              file=sys.stderr, flush=True)
    tmp = Path(folder) / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(folder) / f"rank-{rank}.json")
    return True


def failure_headline(folder: Path):
    """(line, whether a bad value) of the first error the workers of the last attempt recorded that was not
    :func:`collateral` (None: none was recorded): rank 0's as one ``cuboid finetune: error:`` line, as every
    rank failing alike says it; another rank's prefixed with its rank (``[rank 1] ValueError: ...``)."""
    import json

    records = []
    for file in folder.glob("rank-*.json"):
        try:
            records.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            continue
    if not records:
        return None
    last = max(r["restart"] for r in records)
    causes = sorted((r for r in records if r["restart"] == last and not r["collateral"]),
                    key=lambda r: (r["time"], r["rank"]))
    if not causes:
        return None
    first = causes[0]
    same_on_0 = any(r["rank"] == 0 and r["message"] == first["message"] for r in causes)
    if first["user"] and same_on_0:
        return f"cuboid finetune: error: {first['message']}", True
    return f"[rank {first['rank']}] {first['type']}: {first['message']}", first["user"]


def cmd_finetune(args: argparse.Namespace) -> int:
    """The plan is read here, once (an ``auto`` one searched for the processes about to start), and passed
    on as a :class:`~cuboid.parallel.Plan`; under a launcher, ``auto`` is the trainer's to search."""
    from cuboid.loading.model import check_local_processes
    from cuboid.loading.planner import is_auto
    from cuboid.train.interrupt import (EXIT_CODE, SIGTERM_EXIT_CODE, Interrupted, Terminated, TerminateOnSigterm,
                                        interrupted_line, terminated_line)
    from cuboid.train.loop import run

    values = resolve(args)
    nproc = values.pop("nproc_per_node", None)
    restarts = values.pop("max_restarts", None)
    if restarts is not None and restarts < 0:
        raise ValueError(f"--max-restarts {restarts}: give 0 or more restarts")
    under_launcher = "WORLD_SIZE" in os.environ
    default = values.pop(DEVICE_DEFAULT, None)
    if default is not None:
        line = device_default(values, nproc, **default)
        if os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
    if not (is_auto(values.get("plan")) and under_launcher):  # under a launcher rank 0 searches, for every rank
        values["plan"] = plan = _door_plan(values, nproc)
    if not under_launcher:
        if nproc is not None and nproc != plan.world_size:
            raise ValueError(f"--nproc-per-node {nproc} does not fit plan {plan.describe()}, "
                             f"which needs {plan.world_size} processes")
        if plan.world_size > 1 or restarts:
            plan.validate()  # what needs no model is said before any process starts
            check_local_processes(plan.world_size, plan)
            argv = [a for a in sys.argv[1:]]
            if "finetune" not in argv:
                argv = ["finetune", *argv]
            out = values.get("output_dir") or FinetuneConfig.output_dir
            with launcher_lock(out):
                rc = _launch(plan.world_size, _strip_nproc(argv), restarts or 0, module=args.module)
            if rc == SIGTERM_EXIT_CODE:
                print(terminated_line(out, argv, args.module), file=sys.stderr, flush=True)
            return rc
    argv = args.argv if getattr(args, "argv", None) is not None else sys.argv[1:]
    try:
        with contextlib.nullcontext() if under_launcher else TerminateOnSigterm():  # (a worker: at once)
            run(FinetuneConfig(**values, callbacks=args.callbacks))
    except Interrupted as e:  # Ctrl-C: the step is saved
        if os.environ.get("RANK", "0") == "0":
            print(interrupted_line(e, argv, args.module), file=sys.stderr, flush=True)
        return EXIT_CODE
    except Terminated:  # SIGTERM: stopped at once; the newest complete checkpoint is named
        print(terminated_line(values.get("output_dir") or FinetuneConfig.output_dir, argv, args.module),
              file=sys.stderr, flush=True)
        return SIGTERM_EXIT_CODE
    return 0


@contextlib.contextmanager
def launcher_lock(output_dir: str):
    """The output folder's run lock held by the launcher for the whole launch, restarts included, before a
    worker starts (:func:`cuboid.train.resume.lock_output_dir`); its workers are told they belong to it."""
    from cuboid.train.resume import LOCK_ENV, lock_output_dir, unlock_output_dir

    lock_output_dir(Path(output_dir))
    os.environ[LOCK_ENV] = f"{os.getpid()}:{Path(output_dir).resolve()}"
    try:
        yield
    finally:
        os.environ.pop(LOCK_ENV, None)
        unlock_output_dir(Path(output_dir))


def gpu_count() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_default(values: dict, nproc, batch_given: bool = False) -> str:
    """Give the default job (``values``, no plan yet) the plan for the devices present; returns the one
    line that says which. Under a launcher: ``dp`` = its world size; ``--nproc-per-node N``: ``dp=N``;
    G GPUs: ``dp=G``, one process per GPU (one GPU: a single process); none: ``dp=2`` on CPU processes.
    The default batch, when ``dp`` does not divide it, is rounded up to a multiple of ``dp`` (a batch the
    user gave is kept, and checked as ever). The plan and batch are written into ``sys.argv`` too: the
    processes a launch starts run them."""
    gpus = gpu_count()
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        dp, why = int(world), f"{world} process(es) under the launcher"
    elif nproc is not None:
        dp, why = nproc, f"--nproc-per-node {nproc}"
    elif gpus:
        dp, why = gpus, f"{gpus} GPU{'s' if gpus > 1 else ''} found"
    else:
        dp, why = CPU_PROCESSES, "no GPU found"
    if dp < 1:
        raise ValueError(f"--nproc-per-node {dp}: give 1 or more processes")
    values["plan"] = plan = f"dp={dp}"
    if gpus:
        where = "a single process on cuda:0" if dp == 1 else f"{dp} processes, one per GPU (nccl)"
    else:
        where = "a single CPU process" if dp == 1 else f"{dp} CPU processes (gloo)"
    argv = [*_strip_option(sys.argv, "--plan"), "--plan", plan]
    note = ""
    batch = values["batch_size"]
    if batch % dp and not batch_given:
        values["batch_size"] = -(-batch // dp) * dp
        note = f"; global batch {values['batch_size']} ({batch} rounded up to a multiple of {dp})"
        argv += ["--batch-size", str(values["batch_size"])]
    sys.argv = argv
    return f"cuboid finetune: {why}: the default job runs plan {plan} on {where}{note}"


def _door_plan(values: dict, nproc):
    """The run's plan: ``auto`` searched for ``nproc`` processes (the command line the workers get names
    the chosen plan), anything else parsed."""
    from cuboid.loading.builder import ModelBuilder
    from cuboid.loading.model import plan_of
    from cuboid.loading.planner import default_seq, is_auto

    if not is_auto(values.get("plan")):
        return plan_of(values.get("plan"))
    model = ModelBuilder(values.get("model") or "vit-debug")
    plan = plan_of(values["plan"], model, batch=values.get("batch_size"),
                   seq=values.get("seq_len") or default_seq(model.config), dtype=values.get("dtype"), world=nproc or 1)
    sys.argv = [*_strip_option(sys.argv, "--plan"), "--plan", plan.describe()]
    return plan


def _strip_option(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` and ``flag=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _strip_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        out.append(a)
    return out
