"""Per-plan checks that nothing hangs and nothing is lost (issue 49), for the plan worlds to call on every rank.

Each check is a collective of the whole world: call it on every rank, with the same arguments, after
``cuboid.load(..., plan)``. Each returns ``{name: error}`` (relative errors, 0.0 when exact) in the form of
the plan parity reports, and raises nothing on one rank alone (a rank that raised would leave its peers in
a collective): a hang shows as the world's timeout, a wrong result as an error past the caller's tolerance.

- :func:`uneven_eval_check`: ``cuboid.evaluate`` over the rows dealt by
  :func:`cuboid.data.formats.eval_batches` one row a batch, so that one dp rank is a batch short (dp + 1
  rows) and so that a rank has no row at all (dp - 1 rows, dp > 1; with dp = 1, two rows in two batches and
  one in one), against the evaluation of all the rows in one batch (:func:`whole_evals`): one device's, given
  (``whole``), or the model's own on every rank (the same forwards everywhere, so it cannot hang); the caller
  may deal one of the two counts (``counts``). ``uneven_eval`` is the worse relative error of ``eval_loss``
  (float rounding, and one device's parameters against the plan's when ``whole`` is one device's: under 1e-5).
- :func:`save_and_reload_check`: ``cuboid.zoo.checkpoint.save`` under the plan (every rank), then the
  folder loaded on one device by rank 0 and compared with the parameters gathered whole (given, or gathered
  here: every rank gathers). The folder loads as a user's one-device program would: ``cuboid.load(folder)``;
  a LoRA model's save is its adapters alone (a peft folder naming no base), so it loads onto its base,
  ``cuboid.load(base, lora=folder, **options)`` (the caller's ``base``: the preset and the run's overrides,
  ``quantize="nf4"`` included, and seed), and the parameters compared are the adapters and the frozen
  weights that are parameters (the seed's; a 4-bit base's NF4 weights are buffers). ``save_reload`` is the
  relative error over them on rank 0 (expected: 0.0, the bytes are the parameters'), 0.0 on the others;
  under pp, where rank 0 holds its own stages only, the other stages' parameters are compared by a digest
  of their values sent to rank 0 (``inf`` where one differs).

What they cost is their forwards and the save's gathers (each rank of a world shares the machine's cores):
:func:`whole_evals` runs on one device once per reference (the plan worlds keep it with one device's run),
so a plan's check runs one or two forwards of one row a rank per count dealt, and a save whose parameters
the caller gathered already gathers only inside the save. The folder lives where a write is cheapest
(memory, ``/dev/shm``, when the machine has it: a save fsyncs each file).
"""
from __future__ import annotations

import os
import shutil
import tempfile


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30) if a == a else float("inf")


def eval_counts(dp: int) -> list:
    """The row counts the uneven evaluation deals over ``dp`` ranks, one row a batch: dp + 1 (a rank a batch
    short) and dp - 1 (a rank with no row) when dp > 1; two rows in two batches and one in one when dp = 1."""
    return [dp + 1, dp - 1] if dp > 1 else [2, 1]


def whole_evals(model, rows: dict, dp: int, task=None, mesh=None) -> dict:
    """``{count: eval_loss}``: ``cuboid.evaluate`` of the first ``count`` rows of ``rows`` in one batch, for each
    of :func:`eval_counts` (``mesh`` None: one device's model; else every rank of the plan runs them all)."""
    from cuboid.data.formats import eval_batches
    from cuboid.train.step import evaluate

    out = {}
    for count in eval_counts(dp):
        part = {k: v[:count] for k, v in rows.items()}
        out[count] = evaluate(model, eval_batches(part, count), mesh, task=task)["eval_loss"]
    return out


