"""QLoRA end to end on CPU against transformers + bitsandbytes 0.50 + peft: ``cuboid.load(folder,
quantize="nf4")`` quantizes the blocks' linears bit-equal to what ``BitsAndBytesConfig(load_in_4bit=True,
nf4, double quant)`` holds (codes, absmax, quant_map, nested tensors, quant state), leaves embeddings, norms and
the LM head alone, gives transformers' logits (fp32 compute), and LoRA adapters trained on it are read by peft
onto the transformers + bitsandbytes base with cuboid's logits. One tiny Llama for the file."""
import json

import bitsandbytes  # noqa: F401  (a test dependency: the reference)
import pytest
import torch

import cuboid
from cuboid.parallel.quant import quantized_layers
from tests import bnb_cpu

HF_NAMES = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
            "attn.proj": "self_attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
            "mlp.proj": "mlp.down_proj"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(root, transformers' 4-bit model loaded from root/bf16): hidden 128 (tensor parallelism's row cuts hold
    whole blocks of 64), two layers, grouped-query heads; root/bnb4 is that 4-bit model saved by transformers.
    bitsandbytes' CPU kernels are its pure-torch ones where the native ones are wrong on this CPU."""
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    bnb_cpu.use_reference_kernels()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    root = tmp_path_factory.mktemp("qlora")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(root / "bf16")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    hf4 = LlamaForCausalLM.from_pretrained(root / "bf16", quantization_config=bnb, device_map="cpu",
                                           dtype=torch.float32)
    hf4.save_pretrained(root / "bnb4")
    return root, hf4


def ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def test_quantized_layers_are_bit_equal_and_logits_match(folders):
    root, hf4 = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32)
    layers = dict(quantized_layers(model))
    assert sorted(layers) == sorted(f"blocks.{i}.{n}" for i in range(2) for n in HF_NAMES)
    params = dict(model.named_parameters())
    assert not any(f"{p}.weight" in params for p in layers)  # the 4-bit weights are buffers, never parameters
    assert "tok_emb.weight" in params and "lm_head.weight" in params and "blocks.0.ln1.weight" in params
    theirs = hf4.state_dict()
    for path, layer in layers.items():
        i, name = path.split(".", 2)[1:]
        prefix = f"model.layers.{i}.{HF_NAMES[name]}.weight"
        ours = layer.nf4_weight().state_dict(prefix)
        assert set(ours) == {k for k in theirs if k.startswith(prefix)}, path
        for k, v in ours.items():
            assert v.dtype == theirs[k].dtype and torch.equal(v, theirs[k]), k
    with torch.no_grad():
        want = hf4(ids()).logits
        got = model(ids()).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_folder_saved_by_transformers_and_bitsandbytes_loads_as_it_is(folders):
    root, hf4 = folders
    assert "quantization_config" in json.loads((root / "bnb4" / "config.json").read_text())
    model = cuboid.load(root / "bnb4", dtype=torch.float32)  # no quantize=: the folder says it is 4-bit
    ref = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32)
    refs = dict(quantized_layers(ref))
    for path, layer in quantized_layers(model):
        for k, v in layer.nf4_weight().state_dict().items():
            assert torch.equal(v, refs[path].nf4_weight().state_dict()[k]), (path, k)
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, hf4(ids()).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not read"):
        from cuboid.loading.quantize import prequantized
        prequantized({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                              "bnb_4bit_quant_type": "fp4"}}, root)


