"""``adapters_off(model)``: a LoRA model computes its base model's outputs within the block (the reference policy
of DPO and GRPO), through the public path: ``cuboid.load(name, plan, lora=...)`` and ``model(**batch)``.

The adapters are made to matter first (B drawn nonzero on one device and saved in peft's layout, then loaded
with ``lora=folder`` under each plan), so "the base's logits" and "the adapters' logits" differ by far more than
any tolerance. On one device (dense linears and a mixture of experts' per-expert adapters, eager and with
compiled blocks) the logits inside equal those of the model loaded without LoRA bit for bit, and those after
the block (nested, or left by an exception) equal the adapters' bit for bit. A 2-rank world runs tp1d, dp=2
and pp=2 on Llama, and ZeRO-3 with the experts under dp=2 x ep=2 on Qwen3-MoE: inside, the plan's base
model's logits exactly (and one device's base within 1e-5), outside the adapters' (one device's within 1e-5);
then a ``cuboid.train_step`` after the block takes one device's step (loss 1e-5), and the base is still what
``adapters_off`` gives.
"""
from __future__ import annotations

import pytest
import torch

from ..checkpoint.test_lora_moe import with_random_b
from .launch import run_world
from .test_data_parallel import global_batch
from .test_plans import rel_max

LORA = dict(r=4, alpha=8, targets=("attn", "mlp"))
FAMILIES = {"llama-debug": LORA, "qwen3-moe-debug": dict(LORA, targets=("attn", "experts"))}
PLANS = {"llama-debug": ["tp=2", "dp=2", "pp=2,microbatches=2"], "qwen3-moe-debug": ["dp=2,ep=2,zero=3"]}
TOL = 1e-5  # a plan's logits against one device's (reduction order)


def _opt(model):
    from cuboid.parallel.optim import AdamW

    return AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _references(root) -> dict:
    """name -> one device's base logits, the adapters' folder and logits, and the loss of one step after."""
    import cuboid
    from cuboid.zoo.lora import save_adapters

    refs = {}
    for name, lora in FAMILIES.items():
        base = cuboid.load(name, seed=0)
        model = with_random_b(cuboid.load(name, seed=0, lora=lora))
        folder = save_adapters(model, f"{root}/{name}")
        batch = global_batch(name, model)
        refs[name] = {"folder": str(folder), "base": _logits(base, batch), "on": _logits(model, batch),
                      "loss": cuboid.train_step(model, _opt(model), batch).loss}
    return refs


def _plan_checks(name: str, spec: str, ref: dict) -> dict:
    """One plan: the logits inside, outside and after one step, against the plan's base and one device."""
    import cuboid
    from cuboid.parallel import Mesh, Plan, adapters_off

    plan = Plan.parse(spec)
    mesh = Mesh.build(plan)
    base = cuboid.load(name, plan, seed=0, mesh=mesh)
    model = cuboid.load(name, plan, seed=0, mesh=mesh, lora=ref["folder"])
    batch = global_batch(name, model)
    share = cuboid.rank_share(model, batch)
    n = batch["input_ids"].shape[0] // mesh.size("dp")
    rows = slice(mesh.coords["dp"] * n, (mesh.coords["dp"] + 1) * n)
    want_base = _logits(base, share)
    on = _logits(model, share)
    with adapters_off(model):
        off = _logits(model, share)
        grad_free = plan.pp > 1 or not model(**share).logits.requires_grad  # pp's forward runs without grad
    try:
        with adapters_off(model):
            raise KeyError("inside")
    except KeyError:
        pass
    again = _logits(model, share)
    loss = cuboid.train_step(model, _opt(model), batch).loss
    with adapters_off(model):
        off_after = _logits(model, share)
    refused = False
    try:
        with adapters_off(base):
            pass
    except ValueError:
        refused = True
    return {"off_plan_base": torch.equal(off, want_base), "off_one_device": rel_max(off, ref["base"][rows]),
            "on_one_device": rel_max(on, ref["on"][rows]), "on_vs_base": rel_max(on, ref["base"][rows]),
            "back": torch.equal(again, on), "grad_free": grad_free, "loss": abs(loss - ref["loss"]) / abs(ref["loss"]),
            "off_after_step": torch.equal(off_after, want_base), "refused": refused}


def adapters_off_worker(refs: dict) -> dict:
    return {f"{spec}/{name}": _plan_checks(name, spec, refs[name]) for name in FAMILIES for spec in PLANS[name]}


def test_adapters_off_under_plans_2_ranks(tmp_path):
    from cuboid.kernels import use_backend

    with use_backend("torch"):  # the CPU path the ranks run
        refs = _references(tmp_path)
    reports = run_world(adapters_off_worker, 2, refs, timeout=300)
    for rank, report in enumerate(reports):
        assert len(report) == sum(len(p) for p in PLANS.values())
        for key, r in report.items():
            assert r["on_vs_base"] > 1e-2, (rank, key, "the adapters do not change the logits")
            assert r["off_plan_base"], (rank, key, "inside: not the plan's base logits")
            assert r["off_one_device"] < TOL and r["on_one_device"] < TOL, (rank, key, r)
            assert r["back"], (rank, key, "after the block (left by an exception): not the adapters' logits")
            assert r["grad_free"], (rank, key, "a forward inside asks for gradients")
            assert r["loss"] < TOL, (rank, key, "the step after the block is not one device's", r["loss"])
            assert r["off_after_step"], (rank, key, "after a step, inside: not the base's logits")
            assert r["refused"], (rank, key, "a model without adapters was not refused")


