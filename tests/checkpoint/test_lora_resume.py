"""A LoRA run's checkpoints are kept as full ones are (issue 39, case 1 and the adapter side of case 5):
safetensors and JSON with every file's SHA-256 in the commit record, verified before a resume reads them,
nothing unpickled (a crafted ``lora-rank00000.pt`` runs no code), resumable under another plan and world
size; an adapter config's rank is checked against the weights' shapes before any adapter is allocated."""
from __future__ import annotations

import json
import pickle
import shutil
import time

import pytest
import torch

import cuboid
from cuboid.zoo.checkpoint import CheckpointError
from cuboid.zoo.checkpoint.lora_state import LORA_COMMIT, verify_lora

from ..front import fixtures as F
from ..front.test_finetune import cli, metrics

OPTS = dict(task="causal", batch_size=4, seq_len=24, lr=1e-2, lora="r=4,alpha=8,targets=attn+mlp",
            eval_every=100, log_every=1, progress=False, plot=False)


@pytest.fixture(scope="module", autouse=True)
def torch_kernels():
    """The kernels a user's CPU run takes (not the Triton interpreter these folders' tests switch on)."""
    from cuboid.kernels import use_backend

    with use_backend("torch"):
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory, torch_kernels):
    """(model folder, data, output folder of a 2-step LoRA run saved at each step)."""
    import datasets

    root = tmp_path_factory.mktemp("lora")
    model = F.hf_gpt2_folder(root / "gpt")
    data = datasets.Dataset.from_dict({"text": [t for t, _ in F.sentences(48)]})
    out = root / "out"
    cuboid.finetune(str(model), data, output_dir=str(out), steps=2, save_every=1, **OPTS)
    return model, data, out


