"""GRPO's reward functions: named on the command line (``--reward MODULE:FUNCTION``) or passed as callables.

A reward function has TRL's signature::

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

``prompts``: the prompts as the data gives them (strings or message lists);
``completions``: the decoded completions (strings; a message list's prompt
gets ``[{"role": "assistant", "content": text}]`` as TRL does);
``completion_ids``: the completions' token ids (lists); ``columns``: the other
columns of the prompts' records, one list each. ``None``: the function does not
apply to that completion (ignored in the weighted sum). Importing
``MODULE:FUNCTION`` runs the user's code (docs/architecture.md, "What cuboid
trusts"); a function that raises (its file:line shown), calls ``exit()``,
hangs past the timeout (``--timeout-s`` unless ``reward_timeout_s``), returns
the wrong length or a value that is not a finite number (a string, NaN, inf)
stops the run with one sentence naming it, the row and the step.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from typing import Callable, Optional, Sequence

import torch

from .base import TaskError


def load_reward(spec) -> tuple:
    """``(callable, name)`` of a callable or a ``MODULE:FUNCTION`` text (a module on the path, or a ``.py``
    file: ``rewards.py:fn``)."""
    if callable(spec):
        return spec, getattr(spec, "__name__", type(spec).__name__)
    module_name, _, fn_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not module_name or not fn_name.isidentifier():  # from the right: a path may hold ':' (my:file.py:fn)
        raise TaskError(f"--reward {spec!r}: give MODULE:FUNCTION (a module on the path or a .py file)")
    try:
        if module_name.endswith(".py"):
            path = os.path.abspath(module_name)
            loader = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            if loader is None or not os.path.isfile(path):
                raise FileNotFoundError(path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # a module beside the run, as `python -m` finds it
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 (the user's module: any error, exit() too, in one sentence)
        import traceback

        frames = [f for f in traceback.extract_tb(e.__traceback__) if "importlib" not in f.filename][1:]
        shown = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise TaskError(f"--reward {spec}: importing {module_name} failed: {type(e).__name__}: "
                        f"{' '.join(str(e).split())}{shown}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskError(f"--reward {spec}: {module_name} has no function {fn_name}")
    return fn, fn_name


def is_spec(text: str) -> bool:
    """Whether ``text`` reads as MODULE:FUNCTION: a ``.py`` file or a dotted module name, then ':' and a name."""
    module, _, fn = text.strip().rpartition(":")
    return bool(module) and fn.isidentifier() and (module.endswith(".py")
                                                   or all(part.isidentifier() for part in module.split(".")))


def split_specs(text: str) -> list:
    """The MODULE:FUNCTION specs of ``text`` joined by ';' (a checkpoint's record, ``--reward a.py:f;b:g``): a ';'
    separates two only where the text before it reads as a whole spec (:func:`is_spec`), so a path may hold ';'
    or ':' (``my;dir/r.py:fn``, ``path/to/my:file.py:fn``)."""
    found, start = [], 0
    for at, ch in enumerate(text):
        if ch == ";" and is_spec(text[start:at]):
            found.append(text[start:at].strip())
            start = at + 1
    rest = text[start:].strip()
    if rest and not is_spec(rest) and found:  # not specs after all: load_reward names each piece it cannot read
        return [spec.strip() for spec in text.split(";") if spec.strip()]
    return found + ([rest] if rest else [])


def load_rewards(specs: Sequence) -> tuple:
    """``([callables], [names])``; a name given twice gets its index (TRL names them by ``__name__``)."""
    if isinstance(specs, (str, bytes)) or callable(specs):
        specs = [specs]
    funcs, names = [], []
    for spec in specs:
        fn, name = load_reward(spec)
        funcs.append(fn)
        names.append(name if name not in names else f"{name}_{len(names)}")
    return funcs, names


def parse_weights(text, n: int) -> torch.Tensor:
    """The reward weights (F,) float64: ``text`` "1,0.5" or a list, one per function; None: all 1."""
    if text is None:
        return torch.ones(n, dtype=torch.float64)
    values = text.split(",") if isinstance(text, str) else list(text)
    try:
        weights = [float(v) for v in values]
    except (TypeError, ValueError):
        raise TaskError(f"--reward-weights {text!r}: give numbers, comma-separated") from None
    if len(weights) != n:
        raise TaskError(f"--reward-weights has {len(weights)} weights for {n} reward functions")
    return torch.tensor(weights, dtype=torch.float64)


def score(funcs: Sequence[Callable], names: Sequence[str], prompts: list, completions: list,
          completion_ids: list, columns: Optional[dict] = None, *, step: Optional[int] = None,
          timeout_s: Optional[float] = None) -> torch.Tensor:
    """(B, F) float64 rewards, NaN where a function returned None; a one-sentence error naming the function
    (and ``step``) that raised (its own file:line), exited, ran past ``timeout_s`` seconds (None: the collective
    timeout, ``--timeout-s``), or returned something else than B finite numbers or Nones (naming the row)."""
    columns = columns or {}
    at = f" at step {step}" if step is not None else ""
    if timeout_s is None:
        from cuboid.parallel.timeouts import timeout_s as collective_timeout

        timeout_s = collective_timeout()
    failure = None
    try:
        out = _scores(funcs, names, prompts, completions, completion_ids, columns, at, timeout_s)
    except TaskError as e:
        failure, out = e, None
    _agree_on_failure(failure, at)
    return out


def _agree_on_failure(failure: Optional[Exception], at: str) -> None:
    """Every rank scores the same completions with user code, which may fail on one rank alone (its files,
    its clock): the ranks agree (one all-reduce of a flag over the world) and all raise together, so no rank
    goes on into the next collective while another has stopped."""
    import torch.distributed as dist

    failed = failure is not None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not failed:
            raise TaskError(f"a reward function failed on another rank{at} (its line is that rank's)")
    if failed:
        raise failure


def _scores(funcs, names, prompts, completions, completion_ids, columns, at, timeout_s) -> torch.Tensor:
    """:func:`score`'s work on this rank: each function called on the completions, its values checked."""
    out = torch.full((len(completions), len(funcs)), float("nan"), dtype=torch.float64)
    for i, (fn, name) in enumerate(zip(funcs, names)):
        values = call_user(fn, f"reward function {name}", at, timeout_s, prompts=prompts, completions=completions,
                           completion_ids=completion_ids, **columns)
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TaskError(f"reward function {name} returned {type(values).__name__}, not a list{at}")
        values = list(values)
        if len(values) != len(completions):
            raise TaskError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                            f"completions{at}")
        for j, v in enumerate(values):
            if v is not None:
                out[j, i] = reward_value(v, name, j, at)
    return out


