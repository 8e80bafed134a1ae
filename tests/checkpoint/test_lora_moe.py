"""LoRA on a mixture of experts (issue 37): adapters on attention and on every sparse layer's stacked experts
(peft's ``target_parameters`` on transformers' fused ``mlp.experts.gate_up_proj`` / ``down_proj``) give peft's
logits and gradients on transformers for the same adapter weights, load back both ways (cuboid's folder into
peft, peft's folder into cuboid), merge, and are counted in one printed line that says when the experts are
left out."""
from __future__ import annotations

import json

import pytest
import torch

import cuboid
from cuboid.parallel import lora as plora
from cuboid.zoo import lora as zlora

peft = pytest.importorskip("peft")
T = pytest.importorskip("transformers")

from tests.zoo.hf_cases import MOE_CASES  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a small HF folder of each family (Qwen3-MoE with a dense layer between sparse ones)."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for name, (cls, cfg, _) in MOE_CASES.items():
        torch.manual_seed(0)
        cls(cfg()).eval().save_pretrained(root / name, safe_serialization=True)
        out[name] = root / name
    return out


def with_random_b(model, seed=1):
    """Adapters whose B is not zero (peft's and cuboid's initial B is), so the update shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("lora_B.weight", "_B")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _ids(model, seed=2):
    return torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_peft_reads_adapters_on_attention_and_experts(folders, tmp_path, name):
    folder = folders[name]
    model = with_random_b(cuboid.load(folder, lora="r=2,alpha=6,targets=attn+experts")).eval()
    assert plora.adapted_experts(model), "the experts carry adapters"
    out = zlora.save_adapters(model, tmp_path / "adapters", base=str(folder))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert not any("mlp" in m for m in cfg["target_modules"])

    ids = _ids(model)
    cls = MOE_CASES[name][0]
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        plain = cls.from_pretrained(folder).eval()(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(cls.from_pretrained(folder), out).eval()
        ref = theirs(input_ids=ids).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapters change the output
    assert (ours - ref).abs().max() < TOL

    again = cuboid.load(folder, lora=out).eval()  # and back into cuboid
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, ours)


def test_gradients_equal_peft_s(folders, tmp_path):
    """One backward: every adapter's gradient (experts' in peft's stacked layout) equals peft's."""
    from cuboid.zoo.checkpoint.adapters import PEFT_PREFIX, adapter_state

    name = "Qwen3MoeForCausalLM"
    folder = folders[name]
    model = with_random_b(cuboid.load(folder, lora="r=2,alpha=4,targets=attn+experts"))
    out = zlora.save_adapters(model, tmp_path / "a", base=str(folder))
    theirs = peft.PeftModel.from_pretrained(MOE_CASES[name][0].from_pretrained(folder), out, is_trainable=True)
    ids = _ids(model, 3)
    model(input_ids=ids, labels=ids).loss.backward()
    theirs(input_ids=ids, labels=ids).loss.backward()

    with torch.no_grad():  # cuboid's gradients under peft's names: swap them in for the weights
        for p in plora.adapter_parameters(model):
            p.copy_(p.grad)
        ours = adapter_state(model)
    grads = {n.replace(".default", ""): p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    assert set(grads) == set(ours) and any(".experts." in k for k in ours)
    for k, g in grads.items():
        assert k.startswith(PEFT_PREFIX)
        assert (ours[k] - g).abs().max() <= 1e-4 * g.abs().max() + 1e-7, k


def test_cuboid_reads_peft_s_adapters_on_one_expert_weight(folders, tmp_path):
    """peft's own folder with only ``down_proj`` targeted (no nesting): cuboid gives peft's logits."""
    name = "OlmoeForCausalLM"
    folder, cls = folders[name], MOE_CASES[name][0]
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=["mlp.experts.down_proj"])
    theirs = peft.get_peft_model(cls.from_pretrained(folder), config)
    with_random_b(theirs, seed=5)
    theirs.save_pretrained(tmp_path / "p")
    ours = cuboid.load(folder, lora=tmp_path / "p").eval()
    assert [e.lora_weights for _, e in plora.adapted_experts(ours)] == [("down",)] * 2
    ids = _ids(ours, 4)
    with torch.no_grad():
        assert (ours(input_ids=ids).logits - theirs.eval()(input_ids=ids).logits).abs().max() < TOL


def test_merged_experts_give_the_adapted_logits(folders, tmp_path):
    name = "MixtralForCausalLM"
    folder = folders[name]
    model = with_random_b(cuboid.load(folder, lora="r=2,alpha=4,targets=experts")).eval()
    zlora.save_adapters(model, tmp_path / "a", base=str(folder))
    merged = zlora.merge_to_hf(tmp_path / "a", tmp_path / "merged")
    ids = _ids(model, 6)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        got = MOE_CASES[name][0].from_pretrained(merged).eval()(input_ids=ids).logits
    assert (got - ref).abs().max() < TOL


def test_the_printed_count_says_whether_the_experts_train(folders, capsys):
    from cuboid.zoo.common import count_parameters

    folder = folders["Qwen3MoeForCausalLM"]
    for targets, experts in (("attn+experts", True), ("attn", False), ("mlp", True)):
        capsys.readouterr()
        model = cuboid.load(folder, lora=f"r=2,alpha=4,targets={targets}")
        line = capsys.readouterr().err.strip().splitlines()[-1]
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = count_parameters(model) - trained
        in_experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("experts.gate_up",
                                                                                        "experts.down")))
        assert f"{trained:,} trainable adapter parameters, {trained / total:.3%} of the model's {total:,}" in line
        assert f"{in_experts / total:.0%} of the model's parameters" in line
        if experts:
            assert "the experts of 2 sparse layers are adapted (gate_up, down" in line, line
        else:
            assert "the experts are NOT adapted" in line and "add the target 'experts'" in line, line


def test_what_peft_could_not_read_is_refused(folders, tmp_path):
    folder = folders["Qwen3MoeForCausalLM"]
    adapters = zlora.save_adapters(cuboid.load(folder, lora="r=2,alpha=4,targets=experts"), tmp_path / "a")
    (adapters / "lora-adapters.json").unlink()  # a peft folder from elsewhere
    cfg = json.loads((adapters / "adapter_config.json").read_text())
    for one_layer in ("layers.0.mlp.experts.down_proj", "model.layers.2.mlp.experts.down_proj"):
        (adapters / "adapter_config.json").write_text(json.dumps(dict(cfg, target_parameters=[one_layer])))
        with pytest.raises(ValueError, match=f"target parameter '{one_layer}' is not one cuboid adapts"):
            cuboid.load(folder, lora=adapters)
    with pytest.raises(ValueError, match="peft's adapters on stacked expert weights.*have none"):
        cuboid.load(folder, lora="r=2,alpha=4,dropout=0.1,targets=experts")
    with pytest.raises(ValueError, match="LoRA target 'gate' on a mixture of experts"):
        cuboid.load(folder, lora="r=2,alpha=4,targets=gate")
    with pytest.raises(ValueError, match="has no mixture of experts"):
        cuboid.load("llama-debug", lora="r=2,alpha=4,targets=experts")


def test_checkpoint_save_writes_experts_only_adapters(folders, tmp_path):
    """``checkpoint.save`` of a model whose only adapters are on the experts (every linear plain) writes the
    adapter folder, which loads back to the same logits."""
    from cuboid.zoo import checkpoint as ckpt

    folder = folders["MixtralForCausalLM"]
    model = with_random_b(cuboid.load(folder, lora="r=2,alpha=4,targets=experts")).eval()
    assert not plora.adapted(model) and plora.adapted_experts(model)
    out = ckpt.save(model, tmp_path / "a")
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    ckpt.verify(out)
    ids = _ids(model, 7)
    with torch.no_grad():
        assert torch.equal(cuboid.load(folder, lora=out).eval()(input_ids=ids).logits, model(input_ids=ids).logits)
