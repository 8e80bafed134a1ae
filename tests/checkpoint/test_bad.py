"""Bad checkpoints are clear errors that name the file or tensor."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import cuboid
from cuboid.zoo import checkpoint
from cuboid.zoo.checkpoint import CheckpointError

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tmp_path):
    return checkpoint.save(cuboid.load("gpt-debug"), tmp_path / "c", max_shard_size="60KB")


def shard(path, i=2):
    return sorted(path.glob("model-*.safetensors"))[i - 1]


def fresh():
    return cuboid.load("gpt-debug", seed=1)


def edit_index(path, fn):
    index = json.loads((path / INDEX).read_text())
    fn(index)
    (path / INDEX).write_text(json.dumps(index))


def test_truncated_shard(ckpt):
    f = shard(ckpt)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=rf"{f.name}.*truncated"):
        checkpoint.load(fresh(), ckpt)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.verify(ckpt)


def test_shard_of_the_wrong_size(ckpt):
    f = shard(ckpt, 3)
    with open(f, "ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=rf"{f.name}: .* bytes, the index recorded .* \(wrong size\)"):
        checkpoint.load(fresh(), ckpt)


def test_truncated_shard_without_records(tmp_path):
    """A folder transformers wrote records no sizes: the header's own extent catches it."""
    from ..zoo.hf_cases import make_hf

    make_hf("GPT2LMHeadModel").save_pretrained(tmp_path, max_shard_size="20KB")
    f = sorted(tmp_path.glob("model-*.safetensors"))[0]
    os.truncate(f, f.stat().st_size - 7)
    with pytest.raises(CheckpointError, match=rf"{f.name}.*truncated or wrong size"):
        checkpoint.load(cuboid.load("gpt-debug", vocab_size=97, n_positions=32, dim=48), tmp_path)


def test_wrong_shape_names_both_shapes(tmp_path):
    path = checkpoint.save(cuboid.load("gpt-debug", n_positions=64), tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"transformer\.wpe\.weight \(-> pos_emb\.weight\): "
                                              r"checkpoint \(64, 64\).*model \(128, 64\)"):
        checkpoint.load(fresh(), path)


def test_wrong_dtype(ckpt):
    f = shard(ckpt, 1)
    tensors = load_file(f)
    name = next(iter(tensors))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, f, metadata={"format": "pt"})
    os.remove(ckpt / INDEX)  # and a stale index is no excuse: rebuild without size records
    weight_map = {n: s.name for s in ckpt.glob("model-*.safetensors") for n in load_file(s)}
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=rf"mismatched: .*{name}.*torch\.int32.*torch\.float32"):
        checkpoint.load(fresh(), ckpt)


def test_missing_shard(ckpt):
    f = shard(ckpt, 3)
    f.unlink()
    with pytest.raises(CheckpointError, match=rf"names {f.name}, which does not exist \(missing shard\)"):
        checkpoint.load(fresh(), ckpt)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.verify(ckpt)


@pytest.mark.parametrize("evil", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ""])
def test_shard_name_escaping_the_folder(ckpt, evil):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"transformer.wte.weight": evil}))
    with pytest.raises(CheckpointError, match="escapes the folder"):
        checkpoint.load(fresh(), ckpt)
    with pytest.raises(CheckpointError, match="escapes the folder"):
        checkpoint.verify(ckpt)


def test_index_names_a_tensor_the_shard_lacks(ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"transformer.wte.weight": shard(ckpt, 3).name}))
    with pytest.raises(CheckpointError, match=r"lists transformer\.wte\.weight in this file, which does not hold"):
        checkpoint.load(fresh(), ckpt)


def flip(f, at=-5):
    data = bytearray(f.read_bytes())
    data[at] ^= 0x40
    f.write_bytes(bytes(data))


def test_corrupted_bytes_fail_the_hash(ckpt):
    f = shard(ckpt)
    flip(f)
    with pytest.raises(CheckpointError, match=rf"{f.name}: SHA-256 mismatch"):
        checkpoint.verify(ckpt)
    with pytest.raises(CheckpointError, match="SHA-256 mismatch"):
        checkpoint.load(fresh(), ckpt, verify=True)
    checkpoint.load(fresh(), ckpt)  # without verify=True the data is not hashed (documented)


def test_corrupted_single_file_and_config(tmp_path):
    path = checkpoint.save(cuboid.load("gpt-debug"), tmp_path / "c")
    assert checkpoint.verify(path)["files"] == 2
    flip(path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: SHA-256 mismatch"):
        checkpoint.verify(path)
    path = checkpoint.save(cuboid.load("gpt-debug"), tmp_path / "d")
    cfg = path / "config.json"
    cfg.write_text(cfg.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    with pytest.raises(CheckpointError, match=r"config\.json: SHA-256 mismatch"):
        checkpoint.verify(path)


def test_garbage_index_and_header(ckpt):
    (ckpt / INDEX).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        checkpoint.load(fresh(), ckpt)
    f = ckpt / "x"
    f.mkdir()
    g = f / "model.safetensors"
    g.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length"):
        checkpoint.load(fresh(), f)


def test_no_weights_and_bin_only(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        checkpoint.load(fresh(), tmp_path / "nope")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"only PyTorch \.bin weights"):
        checkpoint.load(fresh(), tmp_path)


def test_unexpected_tensor(ckpt):
    f = shard(ckpt, 1)
    tensors = load_file(f)
    tensors["transformer.h.9.extra"] = torch.zeros(3)
    save_file(tensors, f, metadata={"format": "pt"})
    edit_index(ckpt, lambda ix: (ix["weight_map"].update({"transformer.h.9.extra": f.name}),
                                 ix["metadata"].pop("files")))
    with pytest.raises(CheckpointError, match=r"unexpected: transformer\.h\.9\.extra"):
        checkpoint.load(fresh(), ckpt)
    assert checkpoint.load(fresh(), ckpt, strict=False)["unexpected"] == ["transformer.h.9.extra"]


def test_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        checkpoint.save(cuboid.load("gpt-debug"), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
