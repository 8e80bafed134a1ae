"""The ``cuboid`` command.

Subcommands: ``finetune`` (the main job; with no arguments it trains a small
ViT on scikit-learn's handwritten digits with plan dp=2 on 2 local
processes), ``info`` (environment and kernel backends), ``plans`` (the ready
plans, or every plan ranked for a model and a cluster: :mod:`cuboid.cli.plans`), ``eval`` (perplexity
of a causal LM on a text, a task's metrics, or lm-evaluation-harness tasks: :mod:`cuboid.cli.eval`), ``generate`` (text from a causal LM:
:mod:`cuboid.cli.generate`), ``prepare`` (a dataset tokenized as finetune would, with a report:
:mod:`cuboid.cli.prepare`) and ``convert``. Bad values are one line on stderr
and exit code 2 (an unknown flag: named with the subcommand, and the flag it may have meant); Ctrl-C is
one line and exit code 130 (a fine-tune first saves its step, :mod:`cuboid.train.interrupt`). Help texts are
plain text (:func:`plain`: the docstrings' markup taken out). The ``datasets`` library's progress bars
show only with ``--verbose``.
"""
from __future__ import annotations

import argparse
import difflib
import os
import platform
import re
import sys
from typing import Optional, Sequence


def _versions() -> list[tuple[str, str]]:
    import torch

    rows = [("python", platform.python_version()), ("torch", torch.__version__)]
    try:
        import triton

        rows.append(("triton", triton.__version__))
    except ImportError:  # pragma: no cover - triton is a dependency
        rows.append(("triton", "not installed"))
    from importlib.metadata import version

    rows.append(("cuboid", version("cuboid")))
    return rows


def _devices() -> list[tuple[str, str]]:
    import torch

    rows = [("cpu", f"{torch.get_num_threads()} threads")]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append((f"cuda:{i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"))
    else:
        rows.append(("cuda", "not available"))
    return rows


def backend_table() -> list[tuple[str, str, str, str]]:
    """(op, device, backend, why) for every kernel op on every device type here."""
    import torch

    from cuboid.kernels import OPS, auto_backend

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    rows = []
    for op in OPS:
        for dev in devices:
            backend, why = auto_backend(dev)
            rows.append((op, dev.type, backend, why))
    return rows


def model_rows(model: str) -> list[tuple[str, str]]:
    """(what, value) rows of a preset or model folder: its parameters, and for a mixture of experts the active
    ones (what a token uses: the router and ``experts_per_token`` of each sparse layer's experts) and its
    experts. Counted on the meta device: nothing is allocated or read but the config."""
    from cuboid.parallel.cost import Shape
    from cuboid.loading.planner import config_of
    from cuboid.cli.tables import count

    shape = Shape.of(config_of(model))
    rows = [("layers", str(shape.n_layers)), ("parameters", count(shape.parameters))]
    if shape.sparse:
        share = shape.active_parameters / shape.parameters
        rows += [("active parameters", f"{count(shape.active_parameters)}, {share:.1%} of them (per token)"),
                 ("experts", f"{shape.experts} per sparse layer, {shape.top_k} per token, width "
                             f"{shape.expert_width}; {shape.sparse_layers} of {shape.n_layers} layers sparse")]
        if shape.shared_hidden:  # DeepSeek-V3: a shared expert beside the routed ones, run by every token
            rows.append(("shared experts", f"one gated MLP of width {shape.shared_hidden} per sparse layer"))
        if shape.latent:
            rows.append(("latent attention", f"cache of {shape.cache_elements()} numbers per token and layer "
                                             f"(latent {shape.latent} + RoPE key {shape.rope_dim})"))
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    from cuboid.kernels import interpreter_active
    from cuboid.cli.tables import table

    if args.model:
        print(table(model_rows(args.model), ("model", args.model)))
        return 0
    print("cuboid environment\n")
    print(table(_versions(), ("package", "version")))
    print()
    print(table(_devices(), ("device", "details")))
    print()
    print(f"Triton interpreter: {'on' if interpreter_active() else 'off'} (TRITON_INTERPRET at import)")
    print()
    print(table(backend_table(), ("op", "device", "backend", "why")))
    return 0


