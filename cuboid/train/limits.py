"""The ranges of the numeric flags, checked at the door: a value out of range is one sentence naming the flag.

Every command's integer and float flags (``cuboid finetune``, ``prepare``,
``eval``, ``generate``, ``plans``) and a fine-tune config file's keys go
through :func:`check_number` before any work, so that 0 never silently means
a default, a negative count never trains or cuts rows, and a value past what
the run can hold (more than ``2**31 - 1`` of anything, an infinite or NaN
float) never reaches torch. An integer is at least 1 unless :data:`RANGES`
says otherwise; a float is finite unless it says more.
"""
from __future__ import annotations

import math
from typing import Optional

INT_MAX = 2 ** 31 - 1

# dest -> (least, most, which ends are open, what the value is): least/most None for no bound
# ("[]": both ends allowed; "(]": the least excluded; ...). Unlisted ints: [1, INT_MAX]; unlisted floats: finite.
RANGES: dict = {
    "seed": (0, 2 ** 32 - 1, "[]", "a seed"),
    "save_every": (0, INT_MAX, "[]", "steps between checkpoints; 0: at the end only"),
    "max_restarts": (0, 1000, "[]", "restarts"),
    "show": (0, INT_MAX, "[]", "rows to print"),
    "top_k": (0, INT_MAX, "[]", "tokens to sample among; 0: all"),
    "max_length": (2, INT_MAX, "[]", "tokens per row"),
    "seq_len": (2, INT_MAX, "[]", "tokens per row"),
    "epochs": (0.0, 1e6, "(]", "passes over the data"),
    "lr": (0.0, None, "()", "a learning rate"),
    "weight_decay": (0.0, None, "[)", "a weight decay"),
    "warmup": (0.0, None, "[)", "a fraction of the steps below 1, or a step count"),
    "max_grad_norm": (0.0, None, "[)", "a gradient norm; 0: no clipping"),
    "moe_bias_update_rate": (0.0, None, "[)", "a routing-bias step; 0: off"),
    "timeout_s": (0.0, 1e7, "(]", "seconds"),
    "eval_fraction": (0.0, 1.0, "[)", "a fraction of the examples; 0: no eval split"),
    "headroom": (0.0, 1.0, "[)", "a fraction of the memory"),
    "temperature": (0.0, None, "()", "a sampling temperature"),
    "top_p": (0.0, 1.0, "(]", "a probability"),
    "num_fewshot": (0, INT_MAX, "[]", "few-shot examples per prompt"),
    "limit": (0.0, None, "()", "examples per task, or a fraction of them below 1"),
    # cuboid plans: every plan of the world is enumerated and priced (2247 plans and a minute's enumeration
    # alone at 4096 for gpt2); past 1024 the command would not answer while one waits
    "gpus": (1, 1024, "[]", "GPUs to plan for; the enumeration stops there"),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_number(name: str, value, flag: Optional[str] = None) -> None:
    """A one-sentence ValueError when ``value`` (of the option ``name``, a flag's dest) is out of its range;
    ``flag``: the spelling to name (default ``--name``). None passes (unset)."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    flag = flag or _flag(name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{flag} {value}: must be a finite number")
    least, most, ends, what = RANGES.get(name, (1, INT_MAX, "[]", "a count") if isinstance(value, int)
                                         else (None, None, "()", "a number"))
    low = least is None or (value >= least if ends[0] == "[" else value > least)
    high = most is None or (value <= most if ends[1] == "]" else value < most)
    if low and high:
        return
    if least is not None and most is not None:
        rng = f"in {ends[0]}{least}, {most}{ends[1]}"
    elif least is not None:
        rng = f"{'>=' if ends[0] == '[' else '>'} {least}"
    else:
        rng = f"{'<=' if ends[1] == ']' else '<'} {most}"
    raise ValueError(f"{flag} {value}: must be {rng} ({what})")


def check_numbers(values: dict) -> None:
    """:func:`check_number` of each ``{name: value}``."""
    for name, value in values.items():
        check_number(name, value)
