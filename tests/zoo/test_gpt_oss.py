"""gpt-oss against transformers' GptOssForCausalLM: a small random folder (non-zero sinks, windows of 3 shorter than
the sequences, YaRN, 4 experts with biases, every bias non-zero) gives transformers' logits, router logits and
auxiliary loss in fp32, writes back bit-exactly, generates greedily what transformers does on left-padded prompts
longer than the window; the MXFP4 expert tensors load dequantized; the presets count what transformers counts."""
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import cuboid
from cuboid import zoo
from cuboid.zoo.llama.config import PRESETS
from cuboid.zoo.llama.gpt_oss import dequantize_mxfp4

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 20, "rope_theta": 150000.0}  # 4 x 20: max_position_embeddings


def hf_config(**kw):
    return T.GptOssConfig(vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=3, max_position_embeddings=80, rope_parameters=YARN,
                          router_aux_loss_coef=0.02, pad_token_id=0, **kw)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = T.GptOssForCausalLM(hf_config()).eval()
    with torch.no_grad():  # every parameter off its init (biases and sinks non-zero), the gates past the clamp
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    folder = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(folder)
    return hf, folder, cuboid.load(folder).eval()


def batch(padded: bool):
    ids = torch.randint(1, 97, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[2, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_logits_router_logits_and_aux_loss_match_transformers(pair):
    hf, _, ours = pair
    ids, mask = batch(padded=True)
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels)
        got = ours(ids, mask, labels=labels)
    keep = mask.bool()
    assert rel_err(got.logits[keep], want.logits[keep]) < 1e-5
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    # transformers' load-balancing loss fails with an attention mask: router outputs on an unpadded batch
    ids, _ = batch(padded=False)
    with torch.no_grad():
        want = hf(input_ids=ids, labels=ids, output_router_logits=True)
        got = ours(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 3
    for a, b in zip(got.router_logits, want.router_logits):
        assert rel_err(a, b) < 1e-5
    assert abs(got.aux_loss.item() - want.aux_loss.item()) <= 1e-5 * want.aux_loss.item()
    assert abs(got.loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()  # the coefficient's share too


def test_gradients_match_transformers(pair, tmp_path):
    """One backward on a padded batch: every gradient (the sinks', the router's and the experts' biases included)
    equals transformers', compared under transformers' names (the zoo's written by to_hf)."""
    hf, folder, _ = pair
    ours = cuboid.load(folder).train()
    ref = T.GptOssForCausalLM.from_pretrained(folder).train()
    ids, mask = batch(padded=True)
    labels = ids.masked_fill(mask == 0, -100)
    ours(ids, mask, labels=labels).loss.backward()
    ref(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with torch.no_grad():  # the gradients in the weights' places, written under transformers' names
        for p in ours.parameters():
            p.copy_(p.grad)
    zoo.to_hf(ours, tmp_path)
    got = load_file(str(tmp_path / "model.safetensors"))
    want = {k: p.grad for k, p in ref.named_parameters()}
    assert set(got) == set(want)
    # transformers' token table has padding_idx (pad_token_id 0): its row's gradient is always zero there, while the
    # zoo's table trains it like any row (the logits at the last padded position predict the first real token)
    key = "model.embed_tokens.weight"
    assert want[key][0].abs().max() == 0
    got[key], want[key] = got[key][1:], want[key][1:]
    scale = max(g.abs().max().item() for g in want.values())
    for key, g in want.items():
        assert (got[key] - g).abs().max().item() <= 1e-4 * max(g.abs().max().item(), 1e-3 * scale), key
    assert all(want[f"model.layers.{i}.self_attn.sinks"].abs().max() > 0 for i in range(3))


def test_sinks_and_windows_change_the_output(pair):
    """The parity above is not vacuous: zero sinks, or no window, give other logits."""
    _, _, ours = pair
    ids, _ = batch(padded=False)
    with torch.no_grad():
        base = ours(ids).logits
        sinks = [b.attn.sinks.weight.clone() for b in ours.blocks]
        for b in ours.blocks:
            b.attn.sinks.weight.zero_()
        no_sinks = ours(ids).logits
        for b, s in zip(ours.blocks, sinks):
            b.attn.sinks.weight.copy_(s)
    assert rel_err(no_sinks, base) > 1e-3
    assert ours.blocks[0].attn.core.window == 3 and ours.blocks[1].attn.core.window is None


def test_to_hf_is_bit_exact(pair, tmp_path):
    hf, folder, ours = pair
    zoo.to_hf(ours, tmp_path)
    written, original = load_file(str(tmp_path / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert set(written) == set(original)
    for key, t in written.items():
        assert torch.equal(t, original[key]), key
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["GptOssForCausalLM"]
    back = T.GptOssForCausalLM.from_pretrained(tmp_path).eval()  # the config written reads as the same model
    ids, mask = batch(padded=True)
    with torch.no_grad():
        a, b = back(input_ids=ids, attention_mask=mask).logits, hf(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(a[mask.bool()], b[mask.bool()])


def test_greedy_generation_equals_transformers_on_left_padded_prompts(pair):
    hf, _, ours = pair
    ids, mask = batch(padded=True)  # prompts of 9, 5 and 8 tokens, the window 3
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0,
                       eos_token_id=None)
    got = ours.generate(ids, mask, max_new_tokens=24)
    assert torch.equal(got, want), (got != want).sum().item()


def _quantize_mxfp4(w: torch.Tensor) -> tuple:
    """Random MXFP4 codes and exponents for a (E, rows, cols) tensor's shape: (blocks, scales) uint8."""
    E, rows, cols = w.shape
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 125, (E, rows, cols // 32), dtype=torch.uint8, generator=g)  # 2^-9 .. 2^-3
    return blocks, scales


def test_mxfp4_folder_loads_dequantized_as_transformers(pair, tmp_path):
    """A folder in the released layout (expert matrices as ``_blocks``/``_scales``): the zoo model's experts are
    transformers' dequantisation of them, and its logits transformers' on the dequantized weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, folder, _ = pair
    tensors = load_file(str(folder / "model.safetensors"))
    dense = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        zoo_shape = tensors.pop(key).transpose(1, 2)  # (E, rows, cols): the blocks' row layout
        blocks, scales = _quantize_mxfp4(zoo_shape)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # transformers' (E, in, out)
        assert torch.equal(dense[key], dequantize_mxfp4(blocks, scales).transpose(1, 2))
    (tmp_path / "q").mkdir()
    save_file(tensors, str(tmp_path / "q" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    ours = cuboid.load(tmp_path / "q").eval()
    ref = T.GptOssForCausalLM(hf_config()).eval()
    state = {k: v for k, v in hf.state_dict().items()}
    state.update({k: v for k, v in dense.items()})
    ref.load_state_dict(state)
    ids, mask = batch(padded=True)
    with torch.no_grad():
        a, b = ours(ids, mask).logits, ref(input_ids=ids, attention_mask=mask).logits
    assert rel_err(a[mask.bool()], b[mask.bool()]) < 1e-5
    zoo.to_hf(ours, tmp_path / "back")  # written unquantized: the experts exactly transformers' dequantisation
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    for key, t in dense.items():
        assert torch.equal(back[key], t), key


@pytest.mark.parametrize("name,layers,experts", [("gpt-oss-20b", 24, 32), ("gpt-oss-120b", 36, 128)])
def test_presets_count_what_transformers_counts_on_meta(name, layers, experts):
    from cuboid.zoo.families import shape_of

    c = PRESETS[name]
    cfg = T.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, vocab_size=201088, hidden_size=2880,
                         intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                         sliding_window=128, num_experts_per_tok=4, tie_word_embeddings=False)
    with torch.device("meta"):
        want = sum(p.numel() for p in T.GptOssForCausalLM(cfg).parameters())
    shape = shape_of(c)
    assert shape.parameters == want
    expert = 3 * 2880 * 2880 + 2 * 2880 + 2880  # gate_up, down and their biases
    assert shape.active_parameters == want - layers * (experts - 4) * expert
    assert c.layer_types == tuple(cfg.layer_types)


def test_peft_reads_lora_on_attention_and_experts(pair, tmp_path):
    """LoRA with peft's names (q/k/v/o_proj; the experts' gate_up_proj and down_proj as target_parameters, gate/up
    interleaved in lora_B as in the weight): peft on transformers gives the adapted logits, and reads back."""
    import peft

    from cuboid.zoo import lora as zlora

    hf, folder, _ = pair
    model = cuboid.load(folder, lora="r=2,alpha=4,targets=attn+experts").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B off zero, so the adapters show in the logits
        for n, p in model.named_parameters():
            if n.endswith(("lora_B.weight", "_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    out = zlora.save_adapters(model, tmp_path / "adapters", base=str(folder))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert {m.rsplit(".", 1)[1] for m in cfg["target_modules"]} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ids, mask = batch(padded=False)
    with torch.no_grad():
        ours = model(ids).logits
        plain = hf(input_ids=ids).logits
        ref = peft.PeftModel.from_pretrained(T.GptOssForCausalLM.from_pretrained(folder), out).eval()(input_ids=ids)
    assert (ours - plain).abs().max() > 1e-2
    assert rel_err(ours, ref.logits) < 1e-5
    again = cuboid.load(folder, lora=out).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ours)