class _Marker:
    """Unpickling this writes a marker file: what a hostile pickle could do instead (it never runs here)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return exec, (f"open({self.path!r}, 'w').write('unpickled')",)


def _plant_pickle(folder, marker):
    with open(folder / "lora-rank00000.pt", "wb") as f:
        pickle.dump({"optimizer": _Marker(marker)}, f)


def test_the_checkpoint_is_safetensors_and_json_with_checksums(run):
    _, _, out = run
    ckpt = out / "checkpoint-2"
    names = {p.name for p in ckpt.iterdir()}
    assert not any(n.endswith((".pt", ".bin", ".pkl")) for n in names), names
    record = json.loads((ckpt / LORA_COMMIT).read_text())
    assert set(record["files"]) == names - {LORA_COMMIT}
    report = verify_lora(ckpt)
    assert report["files"] == len(names) and report["tensors"] > 0
    from safetensors import safe_open

    with safe_open(str(ckpt / "optimizer.safetensors"), "pt") as f:  # the state by parameter name, full
        assert any(k.endswith(".lora_A.weight/exp_avg") for k in f.keys())


def test_convert_verify_reads_a_lora_checkpoint_and_refuses_a_flipped_byte(run, tmp_path):
    _, _, out = run
    rc, stdout, stderr = cli("convert", "--verify", str(out / "checkpoint-2"))
    assert rc == 0, stderr
    bad = tmp_path / "bad"
    shutil.copytree(out / "checkpoint-2", bad)
    weights = bad / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-1] ^= 0xFF
    weights.write_bytes(bytes(raw))
    rc, _, stderr = cli("convert", "--verify", str(bad))
    assert rc != 0 and "adapter_model.safetensors" in stderr, stderr


def test_a_planted_pickle_is_never_unpickled(run, tmp_path):
    model, data, out = run
    marker = tmp_path / "marker"
    _plant_pickle(tmp_path, marker)
    with open(tmp_path / "lora-rank00000.pt", "rb") as f:  # the harness: unpickling it does run code
        pickle.load(f)
    assert marker.read_text() == "unpickled"
    marker.unlink()
    ckpt = tmp_path / "b" / "checkpoint-1"
    shutil.copytree(out / "checkpoint-1", ckpt)
    _plant_pickle(ckpt, marker)  # beside a valid checkpoint: ignored, never read
    result = cuboid.finetune(str(model), data, output_dir=str(tmp_path / "b"), resume=str(ckpt), steps=2, **OPTS)
    assert result["step"] == 2 and not marker.exists()
    old = tmp_path / "old" / "checkpoint-1"  # an older layout: the pickle and no commit record
    shutil.copytree(out / "checkpoint-1", old)
    (old / LORA_COMMIT).unlink()
    _plant_pickle(old, marker)
    with pytest.raises(CheckpointError, match="no lora-checkpoint.json.*pickled state"):
        cuboid.finetune(str(model), data, output_dir=str(tmp_path / "old"), resume=str(old), steps=2, **OPTS)
    assert not marker.exists()


@pytest.mark.parametrize("file, where", [("optimizer.safetensors", -3), ("adapter_model.safetensors", -3),
                                         ("trainer_state.json", 20), (LORA_COMMIT, 30)])
def test_a_corrupted_lora_checkpoint_is_refused_on_resume(run, tmp_path, file, where):
    model, data, out = run
    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(out / "checkpoint-1", ckpt)
    raw = bytearray((ckpt / file).read_bytes())
    raw[where] ^= 0x01
    (ckpt / file).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        verify_lora(ckpt)
    with pytest.raises(CheckpointError, match="corrupt|SHA-256|JSON"):
        cuboid.finetune(str(model), data, output_dir=str(tmp_path), resume="latest", steps=2, **OPTS)


def test_an_adapter_rank_beyond_the_weights_is_refused_before_allocation(run, tmp_path):
    model, _, out = run
    folder = tmp_path / "adapters"
    shutil.copytree(out / "final", folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg["r"] = 300000
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="adapter_config.json"):  # cuboid's folder: its record says so
        cuboid.load(str(model), lora=str(folder))
    (folder / "lora-adapters.json").unlink()  # a peft folder from elsewhere: no record, read as data
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="r=300000 does not match"):
        cuboid.load(str(model), lora=str(folder))
    assert time.perf_counter() - t0 < 10
    cfg["r"] = "4"
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'r' must be a whole number"):
        cuboid.load(str(model), lora=str(folder))
    ckpt = tmp_path / "checkpoint"  # a training checkpoint given as the adapters: its own record is checked
    shutil.copytree(out / "checkpoint-2", ckpt)
    (ckpt / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="adapter_config.json"):
        cuboid.load(str(model), lora=str(ckpt))


def _flat(folder):
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    return torch.cat([tensors[k].flatten() for k in sorted(tensors)])


def test_a_tp1d_lora_checkpoint_resumes_under_dp2_and_on_one_device(run, tmp_path):
    """Saved under tp1d on 2 ranks at step 2 of 3; resumed under dp=2 and on one device, step 3 is the
    uninterrupted run's: its loss (1e-5) and the adapters after it (the optimizer state resharded by name)."""
    from tests.parallel.test_plans import rel_norm

    model, data, _ = run
    text = tmp_path / "data.jsonl"
    data.to_json(str(text))
    common = ["finetune", "--model", str(model), "--data", str(text), "--task", "causal", "--batch-size", "4",
              "--seq-len", "24", "--lr", "1e-2", "--lora", "r=4,alpha=8,targets=attn+mlp", "--eval-every", "100",
              "--log-every", "1", "--no-progress", "--no-plot", "--steps", "3"]
    straight = tmp_path / "tp"
    rc, _, err = cli(*common, "--plan", "tp1d", "--save-every", "2", "--output-dir", str(straight), timeout=600)
    assert rc == 0, err[-3000:]
    want = metrics(straight)
    assert [r["step"] for r in want] == [1, 2, 3]
    want_adapters = _flat(straight / "final")
    assert rel_norm(_flat(straight / "checkpoint-2"), want_adapters) > 1e-3  # step 3 moves the adapters
    for plan in ("dp=2", "single"):
        out = tmp_path / plan.replace("=", "")
        rc, _, err = cli(*common, "--plan", plan, "--output-dir", str(out), "--resume",
                         str(straight / "checkpoint-2"), timeout=600)
        assert rc == 0, (plan, err[-3000:])
        assert "resumed from" in err
        got = metrics(out)
        assert [r["step"] for r in got] == [3], plan
        assert got[0]["loss"] == pytest.approx(want[2]["loss"], rel=1e-5), plan
        # the adapters after the resumed step: Adam's moments restored by name under another plan
        assert rel_norm(_flat(out / "final"), want_adapters) < 1e-6, plan
