"""A mixture of experts' aux loss under pipeline and sequence parallelism, in one 2-rank world.

qwen3-moe-debug (4 layers, the first dense) with ``output_router_logits=True`` and a large
``router_aux_loss_coef`` (so that the aux loss moves every router visibly): one ``train_step`` under
pp=2 (gpipe, 1f1b, interleaved, zbv) and sp=2 (ring, all_to_all) gives one device's loss (1e-6) and, with
SGD at lr 1, one device's gradients (1e-6 of the update's norm over this rank's parameters, 1e-4 of each
parameter's: a norm's few weights sum many tokens' rounding), one device running the plan's
micro-batches being the reference. Each router's update differs from the step without the aux loss by far
more than that, so the aux gradients reached every stage's routers. A second step on a batch so small that
some experts get no token (checked on one device) holds the same. Under sp a forward's ``aux_loss`` and
``router_logits`` (gathered when read) are one device's; under pp an evaluation forward's loss (aux loss
included) is one device's forward's and router outputs are refused in one sentence; a dense model's and a
non-routed model's pipeline stream stay the 4 tensors of a dense one.
"""
import torch

from .launch import run_world

NAME = "qwen3-moe-debug"
OVER = dict(n_layers=4, output_router_logits=True, router_aux_loss_coef=0.5)
PLANS = ("pp=2,microbatches=2,schedule=1f1b", "pp=2,microbatches=2,schedule=interleaved",
         "pp=2,microbatches=2,schedule=gpipe", "pp=2,microbatches=2,schedule=zbv", "sp=2", "sp=2,sp_mode=all_to_all")


def _batch(vocab: int, rows: int, tokens: int, seed: int) -> dict:
    """Random ids with right padding on two rows (the padding counts in no statistic) and labels on the rest."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.ones_like(ids)
    mask[1, tokens - 2:] = 0
    mask[-1, tokens - 1:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _one_device(microbatches: int, batch: dict, **over) -> tuple:
    """One device's step: (loss, parameters before, parameters after) with SGD at lr 1."""
    import cuboid

    model = cuboid.load(NAME, None, seed=0, **{**OVER, **over}).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = cuboid.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, microbatches=microbatches)
    return res.loss, before, {n: p.detach().clone() for n, p in model.named_parameters()}


def _empty_experts(batch: dict, microbatches: int) -> int:
    """How many (micro-batch, sparse layer, expert) triples get no token of ``batch`` on one device."""
    import cuboid
    from cuboid.parallel import split_batch

    model = cuboid.load(NAME, None, seed=0, **OVER)
    empty = 0
    with torch.no_grad():
        for mb in split_batch(batch, microbatches):
            keep = mb["attention_mask"].reshape(-1).bool()
            for logits in model(**mb).router_logits:
                chosen = logits[keep].topk(model.config.experts_per_token, -1).indices.reshape(-1)
                empty += int((torch.bincount(chosen, minlength=model.config.n_experts) == 0).sum())
    return empty


def _plan_step(plan_text: str, batch: dict) -> dict:
    """The plan's step against one device's: loss, and per parameter the update's error relative to one
    device's update, and (routers) the aux loss's share of the update relative to that error."""
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import READY_PLANS

    plan = Plan.parse(plan_text, READY_PLANS)
    model = cuboid.load(NAME, plan, seed=0, mesh=Mesh.build(plan), **OVER).train()
    res = cuboid.train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch)
    want, before, after = _one_device(plan.microbatches, batch)
    _, _, plain = _one_device(plan.microbatches, batch, router_aux_loss_coef=0.0)
    update, aux_share, errs, steps = {}, {}, [], []
    for name, p in model.named_parameters():
        step = after[name] - before[name]
        update[name] = float((p.detach() - after[name]).norm() / step.norm())
        errs.append((p.detach() - after[name]).flatten())
        steps.append(step.flatten())
        if name.endswith("router.weight"):
            aux_share[name] = float((after[name] - plain[name]).norm() / step.norm())
    grad = float(torch.cat(errs).norm() / torch.cat(steps).norm())
    return {"loss": (res.loss, want), "grad": grad, "update": update, "aux_share": aux_share,
            "stream": model.parallel.pipeline.stream_size if plan.pp > 1 else None}


