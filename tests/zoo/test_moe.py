"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) against transformers, fp32: a folder written by transformers'
save_pretrained loads; logits, router logits, the auxiliary loss and the loss match (1e-5), gradients 1e-4;
to_hf writes the same tensors bit for bit and transformers loads them; greedy generation is token for token
transformers'; the presets count the published parameters."""
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import cuboid
from cuboid import zoo
from cuboid.parallel import moe
from cuboid.cli.convert import main as convert_main
from cuboid.zoo.llama.config import PRESETS
from cuboid.zoo.llama.hf import architecture_of, config_from_hf, config_to_hf
from cuboid.zoo.llama.model import Llama

from .hf_cases import MOE_CASES, make_hf
from .test_hf_parity import _grads_by_hf_name, rel_err

NEW = 24


def tokens(rows=3, length=7, seed=1):
    return torch.randint(1, 97, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(MOE_CASES))
def case(request, tmp_path_factory):
    name = request.param
    hf = make_hf(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, max_shard_size="40KB")  # several shards, experts one tensor each
    return name, hf, folder


def test_logits_router_logits_and_losses_match_transformers(case):
    name, hf, folder = case
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.5." in k for k in stored)  # transformers 5.25 writes one tensor per expert
    model = cuboid.load(folder).eval()
    ids = tokens()  # unpadded: transformers 5.25's MoE loss fails when given a mask
    with torch.no_grad():
        want = hf(input_ids=ids, labels=ids, output_router_logits=True)
        got = model(input_ids=ids, labels=ids, output_router_logits=True)
        plain = model(input_ids=ids, labels=ids)
    assert rel_err(got.logits, want.logits) < 1e-5
    assert len(got.router_logits) == len(want.router_logits) == len(model.config.sparse_layers) >= 2
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.shape == b.shape == (21, 6) and rel_err(a, b) < 1e-5
    assert abs(got.aux_loss.item() - want.aux_loss.item()) <= 1e-5 * want.aux_loss.item()
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    # without output_router_logits the aux loss is reported but not added (transformers')
    coef = model.config.router_aux_loss_coef
    assert plain.router_logits is None
    assert abs(plain.loss.item() + coef * plain.aux_loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()


def test_gradients_match(case, tmp_path):
    name, hf, folder = case
    model = cuboid.load(folder).train()
    hf_local = MOE_CASES[name][0].from_pretrained(folder).train()
    ids = tokens()
    upstream = torch.randn(3, 7, 97, generator=torch.Generator().manual_seed(5))
    for m in (model, hf_local):
        out = m(input_ids=ids, labels=ids, output_router_logits=True)
        (out.loss + (out.logits * upstream).sum()).backward()  # the router's gradient through the aux loss too
    hf_grads = _grads_by_hf_name(hf_local, lambda m, p: m.save_pretrained(p), tmp_path / "hf")
    zoo_grads = _grads_by_hf_name(model, zoo.to_hf, tmp_path / "zoo")
    assert set(zoo_grads) == set(hf_grads)
    assert any(k.endswith("gate.weight") and "experts" not in k for k in zoo_grads)
    # each tensor's error relative to its largest gradient, floored at 1e-3 of the model's largest (rounding)
    floor = torch.tensor(1e-3 * max(g.abs().max().item() for g in hf_grads.values()))
    worst = {k: ((zoo_grads[k] - g).abs().max() / torch.maximum(g.abs().max(), floor)).item()
             for k, g in hf_grads.items()}
    assert max(worst.values()) < 1e-4, worst


def test_to_hf_round_trip_is_bit_exact_and_loads_in_transformers(case, tmp_path):
    name, hf, folder = case
    model = cuboid.load(folder).eval()
    zoo.to_hf(model, tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    original = {}
    for shard in sorted(set(index["weight_map"].values())):
        original.update(load_file(str(folder / shard)))
    assert set(written) == set(original)
    for key, t in written.items():
        assert torch.equal(t, original[key]), key
    back = MOE_CASES[name][0].from_pretrained(tmp_path / "out").eval()
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)
    # cuboid convert copies the per-expert names through: the converted folder loads in both
    assert convert_main(["convert", str(tmp_path / "out"), str(tmp_path / "bf16"), "--dtype", "bf16", "--quiet"]) == 0
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values())
    down = cuboid.load(tmp_path / "bf16").blocks[0].mlp.experts.down
    assert torch.equal(down, model.blocks[0].mlp.experts.down.to(torch.bfloat16).to(down.dtype))
    MOE_CASES[name][0].from_pretrained(tmp_path / "bf16")


