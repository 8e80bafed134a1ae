"""Per-plan checks that nothing hangs and nothing is lost (issue 49), for the plan worlds to call on every rank.

Each function is a collective of the whole world: call it on every rank, with the same arguments, after
``cuboid.load(..., plan)``. Each returns ``{name: error}`` (relative errors, 0.0 when exact) in the form of
the plan parity reports, and raises nothing on one rank alone (a rank that raised would leave its peers in
a collective): a hang shows as the world's timeout, a wrong result as an error past the caller's tolerance.

- :func:`uneven_eval_check`: ``cuboid.evaluate`` over the rows dealt by
  :func:`cuboid.data.formats.eval_batches` so that one dp rank is a batch short (dp + 1 rows, one a batch),
  and so that a rank has no row at all (dp - 1 rows, dp > 1), against the evaluation of all the rows on
  every rank (the same forwards everywhere, so it cannot hang). ``uneven_eval`` is the worse relative
  error of ``eval_loss`` (expected: float rounding, under 1e-5).
- :func:`save_and_reload_check`: ``cuboid.zoo.checkpoint.save`` under the plan (every rank), then the
  folder loaded on one device by rank 0 and compared with the parameters gathered whole (every rank gathers).
  ``save_reload`` is the relative error over them on rank 0 (expected: 0.0, the bytes are the parameters'),
  0.0 on the others.
"""
from __future__ import annotations

import shutil


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30) if a == a else float("inf")


def uneven_eval_check(model, rows: dict, task=None) -> dict:
    """``{"uneven_eval": error}``: see the module docstring. ``rows``: a batch in the single-device format of
    at least dp + 1 rows, the same on every rank (the rows of ``model(**rows)``); ``task``: a
    :class:`cuboid.tasks.Task` (default: the model's)."""
    from cuboid.data.formats import eval_batches
    from cuboid.parallel import state_of, unwrap
    from cuboid.train.step import evaluate

    mesh = state_of(unwrap(model)).mesh
    dp, rank = mesh.size("dp"), mesh.coords.get("dp", 0)
    n = len(next(iter(rows.values())))
    if n < dp + 1:
        raise ValueError(f"uneven_eval_check needs at least dp + 1 = {dp + 1} rows, got {n}")
    err = 0.0
    for count in sorted({dp + 1, max(dp - 1, 1)}):
        part = {k: v[:count] for k, v in rows.items()}
        whole = evaluate(model, eval_batches(part, count), mesh, task=task)  # every rank: all rows, one forward
        uneven = evaluate(model, eval_batches(part, 1, rank, dp), mesh, task=task)
        err = max(err, _rel(uneven["eval_loss"], whole["eval_loss"]))
    return {"uneven_eval": err}


def save_and_reload_check(model, path, *, keep: bool = False) -> dict:
    """``{"save_reload": error}``: see the module docstring. ``path``: one folder, the same on every rank (it
    is replaced; removed afterwards unless ``keep``)."""
    import torch.distributed as dist

    import cuboid
    from cuboid import zoo
    from cuboid.zoo import checkpoint

    mine = [(full, mod.full_tensor(local).detach().cpu()) for full, mod, local, _ in
            zoo.common.sharded_parameters(model)]
    checkpoint.save(model, path)
    # one device, no process group, on rank 0 (every rank gathered the same whole parameters and reads the same
    # folder: the other ranks' loads would repeat it world-size times on shared cores)
    reader = not dist.is_initialized() or dist.get_rank() == 0
    one = dict(cuboid.load(str(path)).named_parameters()) if reader else {}
    err = 0.0
    for name, t in mine if reader else ():
        ref = one.get(name)
        if ref is None or ref.shape != t.shape:
            err = float("inf")
            continue
        diff = (t.double() - ref.detach().double()).norm() / ref.detach().double().norm().clamp(min=1e-30)
        err = max(err, float(diff))
    if dist.is_initialized():
        dist.barrier()
    if not keep and (not dist.is_initialized() or dist.get_rank() == 0):
        shutil.rmtree(path, ignore_errors=True)
    return {"save_reload": err if mine else float("inf")}

