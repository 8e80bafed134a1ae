"""`cuboid generate`: streamed text from a small local folder with its own tokenizer, equal to transformers'."""
import torch

from . import fixtures as F
from .test_finetune import cli


def test_generate_streams_one_prompt_and_batches_a_file(tmp_path):
    import transformers as T

    folder = F.hf_qwen2_folder(tmp_path / "qwen")
    tok = T.AutoTokenizer.from_pretrained(folder)
    hf = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = "the film was"
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    want = hf.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id,
                       eos_token_id=tok.eos_token_id)
    rc, out, err = cli("generate", "--model", str(folder), "--prompt", prompt, "--max-new-tokens", "12")
    assert rc == 0, err
    assert out == prompt + tok.decode(want[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) + "\n"

    (tmp_path / "prompts.txt").write_text("the film was\na long and\n\nwe liked the\n")
    rc, out, err = cli("generate", "--model", str(folder), "--prompts", str(tmp_path / "prompts.txt"),
                       "--max-new-tokens", "6", "--temperature", "0.7", "--seed", "1")
    assert rc == 0, err
    assert out.startswith("[0] the film was") and "\n[1] a long and" in out and "\n[2] we liked the" in out
    again = cli("generate", "--model", str(folder), "--prompts", str(tmp_path / "prompts.txt"),
                "--max-new-tokens", "6", "--temperature", "0.7", "--seed", "1")[1]
    assert again == out  # seeded

    rc, _, err = cli("generate", "--model", str(folder))
    assert rc == 2 and "give one of --prompt TEXT or --prompts FILE" in err
    assert torch.is_tensor(want)


def test_generate_runs_on_a_merged_lora_folder(tmp_path):
    """``convert --merge-lora`` writes the tokenizer and generation config beside the merged weights: the adapter
    folder's when it has them (as a fine-tune's final/ does), else the base's; ``generate`` then runs on it."""
    import cuboid
    from cuboid.cli import main
    from cuboid.zoo.lora import save_adapters

    base = F.hf_qwen2_folder(tmp_path / "qwen")
    (base / "generation_config.json").write_text('{"max_new_tokens": 5}\n')
    model = cuboid.load(base, lora=dict(r=2, alpha=4, targets=("q", "v")))
    save_adapters(model, tmp_path / "adapters", base=str(base))
    rc, _, err = cli("convert", str(tmp_path / "adapters"), str(tmp_path / "merged"), "--merge-lora", "--quiet")
    assert rc == 0, err
    merged = tmp_path / "merged"
    for name in ("tokenizer.json", "generation_config.json"):
        assert (merged / name).read_bytes() == (base / name).read_bytes(), name
    rc, out, err = cli("generate", "--model", str(merged), "--prompt", "the film was", "--max-new-tokens", "4")
    assert rc == 0, err
    assert out.startswith("the film was") and len(out) > len("the film was\n"), out

    # the adapter folder's own tokenizer wins over the base's, also through the sharded path
    (tmp_path / "adapters" / "tokenizer_config.json").write_text('{"model_max_length": 77}\n')
    (tmp_path / "adapters" / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    assert main(["convert", str(tmp_path / "adapters"), str(tmp_path / "sharded"), "--merge-lora",
                 "--max-shard-size", "100000", "--quiet"]) == 0
    sharded = tmp_path / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    assert (sharded / "tokenizer_config.json").read_text() == '{"model_max_length": 77}\n'
    assert (sharded / "generation_config.json").is_file()
