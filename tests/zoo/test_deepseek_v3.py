"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: logits, loss and router logits with padding, gradients,
``to_hf`` bit-exact, greedy generation on left-padded prompts, the latent cache's size, the preset's parameter
count on meta, and the correction bias's update rule.

Two tiny random models: MLA with the q low-rank path and YaRN (mscale, mscale_all_dim), and MLA without it (a
plain q projection, default RoPE, biases, pairs not interleaved); both with 8 routed experts in 4 groups (top 2
groups), a shared expert, a dense first layer and a non-zero correction bias.
"""
import pytest
import torch
import transformers as T

import cuboid
from cuboid import zoo
from cuboid.zoo.deepseek.mla import LatentCache
from cuboid.zoo.deepseek.moe import routers, update_routing_bias

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.8}
BASE = dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
            kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, num_nextn_predict_layers=0)
CONFIGS = {
    "q-lora+yarn": dict(q_lora_rank=24, rope_parameters=YARN),
    "q-proj+bias": dict(q_lora_rank=None, attention_bias=True, rope_interleave=False, norm_topk_prob=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}


def make_hf(name):
    torch.manual_seed(0)
    hf = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(**BASE, **CONFIGS[name])).eval()
    with torch.no_grad():  # randomise everything (norms, biases) and the correction biases (buffers)
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.randn_like(m.e_score_correction_bias) * 0.1)
    return hf


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    name = request.param
    hf = make_hf(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return name, hf, folder, cuboid.load(folder).eval()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_loss_router_logits_and_gradients_match_transformers(pair, tmp_path):
    _, hf, folder, model = pair
    ids, mask, labels = batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
        got = model(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    keep = mask.bool()
    assert rel(got.logits[keep], want.logits[keep]) < 1e-5
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * abs(want.loss.item())
    assert len(got.router_logits) == len(want.router_logits) == 2  # the sparse layers (the first is dense)
    for a, b in zip(got.router_logits, want.router_logits):
        assert a.dtype == b.dtype == torch.float32 and rel(a, b.reshape(a.shape)) < 1e-5
    assert got.aux_loss is None and want.aux_loss is None  # DeepSeek-V3 balances by the bias, not a loss
    # gradients, by HF name (the correction bias is not differentiated on either side)
    train = cuboid.load(folder).train()
    hf_train = T.DeepseekV3ForCausalLM.from_pretrained(folder).train()
    train(ids, attention_mask=mask, labels=labels).loss.backward()
    hf_train(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert all(r.bias.grad is None and not r.bias.requires_grad for r in routers(train))
    for m, save, out in ((hf_train, lambda m, p: m.save_pretrained(p), tmp_path / "hf"),
                         (train, zoo.to_hf, tmp_path / "zoo")):
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        save(m, out)
    from safetensors.torch import load_file
    hg = load_file(str(tmp_path / "hf" / "model.safetensors"))
    zg = load_file(str(tmp_path / "zoo" / "model.safetensors"))
    scale = max(g.abs().max().item() for g in hg.values())
    for key, g in zg.items():
        if key.endswith("e_score_correction_bias"):
            continue
        assert (g - hg[key]).abs().max().item() / max(hg[key].abs().max().item(), 1e-3 * scale) < 1e-4, key


def test_to_hf_is_bit_exact_and_transformers_loads_it(pair, tmp_path):
    _, hf, folder, model = pair
    zoo.to_hf(model, tmp_path)
    from safetensors.torch import load_file
    written, original = load_file(str(tmp_path / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert set(written) == set(original)
    for key, t in written.items():
        assert torch.equal(t, original[key]), key
    back = T.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(back(input_ids=ids, attention_mask=mask).logits, want)


def prompts():
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17], [0, 0, 0, 21, 22, 23, 24], [0, 31, 32, 33, 34, 35, 36]])
    return ids, (ids != 0).long()


def test_greedy_generation_equals_transformers_and_the_cache_holds_the_latent(pair):
    _, hf, _, model = pair
    ids, mask = prompts()
    new = 6
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    caches = []
    original = LatentCache.forward

    def spy(self, *args, **kwargs):  # the cores generation swapped in
        caches.append(self)
        return original(self, *args, **kwargs)

    LatentCache.forward = spy
    try:
        got = model.generate(ids, mask, max_new_tokens=new)
    finally:
        LatentCache.forward = original
    assert torch.equal(got, want)
    c = model.config
    cores = {id(x): x for x in caches}.values()
    assert len(cores) == c.n_layers
    tokens = ids.shape[1] + new - 1  # the prompt and every new token but the last (never fed back)
    assert sum(x.numel() for x in cores) == c.n_layers * ids.shape[0] * tokens * (c.kv_lora_rank + c.qk_rope_head_dim)


def test_preset_counts_what_transformers_counts_on_meta():
    from cuboid.zoo.families import shape_of

    with torch.device("meta"):
        hf = T.DeepseekV3ForCausalLM(T.DeepseekV3Config())  # transformers' defaults are DeepSeek-V3's shapes
    shape = shape_of(zoo.config_of("deepseek-v3"))
    assert shape.parameters == sum(p.numel() for p in hf.parameters())
    c = zoo.config_of("deepseek-v3")
    idle = 58 * (256 - 8) * 3 * 7168 * 2048  # 58 sparse layers, 248 idle experts of three 7168 x 2048 matrices
    assert shape.active_parameters == shape.parameters - idle == shape.parameters - c.inactive_parameters


def test_bias_update_moves_toward_balance_and_is_not_trained():
    model = zoo.materialize(zoo.build("deepseek-v3-debug"), seed=0).train()
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(ids, labels=ids).loss.backward()
    opt.step()
    before = [r.bias.clone() for r in routers(model)]
    loads = [r.load.clone() for r in routers(model)]
    assert all(float(load.sum()) == 4 * 16 * model.config.experts_per_token for load in loads)
    update_routing_bias(model, 0.01)
    for r, b, load in zip(routers(model), before, loads):
        want = b + 0.01 * torch.sign(load.mean() - load)  # under-loaded experts up, over-loaded down
        assert torch.equal(r.bias, want) and r.load is None
        assert (r.bias > b).any() and (r.bias < b).any()
    update_routing_bias(model, 0.01)  # nothing routed since: the loads are equal (zero), the bias stays
    assert all(torch.equal(r.bias, b + 0.01 * torch.sign(load.mean() - load))
               for r, b, load in zip(routers(model), before, loads))


def test_peft_reads_lora_adapters_on_the_latent_attention(pair, tmp_path):
    """Adapters on every attention projection (q or q_a/q_b, kv_a, kv_b, o: peft's names), trained a step and
    saved in peft's layout: peft's logits on the transformers model equal cuboid's (1e-5)."""
    from cuboid.zoo import lora as zlora

    peft = pytest.importorskip("peft")
    name, _, folder, _ = pair
    model = cuboid.load(folder, lora=dict(r=2, alpha=4, targets=("attn",)))
    adapted = {p.split(".", 2)[-1] for p, _ in cuboid.parallel.lora.adapted(model)}
    want = {"attn.q"} if name == "q-proj+bias" else {"attn.q_a", "attn.q_b"}
    assert adapted == want | {"attn.kv_a", "attn.kv_b", "attn.proj"}
    ids, mask, labels = batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    opt.step()
    out = tmp_path / "adapters"
    zlora.save_adapters(model.eval(), out, base=str(folder))
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        theirs = peft.PeftModel.from_pretrained(T.DeepseekV3ForCausalLM.from_pretrained(folder).eval(), out).eval()
        ref = theirs(input_ids=ids, attention_mask=mask).logits
    assert rel(ours[mask.bool()], ref[mask.bool()]) < 1e-5
