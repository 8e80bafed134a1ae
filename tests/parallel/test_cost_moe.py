"""The cost model of mixture-of-experts models and expert parallelism (issue 37).

- Parameter counts: the presets' totals are transformers' (the issue's numbers), and the active ones (what
  a token uses) equal the config's own count of the experts a token leaves idle; ``cuboid info --model``
  prints both.
- FLOPs price the router and the ``top_k`` experts a token goes to, not all ``E``: a mixture whose every token
  takes every expert costs what a dense MLP of all the experts' width costs, plus its router.
- The experts' all-to-all is priced by the stated formula (``tokens x k x dim x bytes x (ep - 1) / ep`` per
  exchange, four per sparse layer and micro-batch, plus the counts), and their state and gradients over
  ``edp``; on 4 gloo ranks the bytes each rank holds and sends (dp, edp, sp, tp, ZeRO; the router statistics'
  all-reduce; the q/k norms' gradients under tp) equal the model's exactly and the ep bytes of the world equal
  the formula applied to the routing the run made (:mod:`.cost_checks`).
- A sparse layer's activations: what a forward keeps beyond a dense layer is ``Shape.routed_elements``.
- The enumeration of 8 ranks for qwen3-30b-a3b holds ep plans and ``cuboid plans --model qwen3-30b-a3b`` lists
  them (priced on 2 ranks: all of 8 ranks' plans take minutes); ``plan="auto"`` picks one where it is fastest.
"""
from __future__ import annotations

import json
import math

import pytest

from .cost_checks import check_cost, cost_worker
from .launch import run_world

# held out: 3 blocks with the middle one dense, a vocabulary that pads, experts of a width no other test uses,
# and the load-balancing loss on (its statistics are summed over the data ranks)
MOE_HELD_OUT = dict(vocab_size=301, n_positions=64, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16,
                    n_experts=8, experts_per_token=2, moe_hidden=48, mlp_only_layers=(1,), output_router_logits=True)

