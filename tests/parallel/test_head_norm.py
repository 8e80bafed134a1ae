"""Qwen3's and Gemma 3's norms under tensor parallelism: the ``head_norm`` role (q/k norms over each head's
features, whole on every rank, gradients summed over the ranks' heads and batch blocks) and Gemma's
``1 + weight`` norms in the grid modes' norm layers (``offset``), against one device."""
import copy

import pytest
import torch

from .launch import run_world

FAMILIES = ("qwen3-debug", "gemma3-debug")
# 1D with whole key/value heads per rank, 1D with a copy of one key/value head on two ranks (tp=4 over 2),
# Megatron's sequence split (the norms' seq_group set twice: summed once), and the 2D grid
PLANS = ("dp=2,tp=2", "tp=4", "dp=2,tp=2,tp_sequence=true", "tp=4,tp_mode=2d")
TOL = 1e-5


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _reference(name):
    """One device's model with every norm weight drawn at random (a weight the modes ignore, or Gemma's offset
    lost, changes the outputs), and a batch of 8 rows of 12 tokens (longer than gemma3-debug's window of 8)."""
    import cuboid

    ref = cuboid.load(name, seed=0).train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight") or ".ln" in n or n.startswith("ln_f") or "post_ln" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (0.0 if ref.config.gemma_norms else 1.0))
    ids = torch.randint(0, ref.config.vocab_size, (8, 12), generator=g)
    return ref, {"input_ids": ids, "labels": ids.clone()}


def head_norm_worker():
    import cuboid
    from cuboid import zoo
    from cuboid.parallel import Mesh, Plan, comm, prepare
    from cuboid.zoo.common import sharded_parameters

    out = {}
    for name in FAMILIES:
        ref, batch = _reference(name)
        ref_out = ref(**batch)
        ref_out.loss.backward()
        refs = dict(ref.named_parameters())
        for spec in PLANS:
            plan = Plan.parse(spec)
            model = prepare(copy.deepcopy(ref), plan, Mesh.build(plan), zoo.spec_of(ref))
            model.zero_grad(set_to_none=True)
            res = model(**cuboid.rank_share(model, batch))
            res.loss.backward()
            key = f"{spec}/{name}"
            loss = res.loss.detach().clone()
            comm.all_reduce_(loss, model.parallel.mesh.group("dp"))  # each dp share's loss: equal label counts
            out[key + " loss"] = rel(loss / plan.dp, ref_out.loss)
            grads = {n: mod.full_tensor_like(local, p.grad) for n, mod, local, p in sharded_parameters(model)}
            out[key + " grads"] = max(rel(grads[n], refs[n].grad) for n in grads)
            norms = [n for n in grads if "q_norm" in n or "k_norm" in n]
            assert len(norms) == 2 * ref.config.n_layers, norms
            out[key + " q/k norm grads"] = max(rel(grads[n], refs[n].grad) for n in norms)
    return out


def test_qwen3_gemma3_tensor_modes_match_one_device():
    reports = run_world(head_norm_worker, 4, timeout=600)
    assert len(reports[0]) == len(FAMILIES) * len(PLANS) * 3
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not v < TOL}
        assert not bad, (rank, bad)


def test_rms_offset():
    """Gemma's norm scales by 1 + weight, the plain one by weight; a norm of another form is refused."""
    from cuboid.parallel import layers as L
    from cuboid.parallel.tensor.base import rms_offset
    from cuboid.zoo.llama.parts import GemmaRMSNorm

    assert rms_offset(L.RMSNorm(8)) == 0.0
    assert rms_offset(GemmaRMSNorm(8)) == 1.0

    class Squared(L.RMSNorm):
        def forward(self, x, residual=None):
            return super().forward(x) * self.weight

    with pytest.raises(TypeError, match="Squared is not an RMS norm the tensor modes can shard"):
        rms_offset(Squared(8))


def test_grid_norms_take_gemma_offset():
    """The 2D and 3D norm layers built from a Gemma norm (one rank) give its output and gradients."""
    from cuboid.parallel.tensor import d2, d3
    from cuboid.parallel.tensor.base import Axes
    from cuboid.parallel.tensor.grid import Grid
    from cuboid.zoo.llama.parts import GemmaRMSNorm

    torch.manual_seed(0)
    gemma = GemmaRMSNorm(16, 1e-6)
    with torch.no_grad():
        gemma.weight.normal_()
    x = torch.randn(3, 5, 16)
    cube = Axes({a: (None, 1, 0) for a in d3.AXES}, d3.AXES)
    for layer in (d2.LayerNorm2D.from_full(gemma, Grid(), rms=True, offset=1.0),
                  d3.LayerNorm3D.from_full(gemma, cube, rms=True, offset=1.0)):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = layer(xa), gemma(xb)
        assert rel(ya, yb) < 1e-6, type(layer).__name__
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert rel(layer.weight.grad, gemma.weight.grad) < 1e-5 and rel(xa.grad, xb.grad) < 1e-5
        gemma.weight.grad = None
