"""The fused linear cross-entropy in the zoo's LM heads: one device (the head's layer, lazy logits) and, through
the public path, under tp1d, tp2d, pp (1F1B and ZBV) and sp against one device's *unfused* head in float64.

Multi-process: one world of 2 ranks (tp1d, pp2, pp2-zbv, sp2) and one of 4 (tp2d, tp1d-4: a vocabulary of
510 padded over 4 ranks). For each plan, gpt-debug (tied head) and llama-debug (untied ``lm_head``) are loaded
with ``cuboid.load(name, plan)``, the fused head cut into chunks of 5 rows (not dividing the rows), and one
``cuboid.train_step`` on a global batch with padded and ignored labels records the loss and, through an
optimizer that keeps what it is given, every parameter's gradient (gathered whole over the tensor shards).
The reference is the same model on one device with its head unfused in float64 (``F.cross_entropy`` of the
whole float64 logits of the blocks' output; the blocks stay fp32, as the layer kernels take no float64). Loss within 1e-5 relative, gradients within 1e-5 (norm of the
difference over the norm, all parameters of the rank's stages together).
"""
import pytest
import torch
import torch.nn.functional as F

from .launch import run_world
from .test_plans import even_batch

FAMILIES = ("gpt-debug", "llama-debug")
EXTRA = {"vocab_size": 510}
CHUNK = 5
WORLDS = {2: ("tp1d", "pp2", "pp2-zbv", "sp2"), 4: ("tp2d", "tp1d-4")}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------- one device


def _model(name="gpt-debug", **extra):
    import cuboid

    return cuboid.load(name, seed=0, **{**EXTRA, **extra})


def _batch(model):
    return even_batch("gpt-debug", model, 4)