_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?: <[^>]*>)?`")  # :func:`x`, :mod:`~a.b`, :class:`text <target>`
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """Docstring text as a terminal shows it: Sphinx roles (``:func:`cuboid.load```) and double-backquoted
    literals as their bare text (a ``~`` role: its last name)."""
    def role(m: re.Match) -> str:
        return m.group(1).rsplit(".", 1)[-1] if "`~" in m.group(0) else m.group(1)

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (``cuboid CMD: error: ...``) and exit code 2, and whose
    help is plain text; the subcommands' parsers are of this class too (``add_subparsers`` makes its parent's
    kind)."""

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{self.prog}: error: {message} ({self.prog} --help lists the flags)", file=sys.stderr)
        self.exit(2)

    def format_help(self) -> str:
        return plain(super().format_help())


# what users of the HF Trainer and TRL type, and cuboid's flag for it
HF_FLAGS = {"--learning-rate": "--lr", "--num-train-epochs": "--epochs", "--max-steps": "--steps",
            "--per-device-train-batch-size": "--micro-batch-size", "--gradient-accumulation-steps": "--micro-batch-size",
            "--warmup-ratio": "--warmup", "--warmup-steps": "--warmup", "--lr-scheduler-type": "--schedule",
            "--max-seq-length": "--max-length", "--logging-steps": "--log-every", "--save-steps": "--save-every",
            "--eval-steps": "--eval-every", "--save-total-limit": "--keep", "--resume-from-checkpoint": "--resume",
            "--model-name-or-path": "--model", "--dataset-name": "--data", "--bf16": "--dtype bf16",
            "--fp16": "--dtype fp16", "--lora-r": "--lora r=N", "--lora-alpha": "--lora alpha=N"}


def unknown_flags(parser: argparse.ArgumentParser, extra: list) -> str:
    """The error text of arguments ``parser`` does not take, with the flag each unknown one may have meant."""
    flags = [s for a in parser._actions for s in a.option_strings]
    hints = []
    for arg in extra:
        name = arg.split("=", 1)[0].replace("_", "-")
        if not name.startswith("--"):
            continue
        hf = {k: v for k, v in HF_FLAGS.items() if v.split(" ")[0] in flags}  # (this command's flags only)
        near = next(iter(difflib.get_close_matches(name, [*flags, *hf], n=1, cutoff=0.75)), None)
        meant = hf.get(name) or hf.get(near, near)
        if meant is not None:
            hints.append(f"{arg.split('=', 1)[0]}: did you mean {meant}?")
    return "; ".join([f"unrecognized arguments: {' '.join(extra)}", *hints])


DATA_COMMANDS = ("finetune", "prepare", "eval")  # the commands that read data through the datasets library


def quiet_datasets(verbose: bool) -> None:
    """The ``datasets`` library's progress bars off, or (``verbose``) on; its own environment variable
    (``HF_DATASETS_DISABLE_PROGRESS_BARS``), when set, decides instead. Every process a launch starts runs it."""
    if "HF_DATASETS_DISABLE_PROGRESS_BARS" in os.environ:
        return
    from datasets.utils import disable_progress_bars, enable_progress_bars

    (enable_progress_bars if verbose else disable_progress_bars)()


def message(e: BaseException) -> str:
    """The whole of an error in one line: an OS error with its path, a text that is not UTF-8 as such, a
    KeyError's text without quotes, newlines folded."""
    if isinstance(e, OSError) and e.strerror:
        where = f": {e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") if e.filename else ""
        text = f"{e.strerror}{where}"
    elif isinstance(e, UnicodeDecodeError):
        text = f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start} ({e.reason})"
    elif isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str):
        text = e.args[0]
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


# the errors that are the user's input, each one line and exit code 2; anything else is a bug: a traceback
USER_ERRORS = (ValueError, OSError, NotImplementedError, KeyError, IndexError, FloatingPointError)


