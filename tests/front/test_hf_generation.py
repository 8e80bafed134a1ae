"""A chat SFT run's folders carry the special token ids (issue 51): ``final/`` loaded with transformers'
``AutoModelForCausalLM`` stops in ``generate`` where ``cuboid generate --chat`` stops, at the template's
end-of-turn token, which is not the tokenizer's eos (a base tokenizer, as Llama 3's and Qwen2.5's), and
every ``checkpoint-N/`` carries the same ids. A LoRA run's ``final/`` carries the generation config, and
``cuboid convert --merge-lora`` takes it into the merged folder, which stops in transformers too.

The source folder has no generation config, so the end-of-turn id can only come from the template. Its LM
head is changed before the run so that the model ends its turn a few tokens into the answer, and the run
trains at a negligible lr (its greedy tokens stay the source's): the test needs a model that stops."""
from __future__ import annotations

import json

import pytest

from cuboid.cli import main

from . import chat_fixtures as CF
from .test_generate_chat import EOS, EOT, QUESTION, SYSTEM, base_style_folder, first_new, greedy, swap_head_rows

NEW = 10  # tokens generate may add


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The llama3-style base folder whose greedy answer ends its turn at a step k >= 1 (its eos is another
    token), without a generation_config.json."""
    import transformers as T

    folder = base_style_folder(tmp_path_factory.mktemp("src") / "model")
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    said = greedy(folder, [conversation], NEW)[0]
    eot = T.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(EOT)
    swap_head_rows(folder, said[first_new(said)], eot)
    (folder / "generation_config.json").unlink()
    return folder


def transformers_answer(folder) -> list:
    """transformers' greedy answer from ``folder`` with nothing but what the folder says (its generation
    config decides where it stops)."""
    import torch
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model.generate(**ids, max_new_tokens=NEW, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()


def _sft_run(source, tmp_path, capsys, *flags):
    """A chat SFT run of ``source`` that barely moves the weights (lr 1e-9); its output folder."""
    data = CF.write_jsonl(CF.messages_rows(24, seed=3), tmp_path / "chat.jsonl")
    out = tmp_path / "run"
    rc = main(["finetune", "--model", str(source), "--data", str(data), "--task", "sft", "--batch-size", "4",
               "--lr", "1e-9", "--max-length", "128", "--no-progress", "--no-plot", "--output-dir", str(out), *flags])
    assert rc == 0, capsys.readouterr().err
    return out


def test_final_folder_stops_in_transformers_where_cuboid_generate_chat_stops(source, tmp_path, capsys):
    import transformers as T

    out = _sft_run(source, tmp_path, capsys, "--steps", "2", "--save-every", "1")
    tok = T.AutoTokenizer.from_pretrained(out / "final")
    eos, eot, bos = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT), tok.bos_token_id
    assert tok.eos_token_id == eos != eot
    for folder in (out / "final", out / "checkpoint-1"):
        config = json.loads((folder / "config.json").read_text())
        assert (config["eos_token_id"], config["bos_token_id"]) == (eos, bos), folder
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [eos, eot] and generation["bos_token_id"] == bos, folder

    new = transformers_answer(out / "final")
    assert 1 < len(new) < NEW and new[-1] == eot and eot not in new[:-1], new  # it stopped at the turn's end
    capsys.readouterr()
    rc = main(["generate", "--model", str(out / "final"), "--chat", "--system", SYSTEM, "--prompt", QUESTION,
               "--max-new-tokens", str(NEW)])
    said = capsys.readouterr().out
    assert rc == 0 and said == tok.decode(new[:-1], skip_special_tokens=True) + "\n", said


def test_a_lora_run_s_merged_folder_stops_too(source, tmp_path, capsys):
    import transformers as T

    out = _sft_run(source, tmp_path, capsys, "--steps", "1", "--lora", "r=4,alpha=8")
    tok = T.AutoTokenizer.from_pretrained(out / "final")
    eos, eot = tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(EOT)
    assert json.loads((out / "final" / "generation_config.json").read_text())["eos_token_id"] == [eos, eot]
    rc = main(["convert", str(out / "final"), str(tmp_path / "merged"), "--merge-lora", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    new = transformers_answer(tmp_path / "merged")
    assert 1 < len(new) < NEW and new[-1] == eot and eot not in new[:-1], new
