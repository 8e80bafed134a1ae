"""`cuboid finetune --quantize nf4 --lora`: a QLoRA run from the command line (a tiny Qwen2 folder: q/k/v biases
stay beside the 4-bit weights), adapters in peft's layout in final/; without --lora the run is refused in one
line with exit 2."""
import json

from cuboid.cli import main

from . import fixtures as F


def _data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in F.sentences(24)))
    return path


def test_qlora_finetune_from_the_cli(tmp_path, capsys):
    folder = F.hf_qwen2_folder(tmp_path / "qwen")
    out = tmp_path / "run"
    rc = main(["finetune", "--model", str(folder), "--data", str(_data(tmp_path)), "--task", "causal", "--steps",
               "2", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--lora", "r=4,alpha=8",
               "--quantize", "nf4", "--output-dir", str(out), "--no-progress", "--no-plot"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    files = {p.name for p in (out / "final").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    assert not any(f.startswith("model") for f in files), files
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert any("loss" in x for x in lines)


def test_quantize_without_lora_is_refused(tmp_path, capsys):
    rc = main(["finetune", "--model", "llama-debug", "--data", str(_data(tmp_path)), "--task", "causal",
               "--quantize", "nf4", "--output-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "full fine-tuning of a 4-bit base is not possible" in err[0], err
    rc = main(["finetune", "--model", "llama-debug", "--data", str(_data(tmp_path)), "--task", "causal",
               "--quantize", "int4", "--lora", "r=4", "--output-dir", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "'nf4'" in err[0], err


def test_the_lora_line_counts_the_4bit_base_unpacked():
    """The LoRA line's share is of every parameter the model has: its NF4 weights counted as the values they
    hold (peft's print_trainable_parameters on a 4-bit model), the same total as the model in full precision."""
    import cuboid
    from cuboid.zoo import count_parameters
    from cuboid.zoo.lora import describe

    whole = count_parameters(cuboid.load("qwen3-debug"))
    line = describe(cuboid.load("qwen3-debug", lora="r=4,alpha=8", quantize="nf4"))
    assert f"of the model's {whole:,}" in line, line
    assert line == describe(cuboid.load("qwen3-debug", lora="r=4,alpha=8")), line
