"""bench/gpu.py parts 4 and 5: whole training steps and generation, cuboid beside transformers (and Liger).

Training: Llama-3.2-1B- and Qwen2.5-0.5B-shaped models with random weights, fp32 parameters and bf16 autocast on
both sides, the same tokens per step at each sequence length, timed step by step after warm-up steps:
- ``cuboid eager``: ``cuboid.load(preset, Plan(dtype="bf16"))`` + ``cuboid.train_step`` with cuboid's AdamW;
- ``cuboid compiled``: the same under ``compile=true`` (the plan's per-block torch.compile), "not built" when this
  build has no engine for it (no ``cuboid.parallel.compile``) or the load compiled no block;
- ``transformers``: ``AutoModelForCausalLM.from_config(attn_implementation="sdpa")``, torch's fused AdamW;
- ``transformers + Liger``: the same after liger_kernel.transformers.apply_liger_kernel_to_llama / _qwen2 (RoPE,
  RMSNorm, SwiGLU and the fused linear cross-entropy), the patches undone afterwards.
Each row: ms per step (median), tokens/s, peak memory of the whole run (weights, gradients, optimizer state and
activations: ``torch.cuda.max_memory_allocated`` after a reset; not measured on CPU) and the first step's loss.

Generation: greedy decoding of a bf16 Llama-3.2-1B-shaped model at batch 1 and 8, cuboid's key/value cache
(``model.generate``) against transformers' ``generate`` (sdpa), a fixed number of new tokens (no stop token).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import statistics
import time
import traceback
from typing import Callable, Optional

import torch

from gpu_common import fmt, free, markdown

IMPLS = ("transformers", "cuboid eager", "cuboid compiled", "transformers + Liger")  # the table's order
EAGER = ("transformers", "cuboid eager", "transformers + Liger")  # part "train"; part "compiled" runs the other
# the dry run's shapes of either preset (its positions kept: Llama 3's RoPE scaling wants more than 8192)
TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=128, vocab_size=512)
TRAIN = {
    "gpu": dict(models=("llama3.2-1b", "qwen2.5-0.5b"), seqs=(2048, 4096), tokens=8192, warmup=2, steps=3,
                overrides={}),
    "dry": dict(models=("llama3.2-1b", "qwen2.5-0.5b"), seqs=(64, 128), tokens=256, warmup=1, steps=1,
                overrides=TINY, compile_at=(("llama3.2-1b", 64),)),  # a CPU compile takes tens of seconds: one
}
GENERATE = {
    "gpu": dict(model="llama3.2-1b", batches=(1, 8), prompt=128, new=128, overrides={}),
    "dry": dict(model="llama3.2-1b", batches=(1, 8), prompt=8, new=4, overrides=TINY),
}
# seconds one item is expected to take on a GPU before any was measured (each later estimate is the slowest
# measured item of its kind): the time budget skips an item that would pass it
FIRST_GUESS_S = {"transformers": 20.0, "cuboid eager": 20.0, "cuboid compiled": 90.0, "transformers + Liger": 20.0,
                 "generate": 30.0}
LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2"}
LR = 1e-5


@dataclasses.dataclass
class ModelRow:
    part: str                  # train | generate
    model: str                 # the preset whose shape it has
    impl: str
    seq: int                   # train: tokens per row; generate: prompt tokens
    batch: int
    status: str = "ran"        # ran | skipped: why | failed: why | not built: why
    ms: Optional[float] = None  # train: median ms per step; generate: ms for the whole call
    tokens_s: Optional[float] = None  # train: tokens per second trained; generate: new tokens per second
    peak_gib: Optional[float] = None  # CUDA only
    loss: Optional[float] = None      # train: the first step's loss
    note: str = ""

    @property
    def ran(self) -> bool:
        return self.status == "ran"


def kinds_of(dry: bool) -> tuple:
    return (TRAIN["dry"], GENERATE["dry"]) if dry else (TRAIN["gpu"], GENERATE["gpu"])


# ---------------------------------------------------------------------------- models

def hf_config(preset: str, overrides: dict):
    """The transformers config of a zoo preset's shape (zoo.llama.hf.config_to_hf)."""
    import transformers as T

    from cuboid.zoo import config_of
    from cuboid.zoo.llama.hf import config_to_hf

    d = config_to_hf(config_of(preset, **overrides))
    return T.AutoConfig.for_model(d.pop("model_type"), **d)