def test_greedy_generation_equals_transformers(case):
    name, hf, folder = case
    model = cuboid.load(folder)
    ids = tokens(seed=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    got = model.generate(ids, mask, max_new_tokens=NEW)
    assert got.shape == want.shape == (3, 7 + NEW)
    assert torch.equal(got, want), (name, (got != want).sum().item())


def _aux_float64(router_logits, keep, k, n_experts):
    """The load-balancing loss of the kept tokens, in float64: fraction of top-k choices per expert times mean
    probability per expert, over (layer, token) pairs."""
    counts = torch.zeros(n_experts, dtype=torch.float64)
    probs = torch.zeros(n_experts, dtype=torch.float64)
    rows = 0.0
    for logits in router_logits:
        p = torch.softmax(logits.double(), -1)[keep]
        for choice in p.topk(k, -1).indices.reshape(-1):
            counts[choice] += 1
        probs += p.sum(0)
        rows += p.shape[0]
    return n_experts * (counts / rows * probs / rows).sum().item()


def test_masked_aux_loss_counts_only_the_tokens(case):
    """With padding the loss weighs each token by the mask: equal to the float64 formula on the kept tokens,
    and to transformers' unmasked loss on the rows run one by one at their own length."""
    name, hf, folder = case
    model = cuboid.load(folder).eval()
    c = model.config
    ids, mask = tokens(), torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 6:] = 0
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        rows = [model(input_ids=ids[i:i + 1, :int(mask[i].sum())], output_router_logits=True) for i in range(3)]
    want = _aux_float64(out.router_logits, mask.reshape(-1).bool(), c.experts_per_token, c.n_experts)
    assert abs(out.aux_loss.item() - want) <= 1e-6 * want
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    per_layer = tuple(torch.cat([r.router_logits[layer] for r in rows]) for layer in range(len(rows[0].router_logits)))
    unmasked = load_balancing_loss_func(per_layer, c.n_experts, c.experts_per_token)
    assert abs(out.aux_loss.item() - unmasked.item()) <= 1e-5 * unmasked.item()


PUBLISHED = {"qwen3-30b-a3b": 30_532_122_624, "mixtral-8x7b": 46_702_792_704, "olmoe-1b-7b": 6_919_161_856}


@pytest.mark.parametrize("preset", [*PUBLISHED, "qwen3-moe-debug", "mixtral-debug", "olmoe-debug"])
def test_presets_count_the_published_parameters_and_transformers(preset):
    c = PRESETS[preset]
    d = config_to_hf(c)
    with torch.device("meta"):
        ours = sum(p.numel() for p in Llama(c).parameters())
        hf = getattr(T, architecture_of(c))(T.AutoConfig.for_model(d.pop("model_type"), **d))
        theirs = sum(p.numel() for p in hf.parameters())
    assert ours == theirs == PUBLISHED.get(preset, ours)
    assert config_from_hf(config_to_hf(c), architecture_of(c)) == c
    per_expert = 3 * c.dim * c.expert_hidden
    assert c.inactive_parameters == len(c.sparse_layers) * (c.n_experts - c.experts_per_token) * per_expert