def check_numbers(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every numeric flag of the chosen command in its range (:mod:`cuboid.train.limits`), before any work."""
    from cuboid.train.limits import check_number

    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(args.command) if sub is not None else None
    for action in getattr(command, "_actions", ()):
        if action.type in (int, float) and action.option_strings:
            check_number(action.dest, getattr(args, action.dest, None), action.option_strings[0])


def build_parser() -> argparse.ArgumentParser:
    from cuboid.cli.finetune import add_parser as add_finetune

    parser = Parser(prog="cuboid", description=description(), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_finetune(sub)
    p_info = sub.add_parser("info", help="versions, devices and the kernel backend each op uses here; with "
                                         "--model, a model's parameters (a mixture of experts': total and active)")
    p_info.add_argument("--model", default=None, help="a preset name or a model folder: print its parameter "
                                                      "counts (total, and active per token for experts) instead")
    p_info.set_defaults(func=cmd_info)
    from cuboid.cli.plans import add_parser as add_plans

    add_plans(sub)
    from cuboid.cli.eval import add_parser as add_eval
    from cuboid.cli.generate import add_parser as add_generate
    from cuboid.cli.prepare import add_parser as add_prepare

    add_eval(sub)
    add_generate(sub)
    add_prepare(sub)
    try:
        from cuboid.cli.convert import add_parser as add_convert
    except ImportError:  # pragma: no cover - arrives with the checkpoint package
        pass
    else:
        add_convert(sub)
    for name in DATA_COMMANDS:
        if "--verbose" not in sub.choices[name]._option_string_actions:
            sub.choices[name].add_argument("--verbose", action="store_true",
                                           help="show the datasets library's progress bars (off by default)")
    return parser


def description() -> str:
    """What ``cuboid --help`` says the library is: its families, tasks and plans."""
    import textwrap

    from cuboid import tasks

    text = ("cuboid: fine-tune transformers on PyTorch under parallel plans, from the command line or "
            "Python. Models: GPT-2, BERT, ViT, Llama, Qwen2, Qwen3, Mistral, Gemma 3 and the Qwen3-MoE, Mixtral "
            "and OLMoE mixtures of experts (presets, or local Hugging Face folders). Tasks: "
            f"{', '.join(tasks.names())}; in full, with LoRA or with QLoRA. Plans: data parallelism with ZeRO 1-3, "
            "tensor parallelism (1D, 2D, 2.5D, 3D), sequence (ring, all-to-all), pipeline and expert "
            "parallelism, and their products ('cuboid plans' lists them). Checkpoints are sharded safetensors "
            "in the Hugging Face layout.")
    return textwrap.fill(text, 100)


def main(argv: Optional[Sequence[str]] = None, *, callbacks: Sequence = (), module: str = "cuboid") -> int:
    """Run the ``cuboid`` command ``argv`` (default: ``sys.argv[1:]``); its exit code.

    A program that wraps the command (``python -m mywrapper finetune ...``) passes its fine-tune
    ``callbacks`` (:mod:`cuboid.train.callbacks`) and its own ``module`` name, so that the processes a
    multi-process ``finetune`` launches run the wrapper too and install the same callbacks.
    """
    command = None
    try:
        parser = build_parser()  # (what it imports, Ctrl-C may interrupt too)
        args, extra = parser.parse_known_args(argv)
        command = args.command
        if extra:  # the subcommand's parser names itself and its flags
            sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            named = sub.choices.get(args.command, parser) if args.command else parser
            named.error(unknown_flags(named, extra))
        args.callbacks, args.module = tuple(callbacks), module
        args.argv = list(argv) if argv is not None else None
        if getattr(args, "func", None) is None:
            parser.print_help()
            return 2
        if args.command in DATA_COMMANDS:
            quiet_datasets(args.verbose)
        check_numbers(parser, args)
        return args.func(args)
    except USER_ERRORS as e:
        from cuboid.cli.finetune import record_failure

        if record_failure(e, user=True):  # a worker of `cuboid finetune`'s launch: the launcher says it
            return 2
        if int(os.environ.get("RANK", "0")) == 0:  # every rank fails alike: one line, from rank 0
            print(f"cuboid {command}: error: {message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (a fine-tune's line after its save is cuboid.cli.finetune's): no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"cuboid{' ' + command if command else ''}: interrupted" + (
                " at once, without saving: --resume latest continues from the newest complete checkpoint in "
                "--output-dir, if there is one" if command == "finetune" else ""), file=sys.stderr)
        return 130
    except Exception as e:  # a worker of a launch: its traceback unless it only saw another rank fail
        from cuboid.cli.finetune import record_failure

        if not record_failure(e, user=False):
            raise
        return 1

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
