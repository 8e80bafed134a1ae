"""`cuboid finetune --lora`: adapters only, checkpoints in peft's layout, exact resume of adapters and their
optimizer state, and a final folder peft loads."""
from __future__ import annotations

import shutil

import pytest
import torch

import cuboid

from . import fixtures as F

peft = pytest.importorskip("peft")


def _adapters(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def test_lora_finetune_saves_adapters_and_resumes_exactly(tmp_path):
    import datasets
    import transformers as T

    model = F.hf_gpt2_folder(tmp_path / "gpt")
    rows = F.sentences(64)
    data = datasets.Dataset.from_dict({"text": [t for t, _ in rows]})
    opts = dict(task="causal", steps=6, batch_size=4, seq_len=24, lr=1e-2, lora="r=4,alpha=8,targets=attn+mlp",
                eval_every=3, save_every=3, progress=False, plot=False)
    a = tmp_path / "a"
    cuboid.finetune(str(model), data, output_dir=str(a), **opts)
    for name in ("checkpoint-3", "checkpoint-6", "final"):
        files = {p.name for p in (a / name).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files, (name, files)
        assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files), (name, files)
    final = _adapters(a / "final")
    assert any(float(t.abs().max()) > 0 for k, t in final.items() if ".lora_B." in k)

    # resume from checkpoint-3 in another folder: the same adapters at step 6 (optimizer state restored too)
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "checkpoint-3", b / "checkpoint-3")
    cuboid.finetune(str(model), data, output_dir=str(b), resume="latest", **opts)
    again = _adapters(b / "final")
    assert final.keys() == again.keys()
    for k in final:
        assert torch.equal(final[k], again[k]), k

    # peft loads the final adapters onto the base folder, with cuboid's logits
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = cuboid.load(model, lora=a / "final").eval()
    theirs = peft.PeftModel.from_pretrained(T.GPT2LMHeadModel.from_pretrained(model), a / "final").eval()
    with torch.no_grad():
        assert (ours(input_ids=ids).logits - theirs(input_ids=ids).logits).abs().max() < 1e-5
