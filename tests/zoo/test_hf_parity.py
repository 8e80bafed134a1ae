"""HF parity: zoo models load local transformers folders and match them.

For every supported architecture: logits (and loss) match in fp32 within 1e-5
relative, every gradient within 1e-4 relative, `to_hf` round-trips bit-exactly,
and transformers loads what `to_hf` wrote to the same logits.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

import cuboid
from cuboid import zoo
from cuboid.zoo import checkpoint

from .hf_cases import CASES, hf_outputs, make_batch, make_hf


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def valid_positions(name, batch, t):
    """Compare only real tokens: HF and cuboid may differ on padded query rows."""
    if "attention_mask" in batch and t.dim() == 3:
        return t[batch["attention_mask"].bool()]
    return t


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    name = request.param
    hf = make_hf(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, max_shard_size="20KB")  # several shards
    return name, hf, folder


def test_sharded_hf_save_loads_and_logits_match(case):
    name, hf, folder = case
    assert (folder / "model.safetensors.index.json").is_file()
    model = cuboid.load(folder).eval()
    batch = make_batch(name)
    with torch.no_grad():
        ref_logits, ref_loss = hf_outputs(hf, batch)
        out = model(**batch)
    a, b = valid_positions(name, batch, out.logits), valid_positions(name, batch, ref_logits)
    assert a.shape == b.shape
    assert rel_err(a, b) < 1e-5
    if ref_loss is not None:
        assert out.loss is not None
        assert abs(out.loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())


def _grads_by_hf_name(module, save, tmp_path):
    """Swap grads in for parameters and save, so HF's own writer names them."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    save(module, tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


def test_gradients_match(case, tmp_path):
    name, hf, folder = case
    model = cuboid.load(folder).train()
    hf_local = CASES[name][0].from_pretrained(folder).train()
    batch = make_batch(name)
    for m, out in ((model, model(**batch).logits), (hf_local, hf_outputs(hf_local, batch)[0])):
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        if "attention_mask" in batch and out.dim() == 3:
            upstream = upstream * batch["attention_mask"].unsqueeze(-1)
        (out * upstream).sum().backward()
    hf_grads = _grads_by_hf_name(hf_local, lambda m, p: m.save_pretrained(p), tmp_path / "hf")
    zoo_grads = _grads_by_hf_name(model, zoo.to_hf, tmp_path / "zoo")
    assert set(zoo_grads) <= set(hf_grads)
    # relative to each tensor's largest gradient, floored at 1e-3 of the model's
    # largest: a gradient that is zero in exact arithmetic (the key bias under
    # softmax) is pure rounding noise in both implementations
    scale = max(g.abs().max().item() for g in hf_grads.values())
    for key, gz in zoo_grads.items():
        gh = hf_grads[key]
        denom = max(gh.abs().max().item(), 1e-3 * scale)
        assert (gz - gh).abs().max().item() / denom < 1e-4, key


def test_to_hf_round_trip_is_bit_exact_and_loads_in_transformers(case, tmp_path):
    name, hf, folder = case
    model = cuboid.load(folder).eval()
    zoo.to_hf(model, tmp_path)
    written = load_file(str(tmp_path / "model.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    original = {}
    for shard in sorted(set(index["weight_map"].values())):
        original.update(load_file(str(folder / shard)))
    for key, t in written.items():
        assert torch.equal(t, original[key]), key
    cls = CASES[name][0]
    back = cls.from_pretrained(tmp_path).eval()
    batch = make_batch(name)
    with torch.no_grad():
        a = valid_positions(name, batch, hf_outputs(back, batch)[0])
        b = valid_positions(name, batch, hf_outputs(hf, batch)[0])
    assert torch.equal(a, b)
    reloaded = cuboid.load(tmp_path)
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), reloaded.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                      "model_type": "t5"}))
    with pytest.raises(ValueError, match="unsupported architecture T5ForConditionalGeneration; supported: Bert"):
        cuboid.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM needs 'num_attention_heads', which it lacks"):
        cuboid.load(tmp_path)


def test_llama_family_configs_refused_in_one_sentence(tmp_path):
    """Another rope type, another activation, Gemma's attention softcap or bidirectional attention: refused by
    name; a sliding window of any length is read (every layer's for Mistral, Qwen's from max_window_layers)."""
    base = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 97, "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64}
    gemma = {**base, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "head_dim": 16}
    cases = [({"sliding_window": None, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
              "rope_scaling of type 'longrope' is not supported"),
             ({"sliding_window": None, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
             ({**gemma, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
             ({**gemma, "use_bidirectional_attention": True}, "use_bidirectional_attention=True is not supported"),
             ({**gemma, "hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported")]
    for extra, message in cases:
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ValueError, match=message):
            cuboid.load(tmp_path)
    from cuboid.zoo.llama.hf import config_from_hf

    mistral = config_from_hf({**base, "sliding_window": 16}, "MistralForCausalLM")  # checked on meta
    assert [mistral.window_of(i) for i in range(2)] == [16, 16]
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 3, "sliding_window": 8}
    assert config_from_hf(qwen, "Qwen2ForCausalLM").window_of(2) is None  # use_sliding_window off
    on = config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1}, "Qwen2ForCausalLM")
    assert [on.window_of(i) for i in range(3)] == [None, 8, 8]
    old_gemma = config_from_hf({**gemma, "num_hidden_layers": 7, "sliding_window": 4, "rope_theta": 1e6,
                                "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                               "Gemma3ForCausalLM")  # the Hub's config keys: a pattern of 6, no layer_types
    assert [old_gemma.window_of(i) for i in range(7)] == [4] * 5 + [None, 4]
    assert (old_gemma.rope_theta, old_gemma.rope_local_theta, old_gemma.rope) == (1e6, 1e4, {"rope_type": "linear",
                                                                                             "factor": 8.0})


def test_mismatched_weights_name_key_and_shapes(tmp_path):
    hf = make_hf("GPT2LMHeadModel")
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["n_positions"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"transformer\.wpe\.weight \(-> pos_emb\.weight\): "
                                         r"checkpoint \(32, 48\) torch\.float32, model \(16, 48\) torch\.float32"):
        cuboid.load(tmp_path)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    hf = make_hf("BertForSequenceClassification")
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors.pop("classifier.bias")
    tensors["bert.extra.weight"] = torch.zeros(2)
    from safetensors.torch import save_file
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing: classifier\.bias; unexpected: bert\.extra\.weight"):
        cuboid.load(tmp_path)
    model = zoo.build(zoo.config_of("bert-debug", head="cls", dim=48, n_heads=4, mlp_hidden=96,
                                    vocab_size=97, n_positions=32, num_labels=2), device="cpu")
    problems = checkpoint.load(model, tmp_path, strict=False)
    assert problems["missing"] == ["classifier.bias"] and problems["unexpected"] == ["bert.extra.weight"]
    # a fresh model: what fits is read, what the folder lacks is initialised (zero bias), not garbage
    loaded = zoo.from_hf(tmp_path, strict=False)
    assert not loaded.classifier.bias.any()
    assert torch.equal(loaded.classifier.weight, tensors["classifier.weight"])


def test_folder_without_weights_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        cuboid.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2Model"], "vocab_size": 5,
                                                      "n_positions": 4, "n_embd": 8, "n_layer": 1, "n_head": 2}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only PyTorch .bin weights"):
        cuboid.load(tmp_path)
