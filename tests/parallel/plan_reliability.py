"""The reliability checks a run of the generated plan tests also takes (test_plans.plan_parity_worker): an
evaluation with a dp rank a batch short and a checkpoint saved and read back on one device
(tests/parallel/reliability_checks.py), on every mixture of experts' plan and a rotation of the dense ones."""
import contextlib

import torch

from .plan_families import MOE_FAMILIES, global_batch

# every how many plan indices a run also checks reliability (MoE, others) per world size: a check is an
# evaluation of one row a rank (a batch short: 2 forwards; no row: 1, turned by the index), a save and a load
# on one device (rank 0); one device evaluates the rows whole once per reference (whole_rows). The others'
# turn keeps the dense worlds' time (their runs are many)
RELIABILITY_EVERY = {2: (1, 4), 4: (1, 4), 8: (1, 12)}


def checks_reliability(index: int, name: str, world: int) -> bool:
    """Whether the run also evaluates with a dp rank a batch short and saves a checkpoint read back on one device
    (reliability_checks): every mixture of experts' run; every 4th (12th on 8 ranks) of the others, turned by
    the plan's index (RELIABILITY_EVERY)."""
    moe, other = RELIABILITY_EVERY.get(world, (4, 4))
    return index % (moe if name in MOE_FAMILIES else other) == 0


@contextlib.contextmanager
def _lm_loss_only(model):
    """A mixture of experts' load-balancing loss left out of its loss while inside (no-op for the others): the
    loss is a statistic of each batch's routing, so it changes with how the rows are dealt; the router still
    routes every row."""
    from cuboid.parallel import unwrap

    config = unwrap(model).config
    routed = getattr(config, "output_router_logits", False)
    object.__setattr__(config, "output_router_logits", False)
    try:
        yield routed
    finally:
        object.__setattr__(config, "output_router_logits", routed)


def _eval_rows(name, model, dp: int) -> dict:
    """The rows the uneven evaluation deals. A classifier without a pad id reads each row's last position (HF's
    rule), which cutting a batch's padded columns (``eval_batches``, as training's batches are cut) moves: its
    rows are given no padding, so one row a batch and all rows in one read the same tokens."""
    from cuboid.parallel import unwrap

    rows = global_batch(name, model, max(5, dp + 1))
    config = unwrap(model).config
    if getattr(config, "head", None) == "cls" and getattr(config, "pad_token_id", 0) is None and \
            "attention_mask" in rows:
        rows = dict(rows, attention_mask=torch.ones_like(rows["attention_mask"]))
    return rows


def whole_rows(ref, name: str, dp: int) -> dict:
    """One device's ``reliability_checks.whole_evals`` of the rows a plan of ``dp`` ranks checks (the model's loss
    only), by the reference ``ref`` after its steps: the uneven evaluation's expected values."""
    from .reliability_checks import whole_evals

    with _lm_loss_only(ref):
        return whole_evals(ref, _eval_rows(name, ref, dp), dp)


def reliability(model, name: str, index: int, mesh, want: dict, pairs: list, extra: dict) -> dict:
    """reliability_checks' two checks of ``model`` (every rank; the folder the same on all: the parent's pid):
    the uneven evaluation (one of its two row counts, turned by the index) against one device's
    (``want["whole"]``: the reference's, whose parameters the plan's match to 1e-6), the checkpoint read back
    against ``pairs`` (:func:`gathered` already). ``extra``: the run's config overrides; a LoRA run's
    (``lora`` in it: its adapters are its save) reads back onto its base, ``cuboid.load(name, lora=folder,
    seed=0, **extra)`` without extra's own ``lora``, ``quantize="nf4"`` kept."""
    import os

    from .reliability_checks import eval_counts, save_and_reload_check, save_folder, uneven_eval_check

    # one dp rank a batch short (dp + 1 rows, one a batch) on even indices, a rank with no row (dp - 1) on odd
    counts = eval_counts(mesh.size("dp"))
    counts = counts[index % len(counts):][:1]
    # a pipeline's stream and sp's split fix a mixture of experts' routing when they are built: there the eval
    # must run on every rank and give a finite loss, and its value (moved by the aux loss) is kept apart, unchecked
    with _lm_loss_only(model) as routed:
        errs = uneven_eval_check(model, _eval_rows(name, model, mesh.size("dp")), whole=want["whole"],
                                 counts=counts)
    if routed and (mesh.size("pp") > 1 or mesh.size("sp") > 1):
        errs = {"uneven_eval": errs["uneven_eval"] * 0.0, "uneven_eval_with_aux": errs["uneven_eval"]}
    folder = save_folder(f"cuboid-plan-save-{os.getppid()}-{mesh.world_size}-{index}-{name}")
    base = (name, {**{k: v for k, v in extra.items() if k != "lora"}, "seed": 0}) if "lora" in extra else None
    errs.update(save_and_reload_check(model, folder, whole=pairs, base=base))
    return errs
