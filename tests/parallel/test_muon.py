"""Muon (cuboid.parallel.muon) on one device: its hidden matrices' steps equal torch.optim.Muon's and the rest
AdamW's (torch.optim.AdamW), bf16 and fp32 Newton-Schulz; its routing by the spec's roles; its state saved and
loaded continues exactly; the fine-tune loop's ``--optimizer muon``. Under plans it runs in the generated plan
test's optimizer rotation (tests/parallel/test_plans.py), against one device."""
from __future__ import annotations

import pytest
import torch

import cuboid
from cuboid.parallel.muon import Muon, newton_schulz, routes_to_muon


def _steps(model, opts, steps=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()


def _max_rel(a, b) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", ["llama-debug", "gpt-debug"])
def test_equals_torch_muon_and_adamw(name):
    ours, ref = cuboid.load(name, seed=0), cuboid.load(name, seed=0)
    hidden = [p for p in ref.parameters() if routes_to_muon(p)]
    rest = [p for p in ref.parameters() if not routes_to_muon(p)]
    assert hidden and rest
    opt = Muon(ours.parameters(), lr=0.02, weight_decay=0.1, adjust_lr="original", adamw_lr=1e-3)
    torch_opts = (torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.95),
                  torch.optim.AdamW(rest, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    _steps(ours, [opt])
    _steps(ref, torch_opts)
    assert _max_rel(ours, ref) <= 1e-6


def test_routing_follows_the_spec_roles():
    model = cuboid.load("llama-debug", seed=0)
    routed = {n for n, p in model.named_parameters() if routes_to_muon(p)}
    assert "blocks.0.attn.q.weight" in routed and "blocks.0.mlp.proj.weight" in routed
    assert not routed & {"tok_emb.weight", "lm_head.weight", "ln_f.weight", "blocks.0.ln1.weight"}
    lora = cuboid.load("llama-debug", seed=0, lora="r=4,alpha=8,targets=attn+mlp")
    assert not any(routes_to_muon(p) for p in lora.parameters() if p.requires_grad)  # adapters: AdamW's


def test_newton_schulz_orthogonalises_in_fp32_and_per_expert():
    g = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    stack = newton_schulz(g, dtype=torch.float64)
    for e in range(3):  # each matrix on its own, the same as alone
        assert torch.allclose(stack[e], newton_schulz(g[e], dtype=torch.float64), atol=1e-12)
    s = torch.linalg.svdvals(newton_schulz(g[0], dtype=torch.float32).double())
    assert s.min() > 0.5 and s.max() < 1.5  # the quintic's band around 1 (not exactly orthogonal)


def test_state_resumes_exactly():
    a, b = cuboid.load("llama-debug", seed=0), cuboid.load("llama-debug", seed=0)
    oa = Muon(a.parameters(), lr=0.02, ns_dtype="fp32")
    _steps(a, [oa], steps=2)
    b.load_state_dict(a.state_dict())
    ob = Muon(b.parameters(), lr=0.02, ns_dtype="fp32")
    ob.load_state_dict(oa.state_dict())
    _steps(a, [oa], steps=2, seed=7)
    _steps(b, [ob], steps=2, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_bad_options_are_one_line():
    with pytest.raises(ValueError, match="ns_dtype is one of bf16, fp32"):
        Muon(cuboid.load("gpt-debug").parameters(), ns_dtype="fp8")
    with pytest.raises(ValueError, match="momentum must be in"):
        Muon(cuboid.load("gpt-debug").parameters(), momentum=1.5)


def test_the_fine_tune_loop_builds_muon_with_its_decay_groups():
    from cuboid.train.loop import make_optimizer

    model = cuboid.load("llama-debug", seed=0)
    opt = make_optimizer("muon", model, 1e-3, 0.01)
    assert isinstance(opt, Muon)
    kinds = {(g["use_muon"], g["weight_decay"], g["lr"]) for g in opt.param_groups}
    assert (True, 0.01, 1e-3) in kinds and (False, 0.0, 1e-3) in kinds  # norms: AdamW's, no decay
    _steps(model, [opt], steps=1)