def hf_model(preset: str, overrides: dict, dev, dtype=torch.float32):
    import transformers as T

    cfg = hf_config(preset, overrides)
    with torch.device(dev):  # initialised on the device: a 1B model's init on the host takes tens of seconds
        model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    return model


def arch_of(preset: str) -> str:
    from cuboid.zoo import config_of

    return config_of(preset).arch


def compile_engine() -> Optional[str]:
    """None when this build compiles a plan's blocks; else why not."""
    if importlib.util.find_spec("cuboid.parallel.compile") is None:
        return "not built: this build has no engine for plan compile=true (no cuboid.parallel.compile)"
    return None


def compiled_blocks(model) -> int:
    """Modules that torch.compile wraps: an OptimizedModule, one whose .compile() was called, or one whose
    forward was replaced by a compiled function."""
    return sum(1 for m in model.modules() if type(m).__name__ == "OptimizedModule"
               or getattr(m, "_compiled_call_impl", None) is not None
               or hasattr(vars(m).get("forward"), "_torchdynamo_orig_callable"))


@contextlib.contextmanager
def liger_patched(arch: str):
    """transformers' ``modeling_<arch>`` with Liger's patches for the duration (classes built inside use Liger's
    RoPE, RMSNorm, SwiGLU and fused linear cross-entropy); the module's names and its classes' attributes are
    restored afterwards, so later transformers rows run unpatched."""
    mod = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    saved = dict(vars(mod))
    classes = {name: dict(vars(obj)) for name, obj in saved.items()
               if isinstance(obj, type) and obj.__module__ == mod.__name__}
    patch = getattr(importlib.import_module("liger_kernel.transformers"), LIGER_PATCHES[arch])
    try:
        patch()
        yield
    finally:
        _restore(mod, saved)
        for name, attrs in classes.items():
            _restore(saved[name], attrs)


def _restore(obj, saved: dict) -> None:
    """Give ``obj`` back the attributes ``saved`` (``dict(vars(obj))`` taken earlier): added ones removed,
    changed ones set back."""
    for key in set(vars(obj)) - set(saved):
        delattr(obj, key)
    for key, value in saved.items():
        if vars(obj).get(key) is not value:
            setattr(obj, key, value)


def unavailable(impl: str) -> Optional[str]:
    """Why ``impl`` cannot run in this build or environment (before any time is spent on it), or None."""
    if impl == "cuboid compiled":
        return compile_engine()
    if impl == "transformers + Liger":
        return liger_missing()
    return None


def liger_missing() -> Optional[str]:
    try:
        importlib.import_module("liger_kernel.transformers")
    except Exception as e:  # noqa: BLE001 - any import failure means: skip it
        return f"skipped: liger-kernel not importable ({type(e).__name__}: {e}); pip install liger-kernel"
    return None


# ---------------------------------------------------------------------------- training

def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(dev) -> None:
    free()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(dev) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if dev.type == "cuda" else None


def timed_steps(step: Callable[[], float], warmup: int, steps: int, dev) -> tuple:
    """(median ms of the timed steps, first step's loss)."""
    times, first = [], None
    for i in range(warmup + steps):
        _sync(dev)
        t0 = time.perf_counter()
        loss = step()
        _sync(dev)
        if first is None:
            first = loss
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times), first


def cuboid_trainer(preset: str, overrides: dict, dev, compiled: bool) -> Callable[[dict], float]:
    """step(batch) -> loss of a fresh cuboid model (plan dtype bf16, ``compile`` as asked) and cuboid's AdamW."""
    import cuboid
    from cuboid.parallel import Plan
    from cuboid.parallel.optim import AdamW

    model = cuboid.load(preset, Plan(dtype="bf16", compile=compiled), device=dev, seed=0, **overrides)
    if compiled and not compiled_blocks(model):
        raise NotBuilt("not built: plan compile=true loaded, but no block of the model was compiled")
    opt = AdamW(model.parameters(), lr=LR)
    return lambda batch: cuboid.train_step(model, opt, batch).loss


def hf_trainer(preset: str, overrides: dict, dev) -> Callable[[dict], float]:
    """step(batch) -> loss of a fresh transformers model (fp32 parameters, bf16 autocast), torch's AdamW (fused on
    CUDA)."""
    model = hf_model(preset, overrides, dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=dev.type == "cuda")

    def step(batch):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


class NotBuilt(Exception):
    """A path this build does not have: reported as a row's status, not as a failure."""


