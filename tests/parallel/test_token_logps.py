"""``model(**batch, logprobs=True)``: per-token log-probabilities and entropies from the fused head, against one
device's whole logits in float64, on one device and under every tensor mode, sp, pp and dp.

On one device (gpt-debug, llama-debug, qwen3-moe-debug): ``out.token_logps`` (B, T - 1) equals
``log_softmax(logits.double())`` gathered at ``labels[:, 1:]`` (0 where -100), ``out.token_entropy`` the
float64 entropy, the loss the plain forward's, without labels the targets are ``input_ids[:, 1:]`` and there is
no loss, and no tensor of more than a chunk of vocabulary-wide rows is made (never whole logits).

Plans (gloo, one world per size): 2 ranks run tp1d, tp1d with the sequence cut (``tp_sequence``), sp ring, sp
all-to-all, pp=2 and dp=2, each on gpt-debug and a Llama-family preset (llama-debug, the MoE qwen3-moe-debug
but under pp and tp_sequence); 8 ranks run tp2.5d (gpt-debug), tp3d (llama-debug) and dp2 x tp2d (gpt-debug).
Each plan loads its families with ``cuboid.load(name, plan)`` (vocabulary 510: padded slices; the fused head cut
into chunks of 5 rows), feeds ``cuboid.rank_share(model, batch)`` of a packed batch (documents restarting
positions, their first label -100, SFT masks, right padding) and checks, on every rank, the rank's share of
the one-device values (within 1e-5 relative), and, but under pp (whose ``model(**batch)`` is a forward without
gradients), every parameter's gradient of ``(token_logps * weights).sum()`` for random per-token weights
(gathered whole over the tensor shards; averaged over dp, so one device's over ``dp``) within 1e-5. The
reference: the same model and seed on one device, its blocks in fp32, the head's logits and everything after
them in float64.
"""
import pytest
import torch
import torch.nn.functional as F

from .launch import run_world
from .test_linear_ce_plans import largest_rows
from .test_plans import packed_batch

EXTRA = {"vocab_size": 510}
CHUNK = 5
TOL = 1e-5
WORLDS = {2: ("tp1d", "tp2-seq", "sp2", "sp2-a2a", "pp2", "dp"),
          8: ("tp2.5d", "tp3d", "dp=2,tp=4,tp_mode=2d")}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def families(plan, index):
    """The families plan number ``index`` of its world runs: gpt-debug and a Llama-family preset (the MoE one
    where its experts take the plan: 1D, sp, dp) on 2 ranks; one of gpt-debug and llama-debug, turned by the
    index, on 8 (whose worlds cost the most)."""
    if plan.world_size > 2:
        return (("gpt-debug", "llama-debug")[index % 2],)
    moe = plan.pp == 1 and plan.tp_mode == "1d" and not plan.tp_sequence
    return ("gpt-debug", "qwen3-moe-debug" if moe else "llama-debug")


def _load(name, plan=None, **kw):
    import cuboid

    return cuboid.load(name, plan, seed=0, **EXTRA, **kw)


def token_weights(batch):
    return torch.randn(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1,
                       generator=torch.Generator().manual_seed(5))


def reference(name, batch, weights):
    """One device, float64 from the head on: (token log-probs, entropies, {name: grad of sum(logps * weights)}).
    Kept per family (every plan of a world feeds the same batch)."""
    key = (name, batch["input_ids"].shape)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(name, batch, weights)
    return _REFERENCES[key]


_REFERENCES: dict = {}