def test_head_layer_equals_unfused_in_float64():
    from cuboid.kernels import use_backend
    from cuboid.parallel import layers as L

    g = torch.Generator().manual_seed(0)
    emb = L.Embedding(37, 16).double()
    h = torch.randn(3, 9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(37, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 37, (3, 9), generator=g)
    labels[0, :4] = -100
    emb.lm_chunk = 4
    with use_backend("torch"):
        loss, logits = emb.lm_outputs(h, labels, bias, shift=True)
    grads = torch.autograd.grad(loss, (h, emb.weight, bias))
    full = F.linear(h, emb.weight, bias)
    want = F.cross_entropy(full[:, :-1].reshape(-1, 37), labels[:, 1:].reshape(-1))
    want_grads = torch.autograd.grad(want, (h, emb.weight, bias))
    assert abs(loss - want).item() < 1e-12
    assert all(rel(a, b) < 1e-12 for a, b in zip(grads, want_grads))
    torch.testing.assert_close(logits.resolve(), full, atol=0, rtol=0)


def largest_rows():
    """A dispatch mode (class) whose ``most`` is the most rows of any (contiguous) vocabulary-wide tensor made
    while it is on (a chunk of logits; the whole logits would be every row)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == EXTRA["vocab_size"] and t.is_contiguous():
                    Largest.most = max(Largest.most, t.numel() // t.shape[-1])
            return out

    return Largest


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_are_made_when_read_with_the_forward_weights(name):
    from cuboid.kernels import use_backend
    from cuboid.parallel import layers as L

    Largest = largest_rows()
    model, free = _model(name), _model(name)
    batch = _batch(model)
    with use_backend("torch"):
        want = free(**{k: v for k, v in batch.items() if k != "labels"}).logits.detach()
        L.Embedding.lm_chunk = CHUNK
        try:
            with Largest():
                out = model(**batch)
                out.loss.backward()
        finally:
            L.Embedding.lm_chunk = None
        assert out.is_deferred("logits")
        assert Largest.most <= CHUNK  # never more than a chunk of rows of logits (the table itself has V rows)
        torch.optim.SGD(model.parameters(), lr=1.0).step()  # the head's weight changes in place
        torch.testing.assert_close(out.logits, want, atol=0, rtol=0)  # the forward's logits nonetheless


@pytest.mark.parametrize("name", FAMILIES)
def test_a_step_that_does_not_read_logits_copies_no_table(name):
    # the natural loop drops the output before the step: nothing of the head's table size is copied (the lazy
    # logits used to clone it every forward); an output kept across the step still reads the forward's logits
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        tables = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                Copies.tables += any(isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] == EXTRA["vocab_size"]
                                     for a in args)
            return func(*args, **(kwargs or {}))

    model = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    batch = _batch(model)
    with Copies():
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
    assert Copies.tables == 0
    out = model(**batch)
    out.loss.backward()
    want = out.logits.detach().clone()
    out = model(**batch)
    with Copies():
        opt.step()
    assert Copies.tables == 1  # the one live output's table, copied before the step changed it
    torch.testing.assert_close(out.logits, want, atol=0, rtol=0)


def test_logits_read_after_an_in_place_change_are_refused():
    model = _model()
    out = model(**_batch(model))
    table = getattr(model, "lm_head", None) or model.tok_emb  # the untied head, or the tied token table
    with torch.no_grad():
        table.weight.mul_(2)
    with pytest.raises(RuntimeError, match="changed in place outside an optimizer step: read .logits before"):
        out.logits


def test_lazy_logits_keep_the_autocast_dtype():
    from cuboid.kernels import use_backend

    model = _model()
    batch = _batch(model)
    with use_backend("torch"), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        out = model(**batch)
    assert out.logits.dtype == torch.bfloat16  # read outside autocast: made under the forward's
    torch.testing.assert_close(out.logits, want, atol=0, rtol=0)


# ---------------------------------------------------------------- plans


class Keep(torch.optim.Optimizer):
    """An optimizer that keeps the gradients it is given (train_step has averaged, summed and reduced them)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = p.grad.detach().clone()


def unfused_float64(name, batch):
    """One device with its LM head unfused in float64: the blocks in fp32 (the layer kernels take no float64),
    the whole logits ``h @ W.T`` and their cross-entropy in float64 from the blocks' output, backward through
    both. Returns (loss, {name: grad})."""
    model = _model(name)
    h = model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state
    table = getattr(model, "lm_head", None) or model.tok_emb  # the untied head, or the tied token table
    logits = F.linear(h.double(), table.weight.double())
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def plans_worker(plans):
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel import layers as L
    from cuboid.zoo import READY_PLANS

    L.Embedding.lm_chunk = CHUNK
    out = {}
    for spec in plans:
        plan = Plan.parse(spec, READY_PLANS)
        mesh = Mesh.build(plan)
        for name in FAMILIES:
            model = cuboid.load(name, plan, seed=0, mesh=mesh, **EXTRA).train()
            batch = even_batch(name, model, 8)
            want_loss, want_grads = unfused_float64(name, batch)
            opt = Keep(model.parameters())
            loss = cuboid.train_step(model, opt, batch).loss
            got, want = [], []
            for full, mod, local, p in zoo.common.sharded_parameters(model):
                grad = opt.grads.get(id(p))
                assert grad is not None, (spec, name, full, "no gradient")
                got.append(mod.full_tensor_like(local, grad).flatten())  # a collective over the tensor shards
                want.append(want_grads[full].flatten())
            out[f"{spec}/{name}"] = {"loss": abs(loss - want_loss) / abs(want_loss),
                                     "grads": rel(torch.cat(got), torch.cat(want)), "params": len(got)}
    return out


def check(results, plans):
    for rank, report in enumerate(results):
        assert len(report) == len(plans) * len(FAMILIES), (rank, sorted(report))
        for key, errs in report.items():
            assert errs["params"] > 0, (rank, key, errs)
            assert errs["loss"] < 1e-5 and errs["grads"] < 1e-5, (rank, key, errs)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_fused_head_under_plans_equals_unfused_float64(world):
    check(run_world(plans_worker, world, WORLDS[world], timeout=600), WORLDS[world])