PRESETS = {"qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704, "olmoe-1b-7b": 6_919_161_856}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_counts_total_and_active(name):
    from cuboid import zoo
    from cuboid.parallel.cost import Shape

    config = zoo.config_of(name)
    shape = Shape.of(config)
    model = zoo.build(config)
    assert shape.parameters == PRESETS[name] == zoo.count_parameters(model)
    # idle: (E - k) / E of the experts' parameters the model holds
    held = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert shape.parameters - shape.active_parameters == held * (shape.experts - shape.top_k) // shape.experts
    assert shape.sparse and shape.sparse_layers == len(config.sparse_layers) == config.n_layers
    # a token uses k of E experts in every sparse layer; everything else it uses whole
    experts = shape.sparse_layers * shape.experts * 3 * shape.dim * shape.expert_width
    assert shape.parameters - shape.active_parameters == experts * (shape.experts - shape.top_k) // shape.experts


def test_info_prints_total_and_active(capsys):
    from cuboid.cli import main

    assert main(["info", "--model", "qwen3-30b-a3b"]) == 0
    out = capsys.readouterr().out
    assert "30,532,122,624" in out and "active parameters" in out and "128 per sparse layer, 8 per token" in out
    assert main(["info", "--model", "gpt-debug"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "active" not in out


def test_flops_price_active_experts():
    """Every token through every expert is a dense MLP of E x I (the experts side by side) plus the router."""
    from dataclasses import replace

    from cuboid import zoo
    from cuboid.parallel.cost import Shape, step_flops

    moe = Shape.of(zoo.config_of("qwen3-moe-debug", mlp_only_layers=()))
    B, s = 4, 32
    every = replace(moe, top_k=moe.experts)
    dense = replace(moe, experts=0, top_k=0, sparse_layers=0, hidden=moe.experts * moe.expert_width)
    router = 3 * 2 * B * s * moe.dim * moe.experts * moe.n_layers  # forward and backward of every layer's router
    assert step_flops(every, B, s) == pytest.approx(step_flops(dense, B, s) + router, rel=1e-12)
    # k of E: the experts' share of the work scales with k, nothing else moves
    experts_every = step_flops(every, B, s) - step_flops(replace(moe, top_k=0), B, s)
    experts_k = step_flops(moe, B, s) - step_flops(replace(moe, top_k=0), B, s)
    assert experts_k == pytest.approx(experts_every * moe.top_k / moe.experts, rel=1e-12)
    # a dense layer (Qwen3-MoE's mlp_only_layers) is priced at the dense width
    mixed = Shape.of(zoo.config_of("qwen3-moe-debug"))
    assert mixed.sparse_layers == 1 and step_flops(mixed, B, s) != step_flops(moe, B, s)


def _kept_by_a_forward(**fields) -> int:
    """Bytes an fp32 forward of a small Qwen3-MoE-shaped model leaves alive for backward (every storage it made)."""
    import torch

    from bench.checkpointing import made_tracker  # the repository root is on sys.path (last), as for tests.*

    import cuboid
    from cuboid import kernels, zoo

    config = zoo.config_of("qwen3-moe-debug", vocab_size=256, n_positions=64, dim=256, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=32, mlp_only_layers=(), **fields)
    model = cuboid.load(config)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    made = made_tracker()
    with made, kernels.use_backend("torch"):
        out = model(input_ids=ids, labels=ids)
    kept = made.live()
    del out
    return kept


@pytest.mark.parametrize("k, width", [(2, 64), (4, 32)])
def test_routed_activations_are_what_a_sparse_layer_keeps(k, width):
    """A sparse layer keeps, beyond a dense gated MLP of width k x I, Shape.routed_elements fp32 elements a token
    (the routed copies, the experts' outputs, the router's logits, the indices), and at most 32 more: small
    per-token tensors the formula leaves out (3 k h is 1536 here)."""
    from cuboid import zoo
    from cuboid.parallel.cost import Shape

    moe = _kept_by_a_forward(n_experts=8, experts_per_token=k, moe_hidden=width)
    dense = _kept_by_a_forward(n_experts=0, mlp_hidden=k * width)
    shape = Shape.of(zoo.config_of("qwen3-moe-debug", dim=256, n_layers=2, n_experts=8, experts_per_token=k,
                                   moe_hidden=width, mlp_only_layers=(), head_dim=32))
    tokens, layers = 2 * 64, 2
    extra = (moe - dense) / (tokens * layers * 4)  # fp32 elements a token and layer
    assert 0 <= extra - shape.routed_elements() <= 32, (extra, shape.routed_elements())


def test_exchange_formula_and_traffic():
    """The planner's ep traffic is the docstring's formula; the experts' gradients go over edp."""
    from cuboid import zoo
    from cuboid.parallel import Plan, cost
    from cuboid.loading.planner import meta_shards

    config = zoo.config_of("qwen3-moe-debug", **MOE_HELD_OUT)
    assert cost.expert_exchange_bytes(32, 2, 64, 4, 4) == 32 * 2 * 64 * 4 * 3 / 4
    assert cost.expert_exchange_bytes(32, 2, 64, 4, 1) == 0
    batch, seq = 8, 16
    for spec, checkpoint_calls in (("dp=4,ep=2", 0), ("dp=4,ep=4,checkpoint=full", 1)):
        plan = Plan.parse(spec)
        meta = meta_shards(config, plan, 0)
        named = dict(meta.named_parameters())
        experts = cost.expert_parameters(named, zoo.spec_of(meta))
        assert experts and all(p.shape[0] == config.n_experts // plan.ep for p in experts)
        sent = cost.traffic(config, plan, named, cost.Stage(config.n_layers), batch, seq, spec=zoo.spec_of(meta))
        tokens, sparse = batch // plan.dp * seq, len(config.sparse_layers)
        rows = tokens * config.experts_per_token * config.dim * 4 * (plan.ep - 1) / plan.ep
        counts = (plan.ep - 1) / plan.ep * 8 * config.n_experts
        want = sparse * ((1 + checkpoint_calls) * (counts + 2 * rows) + 2 * rows)
        assert sent["all_to_all", "ep"][0] == pytest.approx(want, rel=1e-12)
        edp = plan.dp // plan.ep
        expert_bytes = sum(p.numel() * 4 for p in experts)
        if edp > 1:
            assert sent["all_reduce", "edp"][0] == pytest.approx(2 * (edp - 1) / edp * expert_bytes)
        else:
            assert ("all_reduce", "edp") not in sent
        # ZeRO-1: the experts' moments are cut over edp (one bucket: they are small), the others' over dp
        whole = cost.model_states(experts, plan.replace(zero=1))["optimizer"]
        cut = cost.model_states(experts, plan.replace(zero=1), experts=experts)["optimizer"]
        assert whole == 8 * math.ceil(expert_bytes / 4 / plan.dp) and cut == 8 * math.ceil(expert_bytes / 4 / edp)


# ep over dp (one and two copies of the experts), ZeRO 1-3 on the experts over edp (ZeRO-3 with edp of one rank
# too), ep over dp x sp, ep beside 1D tensor parallelism (the experts whole on the tensor ranks)
FOUR_RANK_MOE = ["dp=4,ep=2", "dp=4,ep=2,zero=1", "dp=4,ep=2,zero=2", "dp=4,ep=2,zero=3", "dp=4,ep=4,zero=3",
                 "dp=2,sp=2,ep=2", "dp=2,tp=2,ep=2"]


def test_moe_bytes_sent_and_held_equal_the_cost_model_on_4_ranks():
    reports = run_world(cost_worker, 4, FOUR_RANK_MOE, "qwen3-moe-debug", MOE_HELD_OUT, timeout=900)
    check_cost(reports)
    assert all(len(r) == len(FOUR_RANK_MOE) for r in reports)
    assert all("ep" in r[p]["sent"][0] for r in reports for p in FOUR_RANK_MOE)


def test_qwen3_30b_a3b_on_8_ranks_has_ep_plans_and_the_command_lists_them(capsys):
    """The enumeration of 8 ranks holds ep plans (2, 4 and 8 of the 128 experts' ranks) for the mixture, none for a
    dense model; ``cuboid plans`` prices and lists them (2 ranks here: pricing every plan of 8 ranks of a 30B model
    takes minutes on a CI core), with the model's total and active parameters above the table."""
    from cuboid import zoo
    from cuboid.cli import main
    from cuboid.loading.planner import candidate_plans

    plans = candidate_plans(zoo.config_of("qwen3-30b-a3b"), 8, 16)
    assert {p.ep for p in plans} == {1, 2, 4, 8}
    assert all(p.dp * p.sp % p.ep == 0 for p in plans)
    assert {p.ep for p in candidate_plans(zoo.config_of("qwen3-8b"), 8, 16)} == {1}
    args = ["plans", "--model", "qwen3-30b-a3b", "--gpus", "2", "--batch", "4", "--seq", "512", "--no-search",
            "--gpu-memory", "1000GB"]
    assert main(args + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    ep = [r for r in rows if "ep=2" in r["plan"].split(",")]
    assert ep and all(r["fits"] and r["sent"]["ep"] > 0 for r in ep), [r["plan"] for r in rows]
    assert main(args + ["--top", "100"]) == 0
    out = capsys.readouterr().out
    assert "30.5B parameters, 3.35B active per token" in out and "ep=2" in out


def test_auto_picks_expert_parallelism_where_it_is_fastest():
    """On 8 H200s under ZeRO-3, sharding the experts over ep (their all-to-all moves tokens) beats gathering
    every expert's weights over dp each step: ``plan="auto"`` takes an ep plan."""
    from cuboid.parallel import cost
    from cuboid.loading.planner import auto_plan

    plan, ests = auto_plan("qwen3-30b-a3b", "auto,dp=8,zero=3,dtype=bf16", world=8, batch=16, seq=1024,
                           hw=cost.load_hardware("h200"), memory=141e9)
    assert plan.ep > 1, plan.describe()
    dense = [e for e in ests if e.fits and e.plan.ep == 1]
    assert dense and ests[0].step_s < min(e.step_s for e in dense)
    assert ests[0].sent["ep"] > 0 and ests[0].sent["dp"] < min(e.sent["dp"] for e in dense) / 10
