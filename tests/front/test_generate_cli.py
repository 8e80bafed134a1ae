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
