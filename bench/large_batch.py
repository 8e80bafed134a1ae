"""Large-batch training in miniature: does LAMB/LARS hold accuracy where AdamW falls apart?

The claim of the LAMB and LARS papers (You et al., arXiv 1904.00962 and
1708.03888), at CPU scale. The task has unlimited locally generated data: a
fixed random teacher (a 2-layer tanh MLP) labels Gaussian inputs with the
argmax of its logits, and a student MLP (Linear + LayerNorm + GELU blocks, so
it has biases and norm weights) learns it by cross-entropy. Every run sees
the *same* training examples in the same order (``--examples``, one pass) at
a global batch of 64, 256, 1024, 4096 or 16384, so a larger batch means
fewer steps (gradient accumulation in micro-batches of ``--micro-batch``).

Optimizers (cuboid's own, built as the fine-tune loop builds them:
``cuboid.train.loop.make_optimizer``, biases and norms without decay or trust
ratio), each with linear warmup over ``--warmup`` of the steps and the
LAMB paper's polynomial decay (power 1), learning rates from
``cuboid.train.schedule``:

- ``adamw-linear``: AdamW, lr scaled by ``B / 64`` (Goyal et al.);
- ``adamw-sqrt``: AdamW, lr scaled by ``sqrt(B / 64)``;
- ``lamb``: LAMB, sqrt scaling (the LAMB paper's rule);
- ``lars-linear``: LARS (momentum 0.9, eta 1e-3), linear scaling (the LARS
  paper's); ``lars-sqrt``: the same with sqrt scaling. Biases and norm
  weights take plain momentum-SGD steps at the global lr (the recipe's
  exclusion), so they, not the trust-ratio layers, bound LARS's usable lr.

Each (optimizer, batch) cell sweeps three base rates, 3x apart (the rate at
the reference batch 64, scaled by the optimizer's rule); while the best of
them is at an edge of what was swept, the sweep goes one more 3x step past
that edge, at most ``--extend`` (2) times. A cell where no rate learned
(best accuracy under twice the largest class's share: every run blew up
early) steps *down* instead, at most ``--extend-collapsed`` (4) times, since
the edge that "wins" among collapsed runs is noise. The table reports the
best test accuracy per cell, marked where the best needed an extension or
still sits at an edge, and the JSON keeps every run of the sweep (a run
whose loss turned non-finite counts as chance accuracy and is marked
diverged). ``--reuse`` takes runs of the same settings from an earlier JSON
instead of training them again (one thread on CPU: the same numbers).

    python bench/large_batch.py [--examples 524288] [--out bench/large_batch.json] [--png bench/large_batch.png]

One process, one thread (the machine is shared); timings are wall-clock and
only reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from cuboid.train.schedule import lr_lambda, scaled_lr, warmup_steps
from cuboid.train.loop import make_optimizer

REFERENCE_BATCH = 64
BATCHES = (64, 256, 1024, 4096, 16384)
# name -> (cuboid optimizer, lr scaling, base lr grid at the reference batch, weight decay)
# (grids: 3x apart around the best rate of a pilot at batch 64, where all three do within ~1.5 points)
OPTIMIZERS = {
    "adamw-linear": ("adamw", "linear", (3e-3, 1e-2, 3e-2), 0.01),
    "adamw-sqrt": ("adamw", "sqrt", (3e-3, 1e-2, 3e-2), 0.01),
    "lamb": ("lamb", "sqrt", (3e-3, 1e-2, 3e-2), 0.01),
    "lars-linear": ("lars", "linear", (0.3, 1.0, 3.0), 1e-4),
    "lars-sqrt": ("lars", "sqrt", (0.3, 1.0, 3.0), 1e-4),
}


# ---------------------------------------------------------------- the task


class Teacher(nn.Module):
    """A fixed random 2-layer tanh MLP; labels are the argmax of its logits."""

    def __init__(self, d_in: int, hidden: int, classes: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w1 = torch.randn(d_in, hidden, generator=gen) * (2.0 / math.sqrt(d_in))
        self.w2 = torch.randn(hidden, classes, generator=gen) / math.sqrt(hidden)

    @torch.no_grad()
    def label(self, x: torch.Tensor) -> torch.Tensor:  # (N, d_in) -> (N,)
        return (torch.tanh(x @ self.w1) @ self.w2).argmax(-1)


def make_data(n: int, d_in: int, teacher: Teacher, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=gen)
    return x, teacher.label(x)


class Student(nn.Module):
    """``depth`` blocks of Linear -> LayerNorm -> GELU, then a linear head: weights, biases and norm weights."""

    def __init__(self, d_in: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        layers, d = [], d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.LayerNorm(width), nn.GELU()]
            d = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, d_in) -> (B, classes)
        return self.head(self.body(x))


# ---------------------------------------------------------------- one run


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = sum(int((model(xb).argmax(-1) == yb).sum()) for xb, yb in zip(x.split(8192), y.split(8192)))
    model.train()
    return correct / len(y)


def train_once(name: str, batch: int, base_lr: float, data, test, args) -> dict:
    kind, scaling, _, wd = OPTIMIZERS[name]
    x, y = data
    steps = len(y) // batch
    warm = warmup_steps(args.warmup, steps)
    peak = scaled_lr(base_lr, batch, REFERENCE_BATCH, scaling)
    torch.manual_seed(args.seed)  # the same initial student in every run
    model = Student(x.shape[1], args.width, args.depth, args.classes)
    opt = make_optimizer(kind, model, peak, wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("poly", warm, steps, 1.0))
    micro = min(batch, args.micro_batch)
    loss_fn = nn.CrossEntropyLoss()
    t0, diverged, last_loss = time.perf_counter(), False, float("nan")
    losses = []
    for step in range(steps):
        xb, yb = x[step * batch:(step + 1) * batch], y[step * batch:(step + 1) * batch]
        total = 0.0
        for xm, ym in zip(xb.split(micro), yb.split(micro)):  # gradient accumulation
            loss = loss_fn(model(xm), ym) * (len(ym) / batch)
            loss.backward()
            total += float(loss.detach())
        if not math.isfinite(total):
            diverged = True
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        last_loss = total
        if step % max(1, steps // 8) == 0 or step == steps - 1:
            losses.append((step + 1, round(total, 4)))
    acc = 1.0 / args.classes if diverged else accuracy(model, *test)
    if not diverged and not all(torch.isfinite(p).all() for p in model.parameters()):
        diverged, acc = True, 1.0 / args.classes
    return {"optimizer": name, "batch": batch, "base_lr": base_lr, "peak_lr": peak, "scaling": scaling,
            "steps": steps, "warmup_steps": warm, "micro_batch": micro, "accuracy": acc, "diverged": diverged,
            "final_train_loss": last_loss, "loss_curve": losses, "seconds": round(time.perf_counter() - t0, 2)}


# ---------------------------------------------------------------- table and plot


def sweep_cell(name: str, batch: int, data, test, args, collapsed_below: float, cache: dict) -> list[dict]:
    """The grid's runs for one cell, then 3x steps past an edge while the edge wins (``args.extend`` at most),
    or down while no run learned (``args.extend_collapsed`` at most)."""
    runs = []

    def one(lr: float, extended: bool) -> None:
        r = cache.get((name, batch, lr)) or train_once(name, batch, lr, data, test, args)
        r["extended"] = extended
        runs.append(r)
        print(f"  B={batch:>5} {name:<13} base lr {lr:<7.3g} peak {r['peak_lr']:<8.3g} {r['steps']:>5} steps: "
              f"acc {100 * r['accuracy']:.1f}%{' DIVERGED' if r['diverged'] else ''}"
              f"{' (extension)' if extended else ''} ({r['seconds']:.1f} s)", flush=True)

    for lr in OPTIMIZERS[name][2]:
        one(lr, False)
    edges = down = 0
    while True:
        lrs = sorted(r["base_lr"] for r in runs)
        best = max(runs, key=lambda r: (r["accuracy"], -r["base_lr"]))
        if best["accuracy"] < collapsed_below:
            if down == args.extend_collapsed:
                break
            down += 1
            one(float(f"{lrs[0] / 3:.4g}"), True)
            continue
        if edges == args.extend:
            break
        edges += 1
        if best["base_lr"] == lrs[0]:
            one(float(f"{lrs[0] / 3:.4g}"), True)
        elif best["base_lr"] == lrs[-1]:
            one(float(f"{lrs[-1] * 3:.4g}"), True)
        else:
            break
    return runs


def best_cells(runs: list[dict]) -> dict:
    best: dict = {}
    for r in runs:
        key = (r["optimizer"], r["batch"])
        if key not in best or r["accuracy"] > best[key]["accuracy"]:
            best[key] = r
    return best


def table(runs: list[dict], batches) -> str:
    best = best_cells(runs)
    names = [n for n in OPTIMIZERS if any(r["optimizer"] == n for r in runs)]
    steps = {r["batch"]: r["steps"] for r in runs}
    head = "| optimizer (lr scaling) | " + " | ".join(f"B={b} ({steps.get(b, '?')} steps)" for b in batches) + " |"
    lines = [head, "|" + "---|" * (len(batches) + 1)]
    for n in names:
        cells = []
        for b in batches:
            r = best.get((n, b))
            lrs = sorted(x["base_lr"] for x in runs if (x["optimizer"], x["batch"]) == (n, b))
            edge = r is not None and r["base_lr"] in (lrs[0], lrs[-1])
            cells.append("" if r is None else f"{100 * r['accuracy']:.1f}% @ {r['base_lr']:.3g}"
                         + ("†" if r.get("extended") else "") + ("*" if edge else "")
                         + (" (all diverged)" if r["diverged"] else ""))
        lines.append(f"| {n} ({OPTIMIZERS[n][1]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], batches, png: Path, title: str, majority: float | None = None) -> str | None:
    """Accuracy vs batch, one line per optimizer: left the rule's 3-value grid only, right the extended sweep."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib)")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    panels = (("the scaling rule's 3-value lr grid", [r for r in runs if not r.get("extended")]),
              ("the sweep extended past winning edges / down from collapse", runs))
    for ax, (label, chosen) in zip(axes, panels):
        best = best_cells(chosen)
        for i, n in enumerate(OPTIMIZERS):
            pts = [(b, 100 * best[(n, b)]["accuracy"]) for b in batches if (n, b) in best]
            if pts:
                ax.plot(*zip(*pts), "o-" if i % 2 == 0 else "s--", label=f"{n} ({OPTIMIZERS[n][1]} lr scaling)")
        if majority is not None:
            ax.axhline(100 * majority, color="grey", ls=":", lw=1, label="majority class")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(batches), [str(b) for b in batches])
        ax.set_xlabel("global batch (same examples: fewer steps at larger batch)")
        ax.set_title(f"best of {label}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=524288, help="training examples per run (one pass)")
    ap.add_argument("--test", type=int, default=16384, help="held-out examples")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--d-in", type=int, default=32)
    ap.add_argument("--teacher-hidden", type=int, default=64)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=0.1, help="warmup fraction of the steps")
    ap.add_argument("--micro-batch", type=int, default=4096, help="larger batches accumulate gradients")
    ap.add_argument("--extend", type=int, default=2, help="3x steps past a winning edge of the lr grid, at most")
    ap.add_argument("--extend-collapsed", type=int, default=4,
                    help="3x steps down from the grid where no rate learned, at most")
    ap.add_argument("--reuse", default=None, help="an earlier JSON of the same settings: its runs are not repeated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/large_batch.json")
    ap.add_argument("--png", default="bench/large_batch.png")
    ap.add_argument("--from-json", action="store_true", help="only print the table and draw the plot of --out")
    args = ap.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.out).read_text())
        report(saved["runs"], saved["meta"], saved["seconds"], args)
        return
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    names = args.optimizers.split(",")
    teacher = Teacher(args.d_in, args.teacher_hidden, args.classes, seed=1234)
    data = make_data(args.examples, args.d_in, teacher, seed=1)
    test = make_data(args.test, args.d_in, teacher, seed=2)
    shares = torch.bincount(test[1], minlength=args.classes).float() / args.test
    print(f"task: {args.d_in}-d Gaussian inputs, {args.classes} classes from a random teacher "
          f"(largest class {100 * shares.max():.1f}% of the test set), {args.examples} training examples, "
          f"student {args.depth}x{args.width} MLP "
          f"({sum(p.numel() for p in Student(args.d_in, args.width, args.depth, args.classes).parameters()):,} "
          f"parameters)", flush=True)
    runs: list[dict] = []
    t0 = time.perf_counter()
    meta = {k: v for k, v in vars(args).items()}
    cache: dict = {}
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        keys = ("examples", "test", "d_in", "teacher_hidden", "classes", "width", "depth", "warmup", "micro_batch",
                "seed")
        if any(old["meta"].get(k) != meta[k] for k in keys):
            raise SystemExit(f"--reuse {args.reuse}: its settings differ ({', '.join(keys)})")
        cache = {(r["optimizer"], r["batch"], r["base_lr"]): r for r in old["runs"]}
        meta["reused_seconds"] = old["seconds"]
    meta.update(reference_batch=REFERENCE_BATCH, largest_class_share=float(shares.max()),
                optimizers={n: dict(zip(("cuboid_optimizer", "lr_scaling", "base_lr_grid", "weight_decay"), v))
                            for n, v in OPTIMIZERS.items() if n in names},
                schedule="linear warmup then poly decay, power 1 (cuboid.train.schedule.lr_lambda('poly'))")
    for b in batches:
        for n in names:
            runs += sweep_cell(n, b, data, test, args, 2 * float(shares.max()), cache)
            Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs,
                                                  "seconds": round(time.perf_counter() - t0, 1)}, indent=1))
    total = round(time.perf_counter() - t0, 1)
    Path(args.out).write_text(json.dumps({"meta": meta, "runs": runs, "seconds": total}, indent=1))
    report(runs, meta, total, args)


def report(runs: list[dict], meta: dict, seconds: float, args) -> None:
    batches = sorted({r["batch"] for r in runs})
    reused = f", {meta['reused_seconds'] / 60:.1f} min in the run --reuse took the rest from" \
        if meta.get("reused_seconds") else ""
    print(f"\nbest test accuracy per cell (base lr at batch {REFERENCE_BATCH} after the @; † an extension past the "
          f"3-value grid, * still at an edge of the sweep; {meta['examples']} examples in every run; "
          f"{len(runs)} runs, {seconds / 60:.1f} min{reused})\n")
    print("the scaling rule's 3-value grid only:\n")
    print(table([r for r in runs if not r.get("extended")], batches))
    print("\nthe whole sweep (extensions included):\n")
    print(table(runs, batches))
    png = plot(runs, batches, Path(args.png),
               f"large-batch training in miniature: {meta['examples']} examples of a random-teacher task at every "
               f"batch (bench/large_batch.py)", meta.get("largest_class_share"))
    print(f"\nwrote {args.out}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
