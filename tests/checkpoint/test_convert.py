"""`cuboid convert`: sharded <-> single, dtype casts, --verify, bounded memory, one-line errors."""
import importlib
import json
import weakref

import pytest
import torch

import cuboid
from cuboid.cli.convert import main
from cuboid.zoo import checkpoint

convert_mod = importlib.import_module("cuboid.zoo.checkpoint.convert")  # the module, not the function

from .common import assert_same, params


def tensors(path):
    folder = checkpoint.TensorFolder(path)
    return {n: folder.get_tensor(n) for n in folder.keys()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return checkpoint.save(cuboid.load("bert-debug"), tmp_path_factory.mktemp("c") / "sharded", max_shard_size="60KB")


def test_sharded_to_single_to_sharded(sharded, tmp_path):
    assert main(["convert", str(sharded), str(tmp_path / "single"), "--quiet"]) == 0
    single = tmp_path / "single"
    assert sorted(p.name for p in single.iterdir()) == ["config.json", "model.safetensors"]
    assert main(["convert", str(single), str(tmp_path / "again"), "--max-shard-size", "60KB", "--quiet"]) == 0
    again = tmp_path / "again"
    src, one, back = tensors(sharded), tensors(single), tensors(again)
    assert src.keys() == one.keys() == back.keys()
    for n in src:
        assert torch.equal(src[n], one[n]) and torch.equal(src[n], back[n]), n
    index = lambda p: json.loads((p / "model.safetensors.index.json").read_text())  # noqa: E731
    assert len(set(index(again)["weight_map"].values())) > 3
    assert (again / "config.json").read_bytes() == (sharded / "config.json").read_bytes()
    for p in (single, again):
        checkpoint.verify(p)
        model = cuboid.load("bert-debug", seed=3)
        checkpoint.load(model, p)
        assert_same(params(model), params(cuboid.load("bert-debug")))


def test_dtype_cast_to_bf16(sharded, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert main(["convert", str(sharded), str(out), "--dtype", "bf16"]) == 0
    assert "convert" in capsys.readouterr().err  # the progress bar
    src, cast = tensors(sharded), tensors(out)
    for n, t in src.items():
        assert cast[n].dtype == torch.bfloat16 and torch.equal(cast[n], t.to(torch.bfloat16)), n
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    total = json.loads((sharded / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert (out / "model.safetensors").stat().st_size < total // 2 + 8192
    model = cuboid.load("bert-debug", seed=3)  # fp32 model: loads with a cast
    checkpoint.load(model, out, verify=True)
    assert torch.equal(model.tok_emb.weight, cuboid.load("bert-debug").tok_emb.weight.to(torch.bfloat16).float())


def test_verify_command(sharded, tmp_path, capsys):
    assert main(["convert", "--verify", str(sharded)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    bad = tmp_path / "bad"
    main(["convert", str(sharded), str(bad), "--quiet"])
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-3] ^= 1
    (bad / "model.safetensors").write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["convert", "--verify", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SHA-256 mismatch" in err


@pytest.mark.parametrize("argv, message", [
    (["convert", "SRC"], "needs SRC and DST"),
    (["convert", "SRC", "DST", "--dtype", "int3"], "unknown dtype"),
    (["convert", "SRC", "DST", "--max-shard-size", "5XB"], "Unit 'XB' not supported"),
    (["convert", "SRC", "SRC"], "same folder"),
    (["convert", "SRC", "EXISTS"], "exists"),
    (["convert", "MISSING", "DST"], "no such checkpoint"),
    (["convert", "--verify", "SRC", "SRC"], "takes no SRC"),
])
def test_errors_are_one_line_exit_2(sharded, tmp_path, capsys, argv, message):
    (tmp_path / "exists").mkdir()
    subst = {"SRC": str(sharded), "DST": str(tmp_path / "dst"), "EXISTS": str(tmp_path / "exists"),
             "MISSING": str(tmp_path / "missing")}
    assert main([subst.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cuboid convert: error: ") and message in err
    assert not (tmp_path / "dst").exists()


def test_at_most_one_source_tensor_alive(sharded, tmp_path, monkeypatch):
    """Instrumented: every tensor read from SRC is tracked until freed; never two at once."""
    alive, peak, reads = [0], [0], [0]
    real = convert_mod._read_tensor

    def tracked(folder, name):
        t = real(folder, name)
        alive[0] += 1
        reads[0] += 1
        peak[0] = max(peak[0], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - 1))
        return t

    monkeypatch.setattr(convert_mod, "_read_tensor", tracked)
    for i, extra in enumerate(([], ["--dtype", "fp16"], ["--max-shard-size", "30KB"])):
        assert main(["convert", str(sharded), str(tmp_path / str(i)), "--quiet", *extra]) == 0
    assert reads[0] == 3 * len(checkpoint.TensorFolder(sharded).keys()) and peak[0] == 1


def test_converts_a_transformers_folder(tmp_path):
    from ..zoo.hf_cases import make_hf

    make_hf("ViTForImageClassification").save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    with pytest.raises(checkpoint.CheckpointError, match="no SHA-256 recorded"):
        checkpoint.verify(tmp_path / "hf")
    assert checkpoint.verify(tmp_path / "hf", require_checksums=False)["tensors"] > 10
    checkpoint.convert(tmp_path / "hf", tmp_path / "single", progress=False)
    checkpoint.verify(tmp_path / "single")
    hf, ours = tensors(tmp_path / "hf"), tensors(tmp_path / "single")
    assert hf.keys() == ours.keys() and all(torch.equal(hf[n], ours[n]) for n in hf)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "LlamaForSequenceClassification"])
def test_converts_llama_family_folders_that_load_back(arch, tmp_path):
    """A sharded Llama-family folder (Qwen2 with tied embeddings and biases; a Llama classifier) becomes one
    file, bf16 too, and both transformers and cuboid load what convert wrote to the source's logits."""
    from ..zoo.hf_cases import CASES, make_batch, make_hf

    hf = make_hf(arch)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "single"), "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "bf16"), "--dtype", "bf16", "--quiet"]) == 0
    src, one = tensors(tmp_path / "hf"), tensors(tmp_path / "single")
    assert src.keys() == one.keys() and all(torch.equal(src[n], one[n]) for n in src)
    assert all(t.dtype == torch.bfloat16 for t in tensors(tmp_path / "bf16").values())
    batch = {k: v for k, v in make_batch(arch).items() if k != "labels"}
    with torch.no_grad():
        want = hf(**batch).logits
        back = CASES[arch][0].from_pretrained(tmp_path / "single").eval()(**batch).logits
        ours = cuboid.load(tmp_path / "single").eval()(**batch).logits
    keep = batch["attention_mask"].bool() if want.dim() == 3 else slice(None)
    assert torch.equal(back, want)
    assert torch.allclose(ours[keep], want[keep], atol=1e-5, rtol=1e-5)
