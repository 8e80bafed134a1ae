"""Zoo models on their own: presets on meta, training, the kernel paths, bad input."""
import pytest
import torch
import transformers as T

import cuboid
from cuboid import kernels, zoo

HF_CLASSES = {
    "gpt": (T.GPT2Config, {"lm": T.GPT2LMHeadModel, "cls": T.GPT2ForSequenceClassification, "none": T.GPT2Model}),
    "bert": (T.BertConfig, {"mlm": T.BertForMaskedLM, "cls": T.BertForSequenceClassification, "none": T.BertModel}),
    "vit": (T.ViTConfig, {"cls": T.ViTForImageClassification, "none": T.ViTModel}),
    "llama": ({"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "mistral": T.MistralConfig, "qwen3": T.Qwen3Config,
               "gemma3": T.Gemma3TextConfig, "qwen3_moe": T.Qwen3MoeConfig, "mixtral": T.MixtralConfig,
               "olmoe": T.OlmoeConfig, "gpt_oss": T.GptOssConfig},
              {"lm": {"llama": T.LlamaForCausalLM, "qwen2": T.Qwen2ForCausalLM, "mistral": T.MistralForCausalLM,
                      "qwen3": T.Qwen3ForCausalLM, "gemma3": T.Gemma3ForCausalLM,
                      "qwen3_moe": T.Qwen3MoeForCausalLM, "mixtral": T.MixtralForCausalLM, "olmoe": T.OlmoeForCausalLM,
                      "gpt_oss": T.GptOssForCausalLM}}),
    "deepseek": (T.DeepseekV3Config, {"lm": T.DeepseekV3ForCausalLM}),
}


@pytest.mark.parametrize("preset", [p for p in zoo.PRESETS if "debug" not in p])
def test_preset_builds_on_meta_with_hf_parameter_count(preset):
    model = zoo.build(preset)
    assert all(p.device.type == "meta" for p in model.parameters())
    fam = zoo.family_of(model)
    cfg_cls, classes = HF_CLASSES[fam.name]
    cls = classes[model.config.head]
    if fam.name == "llama":  # one zoo family, five HF architectures
        cfg_cls, cls = cfg_cls[model.config.arch], cls[model.config.arch]
    hf_cfg = cfg_cls(**fam.config_to_hf(model.config))
    with torch.device("meta"):
        hf = cls(hf_cfg)
    # DeepSeek-V3's correction biases: parameters here (frozen), buffers in transformers
    uncounted = getattr(model.config, "uncounted_parameters", 0)
    assert zoo.count_parameters(model) - uncounted == sum(p.numel() for p in hf.parameters())