# ---------------------------------------------------------------- one device


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_device_base_nesting_and_exceptions(name):
    import cuboid
    from cuboid.kernels import use_backend
    from cuboid.zoo import adapters_off

    with use_backend("torch"):
        base = cuboid.load(name, seed=0)
        model = with_random_b(cuboid.load(name, seed=0, lora=FAMILIES[name]))
        batch = global_batch(name, model)
        want, on = _logits(base, batch), _logits(model, batch)
        assert (on - want).abs().max() > 1e-2  # the adapters matter
        with adapters_off(model) as same:
            assert same is model and torch.equal(_logits(model, batch), want)
            with adapters_off(model):
                assert torch.equal(_logits(model, batch), want)
            assert torch.equal(_logits(model, batch), want)  # the inner block restored "off"
        assert torch.equal(_logits(model, batch), on)
        with pytest.raises(RuntimeError, match="inside"), adapters_off(model):
            raise RuntimeError("inside")
        assert torch.equal(_logits(model, batch), on)


def test_one_device_gradients_outside_unaffected():
    """A forward inside (with and without grad mode) leaves the next step's gradients what they would be, and
    nothing inside asks for a gradient (the base is frozen)."""
    import cuboid
    from cuboid.kernels import use_backend
    from cuboid.parallel import adapters_off

    name = "llama-debug"
    with use_backend("torch"):
        plain, visited = (with_random_b(cuboid.load(name, seed=0, lora=LORA)) for _ in range(2))
        batch = global_batch(name, plain)
        with adapters_off(visited):
            _logits(visited, batch)
            assert not visited(**batch).loss.requires_grad
        grads = []
        for model in (plain, visited):
            model(**batch).loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert grads[0] and grads[0].keys() == grads[1].keys()
        assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_no_adapters_is_refused():
    """A model without adapters (never given any, or merged) is a one-line ValueError: its base is itself, and
    a reference policy equal to the policy would train nothing without a word."""
    import cuboid
    from cuboid.parallel import adapters_off
    from cuboid.parallel.lora import merge_adapters

    for model in (cuboid.load("gpt-debug"), merge_adapters(cuboid.load("gpt-debug", lora=LORA))):
        with pytest.raises(ValueError, match="carries no LoRA adapters"), adapters_off(model):
            pass


def test_a_pipeline_rank_without_adapted_layers_decides_as_the_others():
    """Under ZBV a rank's stages may hold no block (2 blocks, 4 stages): it holds no adapted layer, yet enters
    the block as the ranks that do (the paths every rank was asked to adapt decide), and a model loaded the
    same way without LoRA is refused there too."""
    import cuboid
    from cuboid.parallel import Mesh, Plan, adapters_off
    from cuboid.parallel.lora import adapted

    plan = Plan.parse("pp=2,microbatches=2,schedule=zbv")
    stage = cuboid.load("llama-debug", plan, device="meta", mesh=Mesh.layout(plan), lora=LORA)
    assert not adapted(stage) and not any(n.startswith("blocks.") for n, _ in stage.named_parameters())
    with adapters_off(stage):
        pass
    with pytest.raises(ValueError, match="carries no LoRA adapters"), \
            adapters_off(cuboid.load("llama-debug", plan, device="meta", mesh=Mesh.layout(plan))):
        pass


def test_compiled_blocks():
    """Blocks compiled (the plan's ``compile``, ``aot_eager``): the flag is read in the traced hook, so the
    blocks recompile for the other value and give the base's logits inside, the adapters' after."""
    import cuboid
    from cuboid.kernels import use_backend
    from cuboid.parallel import Plan, adapters_off
    from cuboid.parallel import compile as pc

    name, backend = "llama-debug", pc.BACKEND
    pc.BACKEND = "aot_eager"
    torch._dynamo.reset()
    try:
        with use_backend("torch"):
            base = cuboid.load(name, seed=0)
            eager = with_random_b(cuboid.load(name, seed=0, lora=LORA))
            model = with_random_b(cuboid.load(name, Plan(compile=True), seed=0, lora=LORA))
            assert all(pc.compiled_blocks(model))
            batch = global_batch(name, model)
            want, on = _logits(base, batch), _logits(eager, batch)
            assert rel_max(_logits(model, batch), on) < 1e-6
            with adapters_off(model):
                assert rel_max(_logits(model, batch), want) < 1e-6
            assert rel_max(_logits(model, batch), on) < 1e-6
    finally:
        pc.BACKEND = backend
        torch._dynamo.reset()