def test_sparse_layers_follow_step_and_dense_list():
    d = {**config_to_hf(PRESETS["qwen3-moe-debug"]), "num_hidden_layers": 6, "decoder_sparse_step": 2,
         "mlp_only_layers": [3]}
    c = config_from_hf(d, "Qwen3MoeForCausalLM")
    assert c.sparse_layers == (1, 5)
    with torch.device("meta"):
        model = Llama(c)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["GatedMLP", "SparseMLP", "GatedMLP", "GatedMLP",
                                                            "GatedMLP", "SparseMLP"]
    for preset, arch, bad in [("mixtral-debug", "MixtralForCausalLM", {"router_jitter_noise": 0.1}),
                              ("olmoe-debug", "OlmoeForCausalLM", {"clip_qkv": 8.0}),
                              ("olmoe-debug", "OlmoeForCausalLM", {"hidden_act": "gelu"})]:
        with pytest.raises(ValueError, match=f"{arch} .*{next(iter(bad.values()))!r} is not supported"):
            config_from_hf({**config_to_hf(PRESETS[preset]), **bad}, arch)
    with pytest.raises(ValueError, match="experts_per_token must be between 1 and n_experts 8, got 9"):
        PRESETS["olmoe-debug"].replace(experts_per_token=9)
    with pytest.raises(ValueError, match="mlp_only_layers must be layer indices below n_layers 2"):
        PRESETS["qwen3-moe-debug"].replace(mlp_only_layers=(2,))


def test_init_draws_router_and_experts_from_the_normal():
    model = Llama(PRESETS["olmoe-debug"].replace(init_std=0.05))
    model.init_weights(seed=3)
    mlp = model.blocks[1].mlp
    for p in (mlp.router.weight, mlp.experts.gate_up, mlp.experts.down):
        assert abs(p.std().item() - 0.05) < 0.005 and abs(p.mean().item()) < 0.005
    assert torch.equal(model.blocks[0].attn.q_norm.weight, torch.ones(4 * 16))  # OLMoE's full-width q norm


def _experts_float64(x, gate_up, down, weights, experts):
    """The experts' output token by token in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    hidden = down.shape[-1]
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], experts[t]):
            h = gate_up[e].double() @ x[t].double()
            out[t] += w.double() * (down[e].double() @ (torch.nn.functional.silu(h[:hidden]) * h[hidden:]))
    return out


def test_experts_with_empty_experts_match_float64_and_have_zero_gradients_there():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g, requires_grad=True)
    layer = moe.Experts(8, 6, 4)
    with torch.no_grad():
        layer.gate_up.copy_(torch.randn(4, 12, 8, generator=g))
        layer.down.copy_(torch.randn(4, 8, 6, generator=g))
    experts = torch.tensor([[3, 0], [0, 3], [3, 0], [0, 3], [3, 0]])  # experts 1 and 2 get no token
    weights = torch.rand(5, 2, generator=g)
    y = layer(x, weights, experts)
    want = _experts_float64(x.detach(), layer.gate_up.detach(), layer.down.detach(), weights, experts)
    assert (y.double() - want).abs().max().item() < 1e-5 * want.abs().max().item()
    y.sum().backward()
    assert not layer.gate_up.grad[1:3].any() and not layer.down.grad[1:3].any()
    assert layer.gate_up.grad[0].abs().sum() > 0 and layer.down.grad[3].abs().sum() > 0


def test_balance_loss_is_transformers_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    layers = tuple(torch.randn(10, 6, generator=torch.Generator().manual_seed(i)) for i in range(3))
    stats = [moe.balance_stats(logits, 2) for logits in layers]
    counts, probsum, tokens = (sum(s[i] for s in stats) for i in range(3))
    assert tokens.item() == 30 and counts.sum().item() == 60
    got = moe.balance_loss(counts, probsum, tokens, 6)
    assert abs(got.item() - load_balancing_loss_func(layers, 6, 2).item()) < 1e-6


@pytest.mark.parametrize("cls,name", [(T.Qwen3MoeConfig, "Qwen3MoeForCausalLM"), (T.MixtralConfig, "MixtralForCausalLM"),
                                      (T.OlmoeConfig, "OlmoeForCausalLM")])
def test_absent_config_keys_take_transformers_defaults(cls, name):
    base = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24,
                moe_intermediate_size=24)
    hf = cls(**base)
    c = config_from_hf({**base, "num_experts": 8, "num_local_experts": 8}, name)
    assert (c.experts_per_token, c.norm_topk_prob, c.router_aux_loss_coef, c.output_router_logits) == \
        (hf.num_experts_per_tok, getattr(hf, "norm_topk_prob", True), hf.router_aux_loss_coef, hf.output_router_logits)