def train_impl(rows: list, batches: dict, spec: dict, dev, budget, slowest: dict) -> None:
    """One implementation of one model (``rows``: one per sequence length, same model and impl): the model is
    built once (under Liger's patches for that row kind) and each length timed on it; peak memory is counted
    from a reset before each length, so it holds the weights, gradients and optimizer state too."""
    impl, preset = rows[0].impl, rows[0].model
    why = unavailable(impl)
    if why is not None:
        for row in rows:
            row.status = why
        return
    todo = []
    for row in rows:
        if impl == "cuboid compiled" and "compile_at" in spec and (preset, row.seq) not in spec["compile_at"]:
            row.status = ("skipped: the dry run compiles " + ", ".join(f"{m} at seq {q}" for m, q in spec["compile_at"])
                          + " only (a compile takes tens of seconds on a CPU)")
        elif budget.allows(f"train {preset} seq {row.seq} {impl}", slowest.get(impl, FIRST_GUESS_S[impl])):
            todo.append(row)
        else:
            row.status = budget.skipped[-1].split(": ", 1)[1]
    if not todo:
        return
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        _reset_peak(dev)
        step = attempt(todo, lambda: build(impl, preset, spec["overrides"], dev, stack), dev)
        for i, row in enumerate(todo):
            if step is None:
                break
            if i and not budget.allows(f"train {preset} seq {row.seq} {impl}", slowest.get(impl, 0.0)):
                row.status = budget.skipped[-1].split(": ", 1)[1]
                continue
            _reset_peak(dev)
            attempt([row], lambda: time_row(row, step, batches[row.seq], spec, dev), dev)
            slowest[impl] = max(slowest.get(impl, 0.0), time.perf_counter() - t0)
            print(f"  train {preset} seq {row.seq} x{row.batch} {impl}: {describe(row)}", flush=True)
            t0 = time.perf_counter()
        if step is None:
            print(f"  train {preset} {impl}: {todo[0].status}", flush=True)


def build(impl: str, preset: str, overrides: dict, dev, stack: contextlib.ExitStack) -> Callable[[dict], float]:
    if impl.startswith("cuboid"):
        return cuboid_trainer(preset, overrides, dev, compiled=impl == "cuboid compiled")
    if impl == "transformers + Liger":  # patched for the model's life: its forward looks the patches up
        stack.enter_context(liger_patched(arch_of(preset)))
    return hf_trainer(preset, overrides, dev)


def time_row(row: ModelRow, step: Callable[[dict], float], batch: dict, spec: dict, dev) -> None:
    row.ms, row.loss = timed_steps(lambda: step(batch), spec["warmup"], spec["steps"], dev)
    row.tokens_s = row.batch * row.seq / (row.ms / 1e3)
    row.peak_gib = _peak(dev)


