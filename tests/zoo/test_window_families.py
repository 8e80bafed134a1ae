"""Qwen3, Gemma 3 and the sliding windows beyond HF parity: LoRA adapters by role that peft reads, a sliding
layer's generation cache holding only its window, and the per-layer options the configs set."""
import pytest
import torch

import cuboid
from cuboid import zoo
from cuboid.zoo import lora as zlora
from cuboid.zoo.generation import CachedAttention

from .hf_cases import CASES, make_hf

peft = pytest.importorskip("peft")

ROLES = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.mark.parametrize("name", ["Qwen3ForCausalLM", "Gemma3ForCausalLM"])
def test_peft_reads_adapters_on_every_role(tmp_path, name):
    """Adapters on q/k/v/o/gate/up/down, trained two steps, saved in peft's layout: peft's logits on the
    transformers model equal cuboid's (1e-5)."""
    hf = make_hf(name)
    folder = tmp_path / "base"
    hf.save_pretrained(folder)
    model = cuboid.load(folder, lora=dict(r=2, alpha=4, targets=ROLES))
    adapted = {p.rsplit(".", 2)[-2] + "." + p.rsplit(".", 1)[-1] for p, _ in cuboid.parallel.lora.adapted(model)}
    assert adapted == {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.gate", "mlp.up", "mlp.proj"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path / "adapters"
    zlora.save_adapters(model.eval(), out, base=str(folder))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(CASES[name][0].from_pretrained(folder).eval(), out).eval()
        ref = theirs(input_ids=ids).logits
    assert {m.rsplit(".", 1)[-1] for m in theirs.peft_config["default"].target_modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5


def test_sliding_cache_keeps_only_its_window():
    """After 20 new tokens a sliding layer's cache holds window - 1 keys, a global layer's every token."""
    model = cuboid.load("gemma3-debug", seed=0).eval()
    window = model.config.sliding_window
    cores = []

    def spy(tokens):
        if not cores:
            cores.extend(m for m in model.modules() if isinstance(m, CachedAttention))

    ids = torch.randint(1, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=20, streamer=spy)
    kept = {c.window: c.k.shape[2] for c in cores}
    assert kept == {window: window - 1, None: 12 + 20 - 1}  # the last new token is never fed back


def test_layer_options_follow_the_config():
    """Gemma 3: sliding layers rotate with the local base, unscaled; global layers with rope_theta and its
    scaling, and no window. Qwen3: q/k norms over head_dim, which is apart from dim / heads."""
    c = zoo.config_of("gemma3-debug", layer_types=("sliding_attention", "full_attention"),
                      rope_scaling={"rope_type": "linear", "factor": 8.0})
    model = zoo.build(c)
    local, glob = (b.attn for b in model.blocks)
    assert (local.core.window, local.rope.theta, local.rope.scaling) == (c.sliding_window, c.rope_local_theta, None)
    assert (glob.core.window, glob.rope.theta, glob.rope.scaling["factor"]) == (None, c.rope_theta, 8.0)
    q = zoo.build("qwen3-debug").blocks[0].attn
    assert q.q.out_features == 4 * 24 != q.q.in_features and q.q_norm.weight.shape == (24,)
    with pytest.raises(ValueError, match="layer_types must list"):
        zoo.config_of("gemma3-debug", layer_types=("sliding_attention",))