def _sp_forward(plan_text: str, batch: dict) -> dict:
    """A forward under sp against one device's: loss, aux_loss and every layer's router logits."""
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import READY_PLANS

    plan = Plan.parse(plan_text, READY_PLANS)
    model = cuboid.load(NAME, plan, seed=0, mesh=Mesh.build(plan), **OVER)
    ref = cuboid.load(NAME, None, seed=0, **OVER)
    with torch.no_grad():
        got, want = model(**batch), ref(**batch)
        unread = repr(got.router_logits)
        logits = [float((a - b).abs().max()) for a, b in zip(got.router_logits, want.router_logits)]
    return {"loss": (float(got.loss), float(want.loss)), "aux": (float(got.aux_loss), float(want.aux_loss)),
            "layers": (len(got.router_logits), len(want.router_logits)), "logits": logits, "unread": unread}


def _pp_forward(plan_text: str, batch: dict) -> dict:
    """An evaluation forward under pp (the stream carries the statistics through forward_only, the aux loss is
    the whole batch's) against one device's forward, and the refusal to give router outputs."""
    import cuboid
    from cuboid.parallel import Mesh, Plan
    from cuboid.zoo import READY_PLANS

    plan = Plan.parse(plan_text, READY_PLANS)
    model = cuboid.load(NAME, plan, seed=0, mesh=Mesh.build(plan), **OVER)
    ref = cuboid.load(NAME, None, seed=0, **OVER)
    with torch.no_grad():
        got, want = model(**batch), float(ref(**batch).loss)
    try:
        refused = repr(got.router_logits)
    except AttributeError as e:
        refused = str(e)
    return {"loss": (float(got.loss), want), "refused": refused}


def _streams() -> dict:
    """The pipeline stream's tensor count of a dense model, a non-routed MoE and a routed MoE (pp=2)."""
    import cuboid
    from cuboid.parallel import Mesh, Plan

    plan = Plan(pp=2, microbatches=2)
    sizes = {}
    for key, name, over in (("dense", "qwen3-debug", {}), ("unrouted", NAME, {**OVER, "output_router_logits": False}),
                            ("routed", NAME, OVER)):
        sizes[key] = cuboid.load(name, plan, seed=0, mesh=Mesh.build(plan), **over).parallel.pipeline.stream_size
    return sizes


def moe_split_worker():
    out = {"streams": _streams()}
    batch = _batch(512, rows=4, tokens=11, seed=3)
    tiny = _batch(512, rows=2, tokens=5, seed=5)  # a row of 5 (or 3) tokens per micro-batch
    out["empty"] = _empty_experts(tiny, 2)
    for plan in PLANS:
        out[plan] = _plan_step(plan, batch)
        out[plan + " tiny"] = _plan_step(plan, tiny)
    for plan in ("sp=2", "sp=2,sp_mode=all_to_all"):
        out[plan + " forward"] = _sp_forward(plan, batch)
    for plan in PLANS[:2]:
        out[plan + " forward"] = _pp_forward(plan, batch)
    return out


def test_moe_aux_loss_under_pp_and_sp_on_2_ranks():
    for rank, out in enumerate(run_world(moe_split_worker, 2, timeout=600)):
        assert out["streams"] == {"dense": 4, "unrouted": 4, "routed": 6}, (rank, out["streams"])
        assert out["empty"] > 0, "the tiny batch should leave some experts without a token"
        for plan in PLANS:
            for key in (plan, plan + " tiny"):
                r = out[key]
                got, want = r["loss"]
                assert abs(got - want) <= 1e-6 * abs(want), (rank, key, got, want)
                assert r["grad"] <= 1e-6, (rank, key, r["grad"])  # every gradient of this rank, one norm
                for name, err in r["update"].items():  # (a norm's few weights sum many tokens: rounding)
                    assert err <= 1e-4, (rank, key, name, err)
                # every router this rank holds (pp: its stage's; sparse layers 1-3) moved by the aux loss
                assert r["aux_share"], (rank, key)
                for name, share in r["aux_share"].items():
                    assert share > 1e3 * max(r["update"][name], 1e-9), (rank, key, name, share, r["update"][name])
        for plan in ("sp=2", "sp=2,sp_mode=all_to_all"):
            r = out[plan + " forward"]
            assert "deferred" in r["unread"], (rank, plan, r["unread"])
            for key in ("loss", "aux"):
                got, want = r[key]
                assert abs(got - want) <= 1e-6 * abs(want), (rank, plan, key, got, want)
            assert r["layers"][0] == r["layers"][1] == 3, (rank, plan, r["layers"])
            assert max(r["logits"]) < 1e-5, (rank, plan, r["logits"])
        for plan in PLANS[:2]:
            r = out[plan + " forward"]
            got, want = r["loss"]
            assert abs(got - want) <= 1e-6 * abs(want), (rank, plan, got, want)
            assert "does not return router_logits" in r["refused"], (rank, plan, r["refused"])