def run_train(rows: list, budget, dry: bool, dev, impls=EAGER) -> None:
    spec = kinds_of(dry)[0]
    slowest: dict = {}  # impl -> the slowest item yet (build included), the budget's estimate of the next
    with torch_kernels() if dry else contextlib.nullcontext():
        for preset in spec["models"]:
            vocab = hf_config(preset, spec["overrides"]).vocab_size
            batches = {}
            for seq in spec["seqs"]:
                ids = torch.randint(0, vocab, (max(1, spec["tokens"] // seq), seq),
                                    generator=torch.Generator().manual_seed(seq)).to(dev)
                batches[seq] = {"input_ids": ids, "labels": ids}
            for impl in impls:
                mine = [ModelRow("train", preset, impl, seq, batches[seq]["input_ids"].shape[0])
                        for seq in spec["seqs"]]
                rows.extend(mine)
                train_impl(mine, batches, spec, dev, budget, slowest)
                free()


def attempt(rows: list, fn: Callable, dev):
    """``fn()``'s value, or None with every row of ``rows`` given the reason: a path this build lacks is
    "not built"; a peer that fails (Liger on a CPU) is "skipped" with its error; cuboid failing is "failed" (the
    run's exit code says so)."""
    impl = rows[0].impl
    try:
        return fn()
    except NotBuilt as e:
        why = str(e)
    except Exception as e:  # noqa: BLE001 - reported in the rows
        first = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if impl.startswith("cuboid"):
            traceback.print_exc()
            why = f"failed: {first}"
        elif dev.type == "cpu":
            why = f"skipped: does not run on CPU ({first})"
        else:
            why = f"failed: {first}"
    finally:
        free()
    for row in rows:
        row.status = why
    return None


def torch_kernels():
    """The dry run's cuboid kernels: the torch references a CPU run uses (the Triton interpreter the kernel parts
    run under takes seconds per tiny training step)."""
    from cuboid import kernels

    return kernels.use_backend("torch")


def describe(row: ModelRow) -> str:
    if not row.ran:
        return row.status
    if row.part == "train":
        peak = f", peak {row.peak_gib:.2f} GiB" if row.peak_gib is not None else ""
        return f"{row.ms:.1f} ms/step, {row.tokens_s:.0f} tokens/s{peak}, first loss {row.loss:.3f}"
    peak = f", peak {row.peak_gib:.2f} GiB" if row.peak_gib is not None else ""
    return f"{row.ms:.1f} ms, {row.tokens_s:.1f} new tokens/s{peak}"


# ---------------------------------------------------------------------------- generation

def generate_one(row: ModelRow, spec: dict, dev, ids: torch.Tensor) -> None:
    import cuboid

    overrides, new = spec["overrides"], spec["new"]
    mask = torch.ones_like(ids)
    _reset_peak(dev)
    if row.impl == "cuboid":
        model = cuboid.load(row.model, dtype=torch.bfloat16, device=dev, seed=0, **overrides).eval()

        def call(n):
            return model.generate(ids, mask, max_new_tokens=n)
    else:
        model = hf_model(row.model, overrides, dev, dtype=torch.bfloat16).eval()

        def call(n):
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        call(2)  # warm-up: first launches, kernel compiles, cache allocation
        _sync(dev)
        t0 = time.perf_counter()
        out = call(new)
        _sync(dev)
    row.ms = 1e3 * (time.perf_counter() - t0)
    if out.shape != (ids.shape[0], ids.shape[1] + new):
        raise RuntimeError(f"{row.impl} returned {tuple(out.shape)}, not {(ids.shape[0], ids.shape[1] + new)}")
    row.tokens_s = ids.shape[0] * new / (row.ms / 1e3)
    row.peak_gib = _peak(dev)


def run_generate(rows: list, budget, dry: bool, dev) -> None:
    spec = kinds_of(dry)[1]
    vocab = hf_config(spec["model"], spec["overrides"]).vocab_size
    measured = 0.0
    with torch_kernels() if dry else contextlib.nullcontext():
        for b in spec["batches"]:
            ids = torch.randint(1, vocab, (b, spec["prompt"]), generator=torch.Generator().manual_seed(b)).to(dev)
            for impl in ("transformers", "cuboid"):
                row = ModelRow("generate", spec["model"], impl, spec["prompt"], b, note=f"{spec['new']} new tokens")
                rows.append(row)
                if not budget.allows(f"generate batch {b} {impl}", measured or FIRST_GUESS_S["generate"]):
                    row.status = budget.skipped[-1].split(": ", 1)[1]
                    continue
                t0 = time.perf_counter()
                attempt([row], lambda: generate_one(row, spec, dev, ids), dev)
                measured = max(measured, time.perf_counter() - t0)
                print(f"  generate {spec['model']} batch {b} prompt {spec['prompt']} {impl}: {describe(row)}",
                      flush=True)


# ---------------------------------------------------------------------------- the plan and the table

def plan_lines(dry: bool) -> list:
    """What the training, generation and main-command parts compare at the GPU sizes (``dry``: and how the
    dry run differs), with whether the compiled path and Liger can run here."""
    train, gen = TRAIN["gpu"], GENERATE["gpu"]
    compiled = compile_engine() or "runs"
    liger = liger_missing() or ("importable; on CPU its kernels fail (skipped)" if dry else "runs")
    shapes = ", ".join(f"seq {s} x {max(1, train['tokens'] // s)}" for s in train["seqs"])
    lines = [f"train {' and '.join(train['models'])} (random weights, fp32 params, bf16 autocast, AdamW), {shapes}: "
             f"{train['warmup']} warm-up + {train['steps']} timed steps each of transformers (sdpa), cuboid eager, "
             f"cuboid compiled [{compiled}], transformers + Liger [{liger}]: ms/step, tokens/s, peak GiB",
             f"generate {gen['model']} bf16, prompt {gen['prompt']}, {gen['new']} new tokens, batch "
             + " and ".join(map(str, gen["batches"])) + ": cuboid generate vs transformers generate (sdpa)",
             "main command: cuboid finetune (the README's), first GPU only: its plan line, seconds, final metrics"]
    if dry:
        t, g = TRAIN["dry"], GENERATE["dry"]
        lines.append(f"dry run: the same at tiny shapes ({', '.join(f'{k}={v}' for k, v in TINY.items())}), seq "
                     + "/".join(map(str, t["seqs"])) + f", {t['warmup']} + {t['steps']} steps, generation "
                     f"{g['new']} new tokens; cuboid's torch kernels; the main command for 2 steps on the CPU")
    return lines


def versus(rows: list, row: ModelRow, peer: str) -> Optional[float]:
    """row's tokens/s over ``peer``'s at the same model, length and batch (> 1: row faster)."""
    for r in rows:
        if (r.part, r.model, r.seq, r.batch, r.impl) == (row.part, row.model, row.seq, row.batch, peer):
            if r.ran and row.ran:
                return row.tokens_s / r.tokens_s
    return None


def memory_vs(rows: list, row: ModelRow, peer: str) -> Optional[float]:
    for r in rows:
        if (r.part, r.model, r.seq, r.batch, r.impl) == (row.part, row.model, row.seq, row.batch, peer):
            if r.ran and row.ran and r.peak_gib and row.peak_gib is not None:
                return row.peak_gib / r.peak_gib
    return None


def table_order(rows: list) -> list:
    """Training rows by model, length and IMPLS (the parts run them in another order), then generation's."""
    models = list(dict.fromkeys(r.model for r in rows))
    return sorted(rows, key=lambda r: (r.part != "train", models.index(r.model), r.seq, r.batch,
                                       IMPLS.index(r.impl) if r.impl in IMPLS else 0))


def print_models(rows: list, dry: bool) -> None:
    train = [r for r in rows if r.part == "train"]
    gen = [r for r in rows if r.part == "generate"]
    if train:
        print("\ntraining steps (fp32 parameters, bf16 autocast, AdamW; random weights):\n")
        if dry:
            print("**DRY RUN: CPU, tiny shapes, a step or two, cuboid's torch kernels: the figures only prove the "
                  "paths run; peak memory is measured on CUDA only.**\n")
        markdown("model | seq x batch | implementation | ms/step: | tokens/s: | peak GiB: | vs transformers: | "
                 "vs transformers + Liger: | memory vs Liger: | first loss: | status",
                 ([r.model, f"{r.seq} x {r.batch}", r.impl, fmt(r.ms), fmt(r.tokens_s, 0), fmt(r.peak_gib, 2),
                   fmt(versus(rows, r, "transformers"), 2), fmt(versus(rows, r, "transformers + Liger"), 2),
                   fmt(memory_vs(rows, r, "transformers + Liger"), 2), fmt(r.loss, 3), r.status] for r in train))
    if gen:
        print("\ngeneration (greedy, bf16 weights, random; new tokens per second):\n")
        markdown("model | prompt x batch | implementation | ms: | new tokens/s: | peak GiB: | vs transformers: | "
                 "status",
                 ([r.model, f"{r.seq} x {r.batch} ({r.note})", r.impl, fmt(r.ms), fmt(r.tokens_s), fmt(r.peak_gib, 2),
                   fmt(versus(rows, r, "transformers"), 2), r.status] for r in gen))


def model_goals(rows: list) -> list:
    """The issue's bar per training shape: cuboid (eager or compiled, the faster) at least as fast as
    transformers + Liger at no more peak memory."""
    out = []
    shapes = dict.fromkeys((r.model, r.seq, r.batch) for r in rows if r.part == "train")
    for model, seq, batch in shapes:
        same = {r.impl: r for r in rows if r.part == "train" and (r.model, r.seq, r.batch) == (model, seq, batch)}
        liger = same.get("transformers + Liger")
        ours = [same[k] for k in ("cuboid eager", "cuboid compiled") if k in same and same[k].ran]
        goal = f"train {model} seq {seq} x {batch}: cuboid >= transformers + Liger in tokens/s at <= its peak memory"
        if not ours:
            why = "cuboid did not run"
        elif liger is None or not liger.ran:
            why = f"transformers + Liger: {liger.status if liger else 'not run'}"
        elif liger.peak_gib is None or any(r.peak_gib is None for r in ours):
            why = "no peak memory: measured on CUDA only"
        else:
            why = None
        if why is not None:
            out.append(dict(goal=goal, met=None, note=f"not measured ({why})"))
            continue
        best = max(ours, key=lambda r: r.tokens_s)
        met = any(r.tokens_s >= liger.tokens_s and r.peak_gib <= liger.peak_gib for r in ours)
        out.append(dict(goal=goal, met=met, note=f"{best.impl}: {best.tokens_s / liger.tokens_s:.2f}x the tokens/s, "
                                                  f"{best.peak_gib:.2f} vs {liger.peak_gib:.2f} GiB"))
    return out
