"""The reader's lazy views, meta folder loads, and to_hf writing into a folder that holds other files."""
import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import cuboid
from cuboid import zoo
from cuboid.zoo import checkpoint
from cuboid.zoo.hf_io import Reshaped, Stacked, Transposed

from ..zoo.hf_cases import make_hf


def random_slices(shape, rng):
    out = []
    for n in shape:
        a = rng.randrange(0, n + 1)
        out.append(slice(a, rng.randrange(a, n + 1)))
    return tuple(out)


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"c": torch.randn(6, 10, generator=g), "q": torch.randn(4, 5, generator=g),
               "k": torch.randn(4, 5, generator=g), "v": torch.randn(4, 5, generator=g),
               "p": torch.randn(3, 2, 2, 2, generator=g)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    return tensors, safe_open(str(tmp_path / "t.safetensors"), framework="pt")


def test_views_read_the_same_blocks_as_the_eager_transforms(stored):
    """Over full tensors and over safetensors slices: every block equals the same block of the transformed tensor."""
    tensors, f = stored
    rng = random.Random(0)
    for src in (lambda n: tensors[n], f.get_slice):
        views = {
            "transposed": (Transposed(src("c")), tensors["c"].t()),
            "stacked": (Stacked([src("q"), src("k"), src("v")]), torch.cat([tensors[n] for n in "qkv"])),
            "reshaped": (Reshaped(src("p"), (3, 8)), tensors["p"].reshape(3, 8)),
        }
        for name, (view, full) in views.items():
            assert tuple(view.get_shape()) == tuple(full.shape), name
            assert torch.equal(view[:], full), name
            for _ in range(50):
                sl = random_slices(full.shape, rng)
                assert torch.equal(view[sl], full[sl]), (name, sl)
    with pytest.raises(TypeError, match="step 1"):
        Transposed(tensors["c"])[::2]


def test_a_slice_inside_one_stacked_part_is_a_view_of_the_file(stored):
    _, f = stored
    k = f.get_tensor("k")
    block = Stacked([f.get_slice(n) for n in "qkv"])[4:8, 1:3]
    assert block.data_ptr() == k[:, 1:3].data_ptr()  # no copy: the mapped bytes themselves


def test_meta_folder_load_checks_names_and_shapes_and_allocates_nothing(tmp_path):
    make_hf("GPT2LMHeadModel").save_pretrained(tmp_path)
    model = cuboid.load(tmp_path, device="meta")
    assert all(p.is_meta for p in model.parameters()) and model.config.dim == 48
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_positions": 16}))
    with pytest.raises(checkpoint.CheckpointError, match=r"wpe\.weight \(-> pos_emb\.weight\)"):
        cuboid.load(tmp_path, device="meta")


def test_to_hf_keeps_the_other_files_of_the_folder(tmp_path):
    model = cuboid.load("gpt-debug", seed=2, dtype=torch.bfloat16)
    (tmp_path / "tokenizer.json").write_text("{}")
    zoo.to_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"  # save's rule
    checkpoint.verify(tmp_path)  # the same writer as checkpoint.save: sizes and checksums recorded
    back = cuboid.load(tmp_path, dtype=torch.bfloat16)
    for (n, p), q in zip(model.named_parameters(), back.parameters()):
        assert torch.equal(p, q), n
