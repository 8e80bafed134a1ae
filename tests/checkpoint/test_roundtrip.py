"""Round trips: cuboid -> cuboid (several shards), cuboid -> transformers, transformers -> cuboid."""
import json

import pytest
import torch
import transformers as T

import cuboid
from cuboid import zoo
from cuboid.zoo import checkpoint, hf_io
from cuboid.zoo.checkpoint import CheckpointError

from ..zoo.hf_cases import make_hf
from .common import assert_same, params

# preset -> (AutoModel class, inputs)
CASES = {
    "gpt-debug": (T.AutoModelForCausalLM, lambda g: {"input_ids": torch.randint(0, 512, (2, 9), generator=g)}),
    "bert-debug": (T.AutoModelForMaskedLM, lambda g: {"input_ids": torch.randint(0, 512, (2, 9), generator=g),
                                                      "token_type_ids": torch.tensor([[0] * 5 + [1] * 4] * 2)}),
    "vit-debug": (T.AutoModelForImageClassification, lambda g: {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}),
}


def randomised(name, seed=0):
    """A debug model with every tensor random (norms and biases too), so a dropped tensor shows."""
    model = cuboid.load(name, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    name = request.param
    model = randomised(name)
    path = checkpoint.save(model, tmp_path_factory.mktemp(name) / "ckpt", max_shard_size="60KB")
    return name, model, path


def test_round_trip_several_shards(saved):
    name, model, path = saved
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0].endswith("-00001-of-%05d.safetensors" % len(shards))
    assert index["metadata"]["total_size"] == sum(
        p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert set(index["metadata"]["files"]) == {*shards, "config.json"}
    assert checkpoint.verify(path)["tensors"] == len(index["weight_map"])
    fresh = cuboid.load(name, seed=7)
    assert checkpoint.load(fresh, path, verify=True) == {"missing": [], "unexpected": [], "mismatched": []}
    assert_same(params(fresh), params(model))


def test_transformers_loads_it_to_the_same_logits(saved):
    name, model, path = saved
    auto, inputs = CASES[name]
    hf = auto.from_pretrained(path).eval()
    batch = inputs(torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(**batch).logits, hf(**batch).logits
    assert ours.shape == theirs.shape
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-5


def test_tied_weights_stored_once(tmp_path):
    path = checkpoint.save(cuboid.load("gpt-debug"), tmp_path / "g")
    names = checkpoint.TensorFolder(path).keys()
    assert "transformer.wte.weight" in names and not any("lm_head" in n for n in names)
    assert not (path / "model.safetensors.index.json").exists()  # fits in one file: no index


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "BertForMaskedLM", "ViTForImageClassification"])
def test_hf_saved_sharded_folder_loads(arch, tmp_path):
    hf = make_hf(arch)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg = hf_io.read_config(tmp_path)
    family, a = hf_io.architecture_from_config(cfg, list(zoo.FAMILIES.values()), tmp_path)
    model = zoo.materialize(zoo.build(family.config_from_hf(cfg, a)), seed=3)
    checkpoint.load(model, tmp_path)
    assert_same(params(model), params(zoo.from_hf(tmp_path)))


@pytest.mark.parametrize("layer, part", [
    ("pos_emb", (slice(0, 64), slice(0, 64))),           # stored as is: rows [0, 64) of (128, 64)
    ("blocks.1.mlp.fc", (slice(128, 256), slice(0, 64))),  # a GPT-2 Conv1D weight, stored transposed
])
def test_each_layer_reads_only_its_slices(tmp_path, layer, part):
    """A layer that owns a slice of a full tensor gets exactly that slice, through a lazy slice object."""
    src = randomised("gpt-debug")
    path = checkpoint.save(src, tmp_path / "c", max_shard_size="60KB")
    model = cuboid.load("gpt-debug", seed=1)
    mod = model.get_submodule(layer)
    full = mod.weight.shape
    mod.weight = torch.nn.Parameter(torch.empty(part[0].stop - part[0].start, part[1].stop - part[1].start))
    mod.full_shape = lambda name: full if name == "weight" else type(mod).full_shape(mod, name)
    mod.shard_slices = lambda name: part if name == "weight" else type(mod).shard_slices(mod, name)
    seen = []
    real = type(mod).load_full
    mod.load_full = lambda name, f: (seen.append((name, type(f))), real(mod, name, f))
    checkpoint.load(model, path)
    kinds = dict(seen)
    assert not issubclass(kinds["weight"], torch.Tensor)  # a lazy slice, not a full tensor
    assert torch.equal(mod.weight, src.get_submodule(layer).weight[part])


def test_optimizer_state_round_trip_with_masters(tmp_path):
    from cuboid.parallel.optim import AdamW

    model = cuboid.load("gpt-debug", dtype=torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(16).reshape(1, 16)
    model(ids, labels=ids).loss.float().backward()
    opt.step()
    path = checkpoint.save(model, tmp_path / "c", max_shard_size="60KB", optimizer=opt, state={"step": 1})
    assert (path / "optimizer.safetensors.index.json").is_file()
    model2 = cuboid.load("gpt-debug", dtype=torch.bfloat16, seed=4)
    opt2 = AdamW(model2.parameters(), lr=5.0)
    checkpoint.load(model2, path)
    info = checkpoint.load_training_state(path, model2, opt2)
    assert info["step"] == 1 and opt2.param_groups[0]["lr"] == 1e-3
    for p, q in zip(model.parameters(), model2.parameters()):
        s, t = opt.state[p], opt2.state[q]
        assert s.keys() == t.keys() and "master" in s and s["step"] == t["step"] == 1
        for k in ("exp_avg", "exp_avg_sq", "master"):
            assert t[k].dtype == torch.float32 and torch.equal(s[k], t[k]), k
    assert checkpoint.verify(path)["files"] >= 5


def test_strict_false_returns_the_problems(tmp_path):
    path = checkpoint.save(cuboid.load("gpt-debug", n_layers=1), tmp_path / "c")
    model = cuboid.load("gpt-debug")  # two layers: h.1.* missing
    with pytest.raises(CheckpointError, match=r"missing: .*h\.1\.ln_1\.weight"):
        checkpoint.load(model, path)
    problems = checkpoint.load(model, path, strict=False)
    assert "transformer.h.1.attn.c_attn.weight" in problems["missing"]
    assert not problems["unexpected"] and not problems["mismatched"]