def test_to_hf_writes_what_transformers_and_bitsandbytes_save(folders, tmp_path):
    """Every tensor of the written folder (4-bit keys and the rest) bit-equal to transformers' save of the same
    weights, its quantization_config theirs, and transformers loads it with cuboid's logits."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    root, hf4 = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32)
    cuboid.zoo.to_hf(model, tmp_path / "out")
    ours, theirs = load_file(str(tmp_path / "out" / "model.safetensors")), {}
    for f in (root / "bnb4").glob("*.safetensors"):
        theirs.update(load_file(str(f)))
    assert set(ours) == set(theirs)
    bad = [k for k in theirs if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k], theirs[k])]
    assert not bad, bad[:5]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    want = json.loads((root / "bnb4" / "config.json").read_text())["quantization_config"]
    assert {k: cfg[k] for k in want} == want
    back = LlamaForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, model(ids()).logits, atol=1e-4, rtol=1e-4)


def test_adapters_trained_on_the_4bit_base_are_read_by_peft(folders, tmp_path):
    from peft import PeftModel

    root, hf4 = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32, lora="r=4,alpha=8,targets=attn+mlp")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = ids()
    for _ in range(2):
        out = model(x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    cuboid.zoo.lora.save_adapters(model, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(hf4, tmp_path / "adapter")
    with torch.no_grad():
        want = peft_model(x).logits
        got = model(x).logits
        with peft_model.disable_adapter():
            base = peft_model(x).logits
    assert (want - base).abs().max() > 1e-3  # the trained adapters move the logits
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bad_quantize_is_a_clear_error(folders):
    root, _ = folders
    with pytest.raises(ValueError, match="'nf4'"):
        cuboid.load(root / "bf16", quantize="int8")


def test_a_mixture_of_experts_keeps_its_experts_and_router():
    """transformers' choice on a MoE: the attention linears (and a dense layer's MLP) in 4 bits; the router and the
    stacked experts stay in full precision, and the adapters still train on top."""
    model = cuboid.load("qwen3-moe-debug", quantize="nf4", lora="r=2,alpha=4,targets=attn")
    paths = [p for p, _ in quantized_layers(model)]
    assert paths and all(".attn." in p or ".mlp." in p for p in paths)
    assert not any("router" in p or "experts" in p for p in paths)
    names = {n for n, _ in model.named_parameters()}
    assert any("experts" in n for n in names) and any("router" in n for n in names)
    x = ids() % model.config.vocab_size
    out = model(x, labels=x)
    out.loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_the_grids_and_misaligned_tp_cuts_are_refused():
    from cuboid.parallel import Mesh, Plan

    for spec in ("tp=4,tp_mode=2d", "pp=2,tp=4,tp_mode=2d,microbatches=2,schedule=zbv"):
        plan = Plan.parse(spec)  # the second: rank 0's ZBV stages hold no block, and it refuses all the same
        with pytest.raises(NotImplementedError, match="2D/2.5D/3D"):
            cuboid.load("llama-debug", plan, device="meta", mesh=Mesh.layout(plan), quantize="nf4")
    # llama-debug's attention output under tp=2: 32 input columns a rank cut NF4's blocks of 64
    from cuboid.kernels.nf4 import quantize_nf4
    from cuboid.parallel.quant import quantize_linears

    plan = Plan(tp=2)
    model = cuboid.load("llama-debug", plan, device="meta", mesh=Mesh.layout(plan))
    layer = model.blocks[0].attn.proj
    quantize_linears(model, ["blocks.0.attn.proj"])
    with pytest.raises(ValueError, match="cuts through NF4's blocks of 64"):
        layer.set_quantized(quantize_nf4(torch.randn(64, 64)))


def test_merge_lora_of_a_qlora_run_dequantizes_the_base(folders, tmp_path):
    """`cuboid convert --merge-lora` of adapters trained on the 4-bit base: W = dequantize(W4) + s B A (as peft's
    merge_and_unload on a bitsandbytes base), written as a bf16 folder; a 4-bit base folder is recognised."""
    from safetensors.torch import load_file

    from cuboid.cli.convert import main as convert

    root, _ = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32, lora="r=4,alpha=8")
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)  # trained-looking adapters
    cuboid.zoo.lora.save_adapters(model, tmp_path / "adapter")
    layer = model.blocks[1].mlp.proj
    want = (layer.dequantized(torch.float32) + layer.lora_scaling * layer.lora_B.weight.detach()
            @ layer.lora_A.weight.detach()).to(torch.bfloat16)
    for base, flag in ((root / "bf16", ["--quantize", "nf4"]), (root / "bnb4", [])):
        out = tmp_path / f"merged-{base.name}"
        assert convert(["convert", str(tmp_path / "adapter"), str(out), "--merge-lora", "--base", str(base),
                        *flag]) == 0
        merged = load_file(str(out / "model.safetensors"))
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        got = merged["model.layers.1.mlp.down_proj.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), base.name


def test_qlora_adapters_record_their_nf4_base_and_merge_into_it(folders, tmp_path, capsys):
    """A QLoRA model's adapter folder records its base's quantization (transformers' BitsAndBytesConfig, beside
    peft's config), so `cuboid convert --merge-lora` of it with no --quantize merges into the base dequantized from
    NF4 (what the adapters were trained against), not the full-precision one, and says so in one line."""
    from safetensors.torch import load_file
    from transformers import BitsAndBytesConfig

    from cuboid.cli.convert import main as convert

    root, _ = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32, lora="r=4,alpha=8")
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    cuboid.zoo.lora.save_adapters(model, tmp_path / "adapter", base=str(root / "bf16"))
    record = json.loads((tmp_path / "adapter" / "base_quantization_config.json").read_text())
    bnb = BitsAndBytesConfig.from_dict(record)
    assert bnb.load_in_4bit and bnb.bnb_4bit_quant_type == "nf4" and bnb.bnb_4bit_use_double_quant
    assert cuboid.zoo.checkpoint.verify(tmp_path / "adapter")  # recorded inside the commit
    layer = model.blocks[1].mlp.proj
    want = (layer.dequantized(torch.float32) + layer.lora_scaling * layer.lora_B.weight.detach()
            @ layer.lora_A.weight.detach()).to(torch.bfloat16)
    capsys.readouterr()
    assert convert(["convert", str(tmp_path / "adapter"), str(tmp_path / "merged"), "--merge-lora", "--quiet"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "NF4" in line]
    assert len(err) == 1 and "trained on an NF4-quantized base" in err[0], err
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(got, want)
    # a plain LoRA model's adapters record nothing, and merge into the base as it is
    plain = cuboid.load(root / "bf16", lora="r=4,alpha=8")
    cuboid.zoo.lora.save_adapters(plain, tmp_path / "plain", base=str(root / "bf16"))
    assert not (tmp_path / "plain" / "base_quantization_config.json").exists()


def test_a_lora_models_save_loads_back_with_its_adapters(folders, tmp_path):
    """``checkpoint.save`` of a QLoRA model writes its adapters alone (peft's layout): ``cuboid.load`` of that
    folder loads the base its adapter config names with the adapters on (a fine-tune's ``final/`` names it), the
    same parameters and logits as the saved model; a folder naming no base is refused in one sentence."""
    from cuboid.zoo import checkpoint

    root, _ = folders
    model = cuboid.load(root / "bf16", quantize="nf4", dtype=torch.float32, lora="r=4,alpha=8")
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_B"):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)  # trained-looking adapters
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    checkpoint.save(model, tmp_path / "saved")
    with pytest.raises(checkpoint.CheckpointError, match=r"adapters alone and names no base model: load them onto "
                                                         r"their base with cuboid.load\(base, lora="):
        cuboid.load(tmp_path / "saved")
    cuboid.zoo.lora.save_adapters(model, tmp_path / "final", base=str(root / "bf16"))
    back = cuboid.load(tmp_path / "final", quantize="nf4", dtype=torch.float32)
    params = dict(back.named_parameters())
    assert sum("lora_" in n for n in params) == sum("lora_" in n for n, _ in model.named_parameters()) > 0
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())
    with torch.no_grad():
        assert torch.equal(back(x).logits, want)


def test_a_damaged_or_blocksize_128_quant_state_is_one_line_naming_the_tensor(folders, tmp_path):
    """Issue 65, item 5.6: a tensor whose quant state is not JSON, and a valid folder quantized with blocksize
    128 (cuboid's NF4 layers hold bitsandbytes' default 64): each a one-line CheckpointError naming the folder
    and the tensor (a traceback from inside the layers before)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from cuboid.kernels.nf4 import quantize_nf4
    from cuboid.zoo.checkpoint.format import CheckpointError

    root, _ = folders
    name = "model.layers.1.mlp.down_proj.weight"
    for case in ("damaged", "blocksize-128"):
        folder = tmp_path / case
        shutil.copytree(root / "bnb4", folder)
        (file,) = folder.glob("*.safetensors")
        tensors = load_file(file)
        if case == "damaged":
            tensors[f"{name}.quant_state.bitsandbytes__nf4"] = torch.tensor(list(b'{"quant_type": "nf4"'),
                                                                            dtype=torch.uint8)
            want = "its 4-bit quant state is not readable"
        else:
            full = torch.randn(128, 256, dtype=torch.bfloat16)
            for k, v in quantize_nf4(full, blocksize=128).state_dict(prefix=name).items():
                tensors[k] = v
            want = "quantized with blocksize 128; cuboid's NF4 layers hold bitsandbytes' default blocksize 64"
        save_file(tensors, str(file), metadata={"format": "pt"})
        with pytest.raises(CheckpointError) as e:
            cuboid.load(folder, dtype=torch.float32)
        assert str(e.value).startswith(f"{folder}: {name}: {want}"), str(e.value)
        assert "\n" not in str(e.value)