def test_gpt2_xl_parameter_count():
    model = cuboid.load("gpt2-xl", device="meta")
    assert zoo.count_parameters(model) == 1_557_611_200
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("preset,count", [("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496),
                                          ("llama3.2-1b", 1_235_814_400), ("qwen2.5-0.5b", 494_032_768),
                                          ("qwen2.5-7b", 7_615_616_512), ("mistral-7b", 7_248_023_552),
                                          ("qwen3-0.6b", 596_049_920), ("qwen3-8b", 8_190_735_360),
                                          ("gemma-3-1b", 999_885_952)])
def test_llama_family_parameter_counts(preset, count):
    """The published sizes (the model cards' counts), on meta."""
    model = cuboid.load(preset, device="meta")
    assert zoo.count_parameters(model) == count
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("preset", list(zoo.PRESETS))
def test_every_preset_loads(preset):
    """Debug presets materialise and run; the real sizes load on meta and run a meta forward."""
    device = "cpu" if "debug" in preset else "meta"
    model = cuboid.load(preset, device=device)
    batch = {k: v.to(device) for k, v in batch_for(preset, model).items()}
    out = model(**batch)
    assert out.loss is not None and out.loss.shape == ()


def batch_for(name, model):
    g = torch.Generator().manual_seed(0)
    c = model.config
    if name.startswith("vit"):
        return {"pixel_values": torch.randn(8, 3, c.image_size, c.image_size, generator=g),
                "labels": torch.randint(0, c.num_labels, (8,), generator=g)}
    ids = torch.randint(0, c.vocab_size, (4, 16), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("name", ["gpt-debug", "bert-debug", "vit-debug", "llama-debug", "qwen3-debug",
                                  "gemma3-debug"])
def test_tiny_model_trains(name):
    """20 AdamW steps on one fixed batch: the loss falls to under half its start."""
    model = cuboid.load(name, seed=1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = batch_for(name, model)
    losses = []
    for _ in range(20):
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_init_is_seeded_and_per_parameter():
    a, b, c = cuboid.load("gpt-debug", seed=3), cuboid.load("gpt-debug", seed=3), cuboid.load("gpt-debug", seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.std() > 0:
            assert not torch.equal(pa, pc), n
    # GPT-2 scaling of the residual projections
    proj = a.blocks[0].attn.proj.weight
    assert abs(proj.std().item() - 0.02 / (2 * a.config.n_layers) ** 0.5) < 0.004
    # init depends on the parameter's name, not on its neighbours: a deeper model
    # shares its first block with a shallower one
    deep = cuboid.load("gpt-debug", seed=3, n_layers=3)
    assert torch.equal(deep.blocks[1].mlp.fc.weight, a.blocks[1].mlp.fc.weight)


def test_triton_kernels_compose_in_a_model():
    """The interpreter's attention and layer norm give the torch path's loss and grads."""
    model = cuboid.load("gpt-debug", seed=0, n_layers=1, dim=32, n_heads=2, vocab_size=64, n_positions=16)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for backend in ("torch", "triton"):
        model.zero_grad()
        with kernels.use_backend(backend):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    for a, b in zip(g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset 'gpt3'; presets: gpt-debug"):
        cuboid.load("gpt3")
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        cuboid.load("./nowhere")
    with pytest.raises(ValueError, match="sequence parallelism \\(sp=2\\) does not combine with tp_mode 2d"):
        cuboid.load("gpt-debug", plan="sp=2,tp=4,tp_mode=2d")
    with pytest.raises(ValueError, match="needs dp\\*pp\\*tp\\*sp = 2 processes, but the world size is 1"):
        cuboid.load("gpt-debug", plan="sp=2")
    with pytest.raises(ValueError, match="needs dp\\*pp\\*tp\\*sp = 2 processes, but the world size is 1"):
        cuboid.load("gpt-debug", plan="pp2")
    with pytest.raises(ValueError, match="needs dp\\*pp\\*tp\\*sp = 4 processes, but the world size is 1"):
        cuboid.load("gpt-debug", plan="tp2d")
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        zoo.build("gpt-debug", n_heads=5)
    gpt = cuboid.load("gpt-debug")
    with pytest.raises(ValueError, match="exceeds n_positions 128"):
        gpt(input_ids=torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(IndexError, match=r"ids must lie in \[0, 512\)"):
        gpt(input_ids=torch.full((1, 4), 600))
    with pytest.raises(IndexError, match=r"label 700 outside \[0, 512\)"):
        gpt(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.full((1, 4), 700))
    vit = cuboid.load("vit-debug")
    with pytest.raises(ValueError, match=r"pixel_values must be \(B, 3, 32, 32\)"):
        vit(pixel_values=torch.zeros(1, 3, 16, 16))


def test_chunked_cross_entropy_matches_torch():
    from cuboid.parallel.head import cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (37,), generator=g)
    labels[::5] = -100
    ours = cross_entropy(logits, labels, chunk=8)
    ref = torch.nn.functional.cross_entropy(logits, labels)
    ga, = torch.autograd.grad(ours, logits)
    gb, = torch.autograd.grad(ref, logits)
    assert torch.allclose(ours, ref, rtol=1e-12) and torch.allclose(ga, gb, rtol=1e-10, atol=1e-14)
    half = logits.detach().to(torch.float16).requires_grad_()
    loss = cross_entropy(half, labels, chunk=8)
    loss.backward()
    full = half.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full, labels)
    ref.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) < 1e-6
    assert half.grad.dtype == torch.float16
    assert torch.allclose(half.grad.float(), full.grad, atol=1e-3, rtol=1e-3)