def _reference(name, batch, weights):
    model = _load(name)
    h = model(**{k: v for k, v in batch.items() if k != "labels"}).last_hidden_state  # (B, T, C) fp32
    table = getattr(model, "lm_head", None) or model.tok_emb  # the untied head, or the tied token table
    logp = torch.log_softmax(F.linear(h.double(), table.weight.double()), -1)[:, :-1]  # (B, T - 1, V)
    labels = batch["labels"][:, 1:]
    logps = torch.where(labels != -100, logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    entropy = -(logp.exp() * logp).sum(-1)
    (logps * weights.double()).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy.detach(), grads


# ---------------------------------------------------------------- one device


@pytest.fixture
def small_chunks():
    from cuboid.kernels import use_backend
    from cuboid.parallel import layers as L

    L.Embedding.lm_chunk = CHUNK
    try:
        with use_backend("torch"):
            yield
    finally:
        L.Embedding.lm_chunk = None


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("name", ["gpt-debug", "llama-debug", "qwen3-moe-debug"])
def test_one_device_equals_float64_log_softmax(name):
    model = _load(name)
    batch = packed_batch(name, model, 4)
    weights = token_weights(batch)
    want, want_entropy, want_grads = reference(name, batch, weights)
    out = model(**batch, logprobs=True)
    assert out.token_logps.shape == out.token_entropy.shape == weights.shape
    assert torch.all(out.token_logps[batch["labels"][:, 1:] == -100] == 0)
    assert rel(out.token_logps, want) < TOL and rel(out.token_entropy, want_entropy) < TOL
    assert out.token_logps.requires_grad and not out.token_entropy.requires_grad
    torch.testing.assert_close(out.loss, model(**batch).loss, rtol=1e-6, atol=0)
    (out.token_logps * weights).sum().backward()
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    assert sorted(names) == sorted(want_grads)
    got = torch.cat([dict(model.named_parameters())[n].grad.flatten() for n in names])
    assert rel(got, torch.cat([want_grads[n].flatten() for n in names])) < TOL


@pytest.mark.usefixtures("small_chunks")
def test_without_labels_the_targets_are_the_input_ids_and_there_is_no_loss():
    model = _load("llama-debug")
    batch = packed_batch("llama-debug", model, 4)
    ids = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**ids, logprobs=True)
    want = model(**ids, labels=batch["input_ids"], logprobs=True)
    assert out.loss is None and want.loss is not None
    assert torch.equal(out.token_logps, want.token_logps) and torch.all(out.token_logps < 0)


@pytest.mark.usefixtures("small_chunks")
def test_no_whole_logits_are_made():
    Largest = largest_rows()
    model = _load("gpt-debug")
    batch = packed_batch("gpt-debug", model, 4)
    with Largest():
        model(**batch, logprobs=True).token_logps.sum().backward()
    assert Largest.most <= CHUNK


def test_heads_without_the_fused_lm_head_refuse():
    model = _load("llama-debug", head="cls", num_labels=3)
    with pytest.raises(ValueError, match="logprobs=True needs the fused LM head"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), logprobs=True)


# ---------------------------------------------------------------- plans


def _check_plan(spec, name, mesh):
    """One plan and family on this rank: the largest relative errors of its token outputs and gradients."""
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Plan
    from cuboid.zoo import READY_PLANS

    plan = Plan.parse(spec, READY_PLANS)
    model = _load(name, plan, mesh=mesh).train()
    batch = packed_batch(name, model, 8)
    weights = token_weights(batch)
    want, want_entropy, want_grads = reference(name, batch, weights)
    share = cuboid.rank_share(model, dict(batch, weights=weights, want=want, entropy=want_entropy))
    inputs = {k: share[k] for k in batch}
    errs = {}
    if plan.pp > 1:  # a forward without gradients on every rank
        with torch.no_grad():
            out = model(**inputs, logprobs=True)
        bare = model(**{k: v for k, v in inputs.items() if k != "labels"}, logprobs=True)
        labels = inputs["labels"][:, 1:]
        errs["ids"] = 0.0 if bare.loss is None and torch.equal(bare.token_logps[labels != -100],
                                                                out.token_logps[labels != -100]) else 1.0
    else:
        out = model(**inputs, logprobs=True)
        (out.token_logps * share["weights"]).sum().backward()
        got, ref = [], []
        for full, mod, local, p in zoo.common.sharded_parameters(model):
            assert p.grad is not None, (spec, name, full, "no gradient")
            got.append(mod.full_tensor_like(local, p.grad).flatten())  # a collective over the tensor shards
            ref.append(want_grads[full].flatten() / plan.dp)  # dp averages the shares' gradients
        errs["grads"] = rel(torch.cat(got), torch.cat(ref))
    assert out.token_logps.shape == share["want"].shape, (spec, name, tuple(out.token_logps.shape))
    errs["logps"] = rel(out.token_logps, share["want"])
    errs["entropy"] = rel(out.token_entropy, share["entropy"])
    return errs


def plans_worker(specs):
    from cuboid.parallel import Mesh, Plan
    from cuboid.parallel import layers as L
    from cuboid.zoo import READY_PLANS

    L.Embedding.lm_chunk = CHUNK
    out = {}
    for index, spec in enumerate(specs):
        plan = Plan.parse(spec, READY_PLANS)
        mesh = Mesh.build(plan)
        for name in families(plan, index):
            out[f"{spec}/{name}"] = _check_plan(spec, name, mesh)
    return out


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_token_logps_under_plans_equal_float64(world):
    results = run_world(plans_worker, world, WORLDS[world], timeout=600)
    for rank, report in enumerate(results):
        assert len(report) == (2 if world == 2 else 1) * len(WORLDS[world]), (rank, sorted(report))
        for key, errs in report.items():
            assert all(e < TOL for e in errs.values()), (rank, key, errs)
            assert ("grads" in errs) != key.startswith("pp"), (rank, key, errs)
