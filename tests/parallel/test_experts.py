"""Expert parallelism (parallel/experts.py) on 2 and 4 gloo ranks against one device.

- the layer: each rank routes its own tokens (a different count per rank, one rank with none, routing
  skewed so that some experts get no token from some ranks) through the expert-parallel ``Experts``; the
  outputs and input gradients equal the single-device layer's on the same tokens, each rank's expert
  gradients equal the single-device gradients of its experts summed over its ``ep`` group and divided by
  ``ep`` (what is left is an average over ``edp``), and the bytes
  counted under ``all_to_all`` in the ``ep`` group equal :func:`dispatch_bytes` forward and backward;
- a step: a tiny router + experts model prepared for ``dp`` (x ``ep``) with ZeRO 0-3 has, after one
  backward on each rank's share, the gradients (ZeRO: this rank's pieces) of one device's backward on the
  whole batch (1e-6, in float64), with 3 tokens a rank, so most experts get no token on some ranks.
"""
import pytest
import torch
from torch import nn

from .launch import run_world

DIM, HIDDEN, EXPERTS, TOP_K = 16, 8, 8, 2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (0 for empty tensors)."""
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item() if want.numel() else 0.0


def _ep_layer_worker(ep: int):
    import torch.distributed as dist

    from cuboid.parallel import comm
    from cuboid.parallel.experts import dispatch_bytes, shard_experts
    from cuboid.parallel.mesh import Mesh
    from cuboid.parallel.moe import Experts
    from cuboid.parallel.plan import Plan
    from cuboid.parallel.spec import ShardingSpec

    world = int(__import__("os").environ["WORLD_SIZE"])
    mesh = Mesh.build(Plan(dp=world, ep=ep))
    rank = mesh.rank
    torch.manual_seed(0)
    ref = Experts(DIM, HIDDEN, EXPERTS)
    with torch.no_grad():
        ref.gate_up.normal_(0, 0.3)
        ref.down.normal_(0, 0.3)
    holder = nn.Module()
    holder.experts = Experts(DIM, HIDDEN, EXPERTS)
    holder.experts.load_state_dict(ref.state_dict())
    assert shard_experts(holder, ShardingSpec(roles={"experts": "experts"}), mesh) == 1
    layer = holder.experts
    lo = mesh.coords["ep"] * (EXPERTS // ep)
    assert layer.gate_up.shape[0] == EXPERTS // ep and layer.first_expert == lo
    assert torch.equal(layer.full_tensor("gate_up"), ref.gate_up.detach())

    n = [5, 0, 7, 3][rank]  # rank 1 routes no token at all
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(n, DIM, generator=g)
    low = (3 * rank + 2) % EXPERTS  # each rank sends to experts low..low+4 only: the others get none from it
    choice = torch.stack([torch.full((n,), low), (low + torch.randint(1, 5, (n,), generator=g)) % EXPERTS], 1)
    weights = torch.rand(n, TOP_K, generator=g)
    dy = torch.randn(n, DIM, generator=g)

    xr = x.clone().requires_grad_(True)
    want = ref(xr, weights, choice)
    (want * dy).sum().backward()

    xe = x.clone().requires_grad_(True)
    counts = torch.bincount(choice.reshape(-1), minlength=EXPERTS)
    everyone = comm.all_gather_list(counts, mesh.group("ep"))
    me = mesh.coords["ep"]
    recv = torch.stack([c.reshape(ep, -1)[me] for c in everyone])
    with comm.count() as fwd:
        got = layer(xe, weights, choice)
    with comm.count() as bwd:
        (got * dy).sum().backward()
    out = {"out": _rel(got, want), "dx": _rel(xe.grad, xr.grad)}
    for name in ("gate_up", "down"):
        full = getattr(ref, name).grad.clone()
        dist.all_reduce(full, group=mesh.group("ep"))  # every token of the ep group reached these experts ...
        out[name] = _rel(getattr(layer, name).grad, full[lo:lo + EXPERTS // ep] / ep)  # ... divided by ep
    row = DIM * 4
    out["fwd_bytes"] = (fwd.bytes("all_to_all", "ep"), dispatch_bytes(counts, ep, me, row, recv))
    tokens = dispatch_bytes(counts, ep, me, row, recv) - (ep - 1) / ep * 8 * EXPERTS
    out["bwd_bytes"] = (bwd.bytes("all_to_all", "ep"), tokens)
    out["other"] = fwd.total + bwd.total - fwd.bytes("all_to_all", "ep") - bwd.bytes("all_to_all", "ep")
    return out


def _ep_layers_worker(eps: list) -> list:
    return [_ep_layer_worker(ep) for ep in eps]


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_matches_one_device(world):
    eps = {2: [2], 4: [4, 2]}[world]
    for ep, outs in zip(eps, zip(*run_world(_ep_layers_worker, world, eps, timeout=400))):
        _check_dispatch(outs)


def _check_dispatch(outs):
    for r, out in enumerate(outs):
        for key in ("out", "dx", "gate_up", "down"):
            assert out[key] < 1e-6, (r, key, out[key])
        for key in ("fwd_bytes", "bwd_bytes"):
            counted, formula = out[key]
            assert counted == pytest.approx(formula), (r, key, counted, formula)
        assert out["other"] == 0, (r, out["other"])
    assert all(sum(out[key][0] for out in outs) > 0 for key in ("fwd_bytes", "bwd_bytes"))  # tokens did move


class TinyMoE(nn.Module):
    """A projection, a router and experts, a projection: enough to train the experts under a plan."""

    def __init__(self):
        super().__init__()
        from cuboid.parallel import layers as L
        from cuboid.parallel.moe import Experts, Router

        self.inp = L.Linear(DIM, DIM)
        self.router = Router(DIM, EXPERTS, TOP_K)
        self.experts = Experts(DIM, HIDDEN, EXPERTS)
        self.out = L.Linear(DIM, DIM)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.3)

    def forward(self, x):
        h = self.inp(x)
        _, weights, choice = self.router(h)
        return (self.out(h + self.experts(h, weights, choice)) ** 2).mean()


def _tokens(world: int) -> torch.Tensor:
    return torch.randn(3 * world, DIM, generator=torch.Generator().manual_seed(3))


def _step_worker(plan_fields: dict):
    from cuboid.parallel import prepare, zero
    from cuboid.parallel.experts import expert_parameters
    from cuboid.parallel.mesh import Mesh
    from cuboid.parallel.plan import Plan
    from cuboid.parallel.spec import ShardingSpec

    plan = Plan(**plan_fields)
    mesh = Mesh.build(plan)
    ref = TinyMoE().double()  # float64: rounding is far below the tolerance, a wrong reduction is not
    ref(_tokens(plan.world_size).double()).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    model = TinyMoE().double()
    spec = ShardingSpec(roles={"experts": "experts", "router": "replicate", "inp": "replicate", "out": "replicate"})
    prepare(model, plan, mesh, spec)
    ep_params = {id(p) for p in expert_parameters(model)}
    assert len(ep_params) == (2 if plan.ep > 1 else 0)
    share = _tokens(plan.world_size).double().chunk(plan.world_size)[mesh.rank]
    model(share).backward()
    params = list(model.parameters())
    zero.before_step(params)
    errors = {}
    lo = mesh.coords.get("ep", 0) * (EXPERTS // plan.ep)
    for name, p in model.named_parameters():
        name = name.replace("_fsdp_wrapped_module.", "")
        full = want[name]
        if id(p) in ep_params:
            full = full[lo:lo + EXPERTS // plan.ep]
        piece = zero.view_of(p)
        if piece is None:
            got, exp = p.grad, full
        else:
            got, exp = piece.grad.reshape(-1), full.reshape(-1)[piece.start:piece.stop]
        errors[name] = _rel(got, exp)
    return errors


STEP_PLANS = {2: [dict(dp=2, ep=2), dict(dp=2, ep=2, zero=1), dict(dp=2, ep=2, zero=3), dict(dp=2)],
              4: [dict(dp=4, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2, zero=2), dict(dp=4, ep=2, zero=3),
                  dict(dp=4, ep=4, zero=3)]}


def _steps_worker(plans: list) -> list:
    return [_step_worker(fields) for fields in plans]  # one world for every plan of its size


@pytest.mark.parametrize("world", [2, 4])
def test_step_gradients_match_one_device(world):
    for r, per_plan in enumerate(run_world(_steps_worker, world, STEP_PLANS[world], timeout=400)):
        for fields, errors in zip(STEP_PLANS[world], per_plan):
            bad = {k: v for k, v in errors.items() if not v < 1e-6}
            assert not bad and len(errors) == 7, (fields, r, bad)


def _checkpoint_worker(folder: str):
    """qwen3-moe-debug under dp=2 x ep=2 after one AdamW step saves its weights and optimizer state; the folder
    loads under dp=2 x ep=2 again (each rank's experts equal to the saved rows) and under dp=2 without ep."""
    import cuboid
    from cuboid.parallel.optim import AdamW
    from cuboid.zoo import checkpoint

    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(5))
    model = cuboid.load("qwen3-moe-debug", "dp=2,ep=2", seed=0, output_router_logits=True)
    opt = AdamW(model.parameters(), lr=1e-2)
    cuboid.train_step(model, opt, {"input_ids": ids, "labels": ids})
    checkpoint.save(model, folder, optimizer=opt)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    again = cuboid.load(folder, "dp=2,ep=2")
    same = all(torch.equal(p, saved[n]) for n, p in again.named_parameters())
    whole = cuboid.load(folder, "dp=2")
    experts = whole.blocks[1].mlp.experts
    rank = model.parallel.mesh.coords["ep"]
    rows = slice(4 * rank, 4 * rank + 4)
    return same, torch.equal(experts.gate_up[rows], saved["blocks.1.mlp.experts.gate_up"]), \
        tuple(experts.gate_up.shape)


def test_checkpoint_any_plan_writes_any_plan_reads(tmp_path):
    for same, rows, shape in run_world(_checkpoint_worker, 2, str(tmp_path / "ckpt"), timeout=400):
        assert same and rows and shape[0] == 8, (same, rows, shape)