def reward_value(v, name: str, row: int, at: str = "") -> float:
    """One reward as a float: a real number (a bool, an int, a float, a one-element tensor or numpy value), finite;
    a string, NaN or inf is refused naming the function and the row (TRL's None is how a function abstains)."""
    if isinstance(v, (str, bytes)):
        raise TaskError(f"reward function {name} returned the string {v!r} for completion {row}{at}: return a "
                        "number (or None where it does not apply)")
    try:
        f = float(v)
    except (TypeError, ValueError, RuntimeError):
        raise TaskError(f"reward function {name} returned {v!r} (not a number or None) for completion "
                        f"{row}{at}") from None
    if not math.isfinite(f):
        raise TaskError(f"reward function {name} returned {f} for completion {row}{at}: rewards must be finite "
                        "(return None where it does not apply)")
    return f


class _Late(BaseException):
    """Raised in the main thread by the watchdog's signal: the user's function ran past its time."""


def call_user(fn: Callable, what: str, at: str, timeout_s: Optional[float], **kwargs):
    """``fn(**kwargs)`` (user code), bounded by ``timeout_s`` seconds (None or 0: no bound): its value, or a
    one-line TaskError saying ``what`` raised (the exception and the user's file:line), called ``exit()``, or
    did not return in time. Ctrl-C (KeyboardInterrupt) goes on as it is.

    From the main thread (a run's) the function runs there, as a reward function expects (math_verify's own
    timeouts set SIGALRM, which only the main thread may), and a watchdog thread interrupts it with SIGURG
    (ignored by default, so a late one harms nothing); elsewhere it runs in a thread of its own, waited for."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    if timeout_s and main and hasattr(signal, "SIGURG") and hasattr(signal, "pthread_kill"):
        kind, got = _on_main(fn, timeout_s, kwargs)
    else:
        kind, got = _in_thread(fn, timeout_s, kwargs, what)
    if kind == "value":
        return got
    if kind == "late":
        raise TaskError(f"{what} did not return within {timeout_s:g} s{at} (a reward function that hangs; "
                        "--timeout-s bounds it)")
    if isinstance(got, KeyboardInterrupt):
        raise got
    if isinstance(got, SystemExit):
        raise TaskError(f"{what} called exit({got.code!r}){where(got, fn)}{at}: user code must return, not "
                        "end the run") from None
    message = " ".join(str(got).split())
    raise TaskError(f"{what} raised {type(got).__name__}{': ' + message if message else ''}{where(got, fn)}{at}") \
        from None


def _on_main(fn: Callable, timeout_s: float, kwargs: dict) -> tuple:
    """``fn(**kwargs)`` in this (the main) thread, a watchdog's SIGURG raising :class:`_Late` past ``timeout_s``:
    ("value", v), ("error", exception) or ("late", None)."""
    import signal
    import threading

    guard, state = threading.Lock(), {"running": True, "fired": False}
    main = threading.main_thread().ident

    def fire() -> None:
        with guard:
            if state["running"]:
                state["fired"] = True
                signal.pthread_kill(main, signal.SIGURG)

    def on_signal(signum, frame) -> None:
        if state["fired"]:
            raise _Late
        if callable(previous):
            previous(signum, frame)

    previous = signal.signal(signal.SIGURG, on_signal)
    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    try:
        try:
            timer.start()
            return "value", fn(**kwargs)
        finally:
            with guard:
                state["running"] = False
            timer.cancel()
    except _Late:
        return "late", None
    except BaseException as e:  # noqa: BLE001 (user code: exit() and the like end the run in one line)
        return "error", e
    finally:
        signal.signal(signal.SIGURG, previous)


def _in_thread(fn: Callable, timeout_s: Optional[float], kwargs: dict, what: str) -> tuple:
    """``fn(**kwargs)`` in a thread of its own, waited for at most ``timeout_s`` seconds (a hung one is left
    behind, a daemon): ("value", v), ("error", exception) or ("late", None)."""
    import threading

    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 (user code)
            box["error"] = e

    worker = threading.Thread(target=target, name=f"cuboid {what}", daemon=True)
    worker.start()
    worker.join(timeout_s if timeout_s else None)
    if worker.is_alive():
        return "late", None
    return ("error", box["error"]) if "error" in box else ("value", box.get("value"))


def where(e: BaseException, fn: Callable) -> str:
    """`` (file:line)`` of the user's frame an exception came from: the deepest in ``fn``'s own file, else the
    deepest of all ('' without a traceback)."""
    import traceback

    frames = traceback.extract_tb(e.__traceback__)[1:]  # past call_user's own frame
    if not frames:
        return ""
    code = getattr(getattr(fn, "__code__", None), "co_filename", None) or \
        getattr(getattr(type(fn).__call__, "__code__", None), "co_filename", None)
    own = [f for f in frames if f.filename == code]
    f = (own or frames)[-1]
    return f" ({f.filename}:{f.lineno})"
