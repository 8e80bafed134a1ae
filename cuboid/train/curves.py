"""``curves.png``: a fine-tune's train/eval loss and task metric against steps, from its ``metrics.jsonl``."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional


def axis_label(metric: str, evaluated: bool) -> str:
    """The metric axis's label: ``eval perplexity`` for an eval's metric (a metric named ``eval_...`` already,
    DPO's ``eval_rewards/accuracies``, as it is), the name alone for a training row's."""
    return f"eval {metric}" if evaluated and not metric.startswith("eval") else metric


def plot_curves(metrics_path: Path, png: Path, metric: str = "perplexity") -> Optional[str]:
    """Train/eval loss and the task's eval ``metric`` against steps (a metric the training rows log, GRPO's
    reward, when no eval gave it); None (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install 'cuboid[plot]')", file=sys.stderr,
              flush=True)
        return None
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows]
    evals = [r for r in rows if "eval_loss" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(*zip(*train), label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
        ax2.plot([r["step"] for r in evals], [r.get(metric) for r in evals], "o-", color="C2")
    logged = [r for r in rows if "eval_loss" not in r and r.get(metric) is not None]  # a training metric (reward)
    if logged and not evals:
        steps, values = [r["step"] for r in logged], [r[metric] for r in logged]
        k = window(len(values))
        ax2.plot(steps, values, color="C2", alpha=0.3, label=metric)
        ax2.plot(steps, moving_mean(values, k), color="C2", label=f"{metric}, moving mean of {k} steps")
        scored = [r for r in rows if r.get(f"eval_{metric}") is not None]  # (GRPO's eval_reward)
        if scored:
            ax2.plot([r["step"] for r in scored], [r[f"eval_{metric}"] for r in scored], "o-", color="C3",
                     label=f"eval {metric}")
        ax2.legend()
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.set_xlabel("step"), ax2.set_ylabel(axis_label(metric, evaluated=not (logged and not evals))), ax2.grid(alpha=0.3)
    fig.suptitle(f"cuboid finetune: {metrics_path.parent}")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def window(n: int) -> int:
    """The moving mean's width for ``n`` points: a tenth of them, 1 to 50."""
    return max(1, min(50, n // 10))


def moving_mean(values: list, k: int) -> list:
    """Each value's mean with the up to ``k - 1`` before it (the first ``k - 1`` over what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out
