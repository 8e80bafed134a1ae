"""How a run's sizes follow from its data and plan: the global batch fitted to a small training split, the
width rows are rounded to (:func:`width_multiple`), the line that describes the rows (:func:`padding_line`),
and a CPU run's intra-op threads (:func:`cpu_threads`).

A global batch larger than the training split (examples, pairs, or packed rows) is reduced to the most of
them that the plan splits evenly (a multiple of dp, of the pipeline's micro-batches and of a given
micro-batch, and of the rows a task makes of each example), and one line says so, as TRL's and the HF
Trainer's users expect a small file to train rather than stop. (Warmup rounds up to whole steps in
:func:`cuboid.train.schedule.warmup_steps`.)
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

from cuboid.data.formats import real_tokens

__all__ = ["fit_batch", "width_multiple", "padding_line", "cpu_threads", "set_cpu_threads", "threads_kept"]

MAX_CPU_THREADS = 16  # past this one process's intra-op threads gain little on a small model


def cpu_threads(env: dict, cores: int, local_processes: int = 1, quota: Optional[float] = None,
                load: Optional[float] = None, cap: int = MAX_CPU_THREADS) -> tuple:
    """(intra-op threads for each of ``local_processes`` CPU processes, why) or (None, None) when the user
    chose (``OMP_NUM_THREADS`` in ``env``). ``cores``: those the process may run on
    (``os.sched_getaffinity``), ``quota``: the cgroup's CPU limit in cores, ``load``: the machine's
    one-minute load average, of which the run's own processes are taken to be ``local_processes``. Threads
    beyond the idle cores wait on each other (bench/RESULTS.md has the measured cost)."""
    if env.get("OMP_NUM_THREADS"):
        return None, None
    usable = float(cores)
    why = [f"{cores} core{'s' if cores != 1 else ''} available"]
    if quota is not None and quota < usable:
        usable, why = quota, why + [f"a CPU quota of {quota:g}"]
    others = max(0.0, load - local_processes) if load is not None else 0.0  # the load of other work
    if cores - others < usable:
        usable, why = cores - others, why + [f"load {load:.1f}"]
    threads = max(1, min(cap, int(usable // max(local_processes, 1)), cores))
    if local_processes > 1:
        why.append(f"{local_processes} processes")
    return threads, ", ".join(why)


@contextlib.contextmanager
def threads_kept():
    """torch's intra-op thread count as it was, once the block ends (a run's :func:`set_cpu_threads` is the
    run's alone: the Python process that called ``cuboid.finetune`` keeps its own)."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _cgroup_quota() -> Optional[float]:
    """The cgroup v2 CPU limit in cores (``cpu.max``), None when unlimited or unreadable."""
    try:
        limit, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        return None


def set_cpu_threads(environ=None) -> Optional[str]:
    """Set torch's intra-op threads for a CPU run by :func:`cpu_threads` (nothing when ``OMP_NUM_THREADS`` is
    set); the one line that says so, or None."""
    import os

    import torch

    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    threads, why = cpu_threads(environ, cores, int(environ.get("LOCAL_WORLD_SIZE", "1")), _cgroup_quota(), load)
    if threads is None:
        return None
    torch.set_num_threads(threads)
    return (f"cuboid finetune: {threads} CPU thread{'s' if threads != 1 else ''} a process ({why}; set "
            f"OMP_NUM_THREADS to choose)")


def fit_batch(batch: int, examples: int, *, per: int = 1, dp: int = 1, pipeline_microbatches: int = 1,
              micro: Optional[int] = None, unit_name: str = "examples") -> tuple[int, Optional[str]]:
    """(the global batch to use, the line that says it was reduced, or None when ``batch`` fits).

    ``batch`` counts rows, ``per`` rows each of the ``examples`` makes (GRPO's completions a prompt); the
    reduced batch is a multiple of ``per`` and of ``dp x pipeline_microbatches x micro`` (``micro``: a
    micro-batch the user gave). A split too small for one such batch is a one-line ValueError."""
    if examples <= 0 or batch <= examples * per:
        return batch, None  # (an empty split: the batching says so)
    unit = math.lcm(per, dp * pipeline_microbatches * (micro or 1))
    fitted = examples * per // unit * unit
    what = f"{examples} training {unit_name}"
    if fitted == 0:
        raise ValueError(f"--batch-size {batch} is larger than the {what}, and this plan needs a multiple of "
                         f"{unit} rows a batch: give more data or a plan with less data parallelism")
    note = "" if fitted == examples * per else f" (a multiple of {unit}, as the plan splits it)"
    return fitted, f"cuboid finetune: --batch-size {batch} is larger than the {what}: batches of {fitted}{note}"


def width_multiple(plan) -> int:
    """What a batch's row width is rounded up to: whole pieces for the plan's sequence and tensor splits
    (and multiples of 8 for the kernels' tiles)."""
    return math.lcm(8, 2 * plan.sp * plan.tp)


def padding_line(tensors: dict, batch_size: Optional[int] = None) -> str:
    """The training rows' padding in one line (packed rows: how many documents they hold; rows padded to
    the split's longest: that batches are cut to their own longest) and, with labels, the trained tokens
    (loss targets: labels not -100 after a row's first position, which the shift never predicts)."""
    ids = tensors["input_ids"]
    ids = ids.reshape(-1, ids.shape[-1])  # (pairs of rows, (P, 2, L): their rows)
    rows, width = ids.shape
    real = real_tokens(tensors)
    line = f"data: {rows} rows of {width} tokens, {real:,} of them real, padding {1 - real / ids.numel():.1%}"
    if "position_ids" in tensors:  # a packed row: a document starts at each position 0 (a split one once a piece)
        docs = int(((tensors["position_ids"] == 0) & (tensors["attention_mask"] == 1)).sum())
        line += f" (packed: {docs} documents, {docs / rows:.1f} a row, attending only within themselves)"
    elif "attention_mask" in tensors and "labels" in tensors and tensors["labels"].dim() == 2:
        line += " at the longest row's width (each batch is cut to its own longest row)"
    labels = tensors.get("labels")
    labels = labels.reshape(-1, labels.shape[-1]) if labels is not None and labels.dim() == 3 else labels
    if labels is not None and labels.dim() == 2 and labels.shape == ids.shape:
        trained = int((labels[:, 1:] != -100).sum())
        line += f"; {trained:,} trained tokens" + (f", {trained * batch_size / rows:,.0f} a step on average"
                                                   if batch_size else "")
    return line