def uneven_eval_check(model, rows: dict, task=None, whole: dict = None, counts=None) -> dict:
    """``{"uneven_eval": error}``: see the module docstring. ``rows``: a batch in the single-device format of
    at least dp + 1 rows, the same on every rank (the rows of ``model(**rows)``); ``task``: a
    :class:`cuboid.tasks.Task` (default: the model's); ``whole``: :func:`whole_evals` of the same rows by one
    device's model of the same parameters (None: the model's own, on every rank); ``counts``: the row counts
    to deal, some of :func:`eval_counts` (default: all)."""
    from cuboid.data.formats import eval_batches
    from cuboid.parallel import state_of, unwrap
    from cuboid.train.step import evaluate

    mesh = state_of(unwrap(model)).mesh
    dp, rank = mesh.size("dp"), mesh.coords.get("dp", 0)
    n = len(next(iter(rows.values())))
    if n < dp + 1:
        raise ValueError(f"uneven_eval_check needs at least dp + 1 = {dp + 1} rows, got {n}")
    counts = eval_counts(dp) if counts is None else counts
    if not set(counts) <= set(eval_counts(dp)):
        raise ValueError(f"uneven_eval_check deals {eval_counts(dp)} rows over dp = {dp}, not {counts}")
    if whole is None:
        whole = whole_evals(model, rows, dp, task, mesh)
    err = 0.0
    for count in counts:
        part = {k: v[:count] for k, v in rows.items()}
        uneven = evaluate(model, eval_batches(part, 1, rank, dp), mesh, task=task)
        err = max(err, _rel(uneven["eval_loss"], whole[count]))
    return {"uneven_eval": err}


def save_folder(name: str) -> str:
    """A folder ``name`` where a checkpoint is cheapest to write and read: memory when the machine has it."""
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), name)


def _digest(t) -> str:
    """SHA-256 of a tensor's values (as float64, so a dtype the reader casts to compares equal) and shape."""
    import hashlib

    t = t.detach().cpu().double().contiguous()
    return hashlib.sha256(str(tuple(t.shape)).encode() + t.view(-1).numpy().tobytes()).hexdigest()


def save_and_reload_check(model, path, *, keep: bool = False, whole: list = None, base: tuple = None) -> dict:
    """``{"save_reload": error}``: see the module docstring. ``path``: one folder, the same on every rank (it
    is replaced; removed afterwards unless ``keep``). ``whole``: (full name, full tensor) of every parameter
    (``zoo.common.sharded_parameters``' order, ``full_tensor``), already gathered by the caller; None: gathered
    here (every rank). ``base``: for a LoRA model (required; None otherwise), ``(name, options)``: the folder
    is read back as ``cuboid.load(name, lora=folder, **options)`` (options: what the model was loaded with
    but its plan, mesh and ``lora``: its config overrides, ``quantize`` and ``seed``)."""
    import torch.distributed as dist

    import cuboid
    from cuboid import zoo
    from cuboid.parallel import state_of, unwrap
    from cuboid.zoo import checkpoint
    from cuboid.zoo.checkpoint.adapters import has_adapters

    if has_adapters(model) != (base is not None):  # every rank, before any collective
        raise ValueError("save_and_reload_check: a LoRA model's adapters load onto their base: pass base=(name, "
                         "options), and only for a LoRA model")
    if whole is None:
        whole = [(full, mod.full_tensor(local)) for full, mod, local, _ in zoo.common.sharded_parameters(model)]
    checkpoint.save(model, path)
    # one device, no process group, on rank 0 (every rank holds the same whole parameters and would read the
    # same folder: the other ranks' loads would repeat it world-size times on shared cores)
    reader = not dist.is_initialized() or dist.get_rank() == 0
    theirs = {}  # under pp, the other stages' parameters (rank 0 holds its own stages'): their digests
    if dist.is_initialized() and state_of(unwrap(model)).mesh.size("pp") > 1:
        stages = [None] * dist.get_world_size() if reader else None
        dist.gather_object({n: _digest(t) for n, t in whole}, stages, dst=0)
        theirs = {n: d for part in stages for n, d in part.items()} if reader else {}
    if not reader:
        one = {}
    elif base is None:
        one = dict(cuboid.load(str(path)).named_parameters())
    else:
        one = dict(cuboid.load(base[0], lora=str(path), **base[1]).named_parameters())
    err = 0.0
    for name, t in whole if reader else ():
        ref = one.get(name)
        if ref is None or ref.shape != t.shape:
            err = float("inf")
            continue
        t, ref = t.detach().cpu().double(), ref.detach().double()
        err = max(err, float((t - ref).norm() / ref.norm().clamp(min=1e-30)))
    mine = {n for n, _ in whole}
    for name, digest in theirs.items() if reader else ():
        if name not in mine and (name not in one or _digest(one[name]) != digest):
            err = float("inf")  # another stage's parameter read back other than it was saved
    if not keep and reader:
        shutil.rmtree(path, ignore_errors=True)
    return {"save_reload": err if whole else float("inf")}
