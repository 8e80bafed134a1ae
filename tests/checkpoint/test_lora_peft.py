"""LoRA checkpoints in peft's layout: peft loads what cuboid saves (GPT-2 and the Llama family), cuboid loads
it back, and ``cuboid convert --merge-lora`` writes a folder transformers loads with the same logits."""
from __future__ import annotations

import json

import pytest
import torch

import cuboid
from cuboid.zoo import lora as zlora

peft = pytest.importorskip("peft")
T = pytest.importorskip("transformers")

from tests.zoo.hf_cases import CASES  # noqa: E402

TOL = 1e-5


def _hf_folder(tmp_path, name):
    cls, cfg, _ = CASES[name]
    torch.manual_seed(0)
    hf = cls(cfg()).eval()
    folder = tmp_path / name
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def _trained(folder, lora, steps=2):
    """A cuboid model of ``folder`` with adapters trained a few AdamW steps (so B is not zero)."""
    model = cuboid.load(folder, lora=lora)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


@pytest.mark.parametrize("name, lora", [
    ("GPT2LMHeadModel", dict(r=4, alpha=8, targets=("attn", "mlp"))),
    ("LlamaForCausalLM", dict(r=4, alpha=16, targets=("qkv", "o", "mlp"))),
    ("Qwen2ForCausalLM", dict(r=2, alpha=4, targets=("q", "v"))),
    # a fused qkv against HF's separate query/key/value: three peft adapters sharing A
    ("BertForMaskedLM", dict(r=4, alpha=8, targets=("attn", "mlp"))),
])
def test_peft_loads_cuboid_adapters(tmp_path, name, lora):
    folder = _hf_folder(tmp_path, name)
    model = _trained(folder, lora)
    assert all(float(b.lora_B.weight.detach().abs().max()) > 0 for _, b in cuboid.parallel.lora.adapted(model))
    out = tmp_path / "adapters"
    zlora.save_adapters(model, out, base=str(folder))
    files = sorted(p.name for p in out.iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "lora-adapters.json"]
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.") and ".lora_" in k for k in keys)  # adapters only

    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        base = CASES[name][0].from_pretrained(folder).eval()
        theirs = peft.PeftModel.from_pretrained(base, out).eval()
        assert isinstance(theirs.base_model, peft.LoraModel)
        ref = theirs(input_ids=ids).logits
    assert (ours - ref).abs().max() < TOL

    # cuboid loads the peft folder back, under a fresh model (adapters equal, logits equal)
    again = cuboid.load(folder, lora=out).eval()
    with torch.no_grad():
        assert (again(input_ids=ids).logits - ours).abs().max() == 0

    # merged: a plain HF folder whose logits are the adapted model's
    merged = tmp_path / "merged"
    from cuboid.cli import main

    assert main(["convert", str(out), str(merged), "--merge-lora"]) in (0, None)
    assert not (merged / "adapter_config.json").exists()
    with torch.no_grad():
        plain = CASES[name][0].from_pretrained(merged).eval()(input_ids=ids).logits
    assert (plain - ours).abs().max() < TOL


def test_adapter_config_names_what_peft_needs(tmp_path):
    folder = _hf_folder(tmp_path, "GPT2LMHeadModel")
    model = cuboid.load(folder, lora="r=2,alpha=4,targets=o")
    zlora.save_adapters(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["fan_in_fan_out"] is True and cfg["r"] == 2 and cfg["lora_alpha"] == 4
    # only the attention's output projection, not the MLP's c_proj of the same short name
    assert cfg["target_modules"] == [f"transformer.h.{i}.attn.c_proj" for i in range(2)]


def test_bad_targets_say_so(tmp_path):
    with pytest.raises(ValueError, match="names no layer"):
        cuboid.load("gpt-debug", lora=dict(r=2, targets=("q",)))  # GPT's q, k, v are one fused qkv
    with pytest.raises(ValueError, match="unknown LoRA target"):
        cuboid.load("gpt-debug", lora=dict(r=2, targets=("nope",)))
    with pytest.raises(ValueError, match="key=value"):
        cuboid.load("gpt-debug", lora="r16")


@pytest.mark.parametrize("name", ["GPT2LMHeadModel", "LlamaForCausalLM"])
def test_one_device_lora_steps_equal_peft(tmp_path, name):
    """The one-device LoRA step every plan is held to is peft's: from the same adapters (cuboid's init, saved),
    three AdamW steps on both sides give the same adapters and losses."""
    folder = _hf_folder(tmp_path, name)
    model = cuboid.load(folder, lora=dict(r=4, alpha=8)).train()
    zlora.save_adapters(model, tmp_path / "init")
    base = CASES[name][0].from_pretrained(folder)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "init", is_trainable=True).train()
    # eps 1e-3 (as test_plans): with Adam's 1e-8 an element whose exact gradient is ~0 moves by rounding noise
    ours_opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    theirs_opt = torch.optim.AdamW([p for p in theirs.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    assert len(ours_opt.param_groups[0]["params"]) == len(theirs_opt.param_groups[0]["params"])
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
        a = model(input_ids=ids, labels=ids).loss
        b = theirs(input_ids=ids, labels=ids).loss
        assert abs(a.item() - b.item()) < TOL * abs(b.item())
        for loss, opt in ((a, ours_opt), (b, theirs_opt)):
            loss.backward()
            opt.step()
            opt.zero_grad()
    zlora.save_adapters(model, tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    from safetensors.torch import load_file

    x, y = load_file(str(tmp_path / "ours" / "adapter_model.safetensors")), \
        load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))
    assert x.keys() == y.keys()
    moved = max(float(t.abs().max()) for k, t in x.items() if ".lora_B." in k)
    assert moved > 1e-3
    from tests.parallel.test_plans import rel_norm

    keys = sorted(x)
    assert rel_norm(torch.cat([x[k].flatten() for k in keys]), torch.cat([y[k].flatten() for k in keys])) < 1e-6


def test_checkpoint_save_writes_a_lora_model_s_adapters_for_peft(tmp_path):
    """``checkpoint.save`` on a LoRA model writes what ``save_adapters`` (and a fine-tune's final/) writes."""
    from cuboid.zoo import checkpoint

    folder = _hf_folder(tmp_path, "LlamaForCausalLM")
    model = _trained(folder, dict(r=4, alpha=8, targets=("qkv", "mlp")))
    out = checkpoint.save(model, tmp_path / "saved")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                     "lora-adapters.json"]
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        base = CASES["LlamaForCausalLM"][0].from_pretrained(folder).eval()
        ref = peft.PeftModel.from_pretrained(base, out).eval()(input_ids=ids).logits
    assert (ours - ref).abs().max() < TOL
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(checkpoint.CheckpointError, match="cuboid.zoo.lora.save_checkpoint"):
        checkpoint.save(model, tmp_path / "with-state", optimizer=opt)
