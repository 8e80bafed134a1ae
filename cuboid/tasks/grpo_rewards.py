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
trusts"); a function that raises, returns the wrong length or a value that is
not a number stops the run with one sentence naming it.
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
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise TaskError(f"--reward {spec!r}: give MODULE:FUNCTION (a module on the path or a .py file)")
    module_name, fn_name = spec.split(":")
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
    except Exception as e:  # noqa: BLE001 (the user's module: any error is reported in one sentence)
        raise TaskError(f"--reward {spec}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TaskError(f"--reward {spec}: {module_name} has no function {fn_name}")
    return fn, fn_name


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
          completion_ids: list, columns: Optional[dict] = None) -> torch.Tensor:
    """(B, F) float64 rewards, NaN where a function returned None; a one-sentence error naming the function
    that raised or returned something else than B numbers or Nones."""
    columns = columns or {}
    out = torch.full((len(completions), len(funcs)), float("nan"), dtype=torch.float64)
    for i, (fn, name) in enumerate(zip(funcs, names)):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 (the user's function)
            raise TaskError(f"reward function {name} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise TaskError(f"reward function {name} returned {type(values).__name__}, not a list") from None
        if len(values) != len(completions):
            raise TaskError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                            "completions")
        for j, v in enumerate(values):
            if v is None:
                continue
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise TaskError(f"reward function {name} returned {v!r} (not a number or None) for completion "
                                f"{j}") from None
            if math.isnan(v):
                continue
            out[j, i] = v
    return out
