"""A reward model or a text classifier started from a causal LM's folder, as TRL's RewardTrainer starts one
(``AutoModelForSequenceClassification.from_pretrained`` on a ``*ForCausalLM`` checkpoint, ``num_labels=1``): the
body's weights load, a new ``score`` head is initialised, ``lm_head`` is dropped, said in one line; ``final/``
loads in transformers as ``*ForSequenceClassification`` with cuboid's outputs. ``cuboid.load(folder, head="cls",
num_labels=N)`` does the same from Python. A tiny random Qwen3ForCausalLM (untied LM head, no pad id in its config)
with a chat tokenizer, built here."""
from __future__ import annotations

import json

import pytest
import torch

import cuboid

from . import chat_fixtures as CF
from . import fixtures as F
from .test_finetune import cli_here, metrics
from .test_reward import string_pairs


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    import transformers as T

    folder = tmp_path_factory.mktemp("causal") / "qwen3"
    tok = CF.chat_tokenizer(folder, "qwen2")
    cfg = T.Qwen3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=96, vocab_size=len(tok), max_position_embeddings=256,
                        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.Qwen3ForCausalLM(cfg).save_pretrained(str(folder))
    return folder


IDS = torch.tensor([[5, 9, 14, 3, 7, 12], [7, 2, 8, 11, 4, 6]])


def test_load_a_causal_lm_under_a_new_score_head_as_transformers_does(qwen3, capsys):
    import transformers as T

    capsys.readouterr()
    ours = cuboid.load(str(qwen3), head="cls", num_labels=3).eval()
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"{qwen3}: Qwen3ForCausalLM read as Qwen3ForSequenceClassification: lm_head dropped, a new "
                    f"score head of 3 outputs (initialised)"], said
    assert ours.config.head == "cls" and ours.config.num_labels == 3
    hf = T.AutoModelForSequenceClassification.from_pretrained(qwen3, num_labels=3, pad_token_id=0).eval()
    with torch.no_grad():  # the bodies are the same: with HF's new score weights, the same scores
        ours.classifier.weight.copy_(hf.score.weight)
        assert torch.allclose(ours(input_ids=IDS).logits, hf(input_ids=IDS).logits, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="apply to presets"):
        cuboid.load(str(qwen3), n_layers=3)
    # the new head is drawn from the load's seed (--seed), the body is the folder's whatever the seed
    again, other = (cuboid.load(str(qwen3), head="cls", num_labels=3, seed=s) for s in (0, 1))
    assert torch.equal(again.classifier.weight, cuboid.load(str(qwen3), head="cls", num_labels=3).classifier.weight)
    assert not torch.equal(again.classifier.weight, other.classifier.weight)
    assert torch.equal(again.blocks[0].attn.q.weight, other.blocks[0].attn.q.weight)


def test_finetune_reward_from_a_causal_lm_folder(qwen3, tmp_path, capsys):
    import transformers as T

    pairs = [dict(p, chosen=p["chosen"] + " sun", rejected=p["rejected"] + " moon") for p in string_pairs(16, seed=5)]
    data = CF.write_jsonl(pairs, tmp_path / "pairs.jsonl")
    run = tmp_path / "run"
    capsys.readouterr()
    rc = cli_here("finetune", "--model", str(qwen3), "--data", str(data), "--task", "reward", "--max-length", "128",
                  "--steps", "4", "--batch-size", "4", "--lr", "1e-2", "--log-every", "1", "--eval-every", "4",
                  "--no-progress", "--no-plot", "--output-dir", str(run))
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    said = [line for line in err.splitlines() if "read as" in line]
    assert said == [f"{qwen3}: Qwen3ForCausalLM read as Qwen3ForSequenceClassification: lm_head dropped, a new "
                    f"score head of 1 output (initialised)"], said
    assert len([m for m in metrics(run) if "loss" in m]) == 4
    hf = T.AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    tok = T.AutoTokenizer.from_pretrained(qwen3)
    assert type(hf).__name__ == "Qwen3ForSequenceClassification" and hf.config.num_labels == 1
    assert hf.config.pad_token_id == tok.pad_token_id
    assert "lm_head.weight" not in json.dumps(json.loads((run / "final" / "config.json").read_text()))
    ids = IDS.clone()
    ids[0, -2:] = tok.pad_token_id
    ours = cuboid.load(str(run / "final")).eval()
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_finetune_seqcls_from_a_causal_lm_folder_with_num_labels(qwen3, tmp_path, capsys):
    import transformers as T

    rows = [{"text": t, "label": y} for t, y in F.sentences(24)]
    data = CF.write_jsonl(rows, tmp_path / "texts.jsonl")
    run = tmp_path / "run"
    capsys.readouterr()
    rc = cli_here("finetune", "--model", str(qwen3), "--data", str(data), "--task", "seqcls", "--num-labels", "3",
                  "--seq-len", "24", "--steps", "2", "--batch-size", "4", "--no-progress", "--no-plot",
                  "--output-dir", str(run))
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert any(line.endswith("a new score head of 3 outputs (initialised)") for line in err.splitlines()), err
    hf = T.AutoModelForSequenceClassification.from_pretrained(run / "final").eval()
    assert type(hf).__name__ == "Qwen3ForSequenceClassification" and hf.config.num_labels == 3
    ours = cuboid.load(str(run / "final")).eval()
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=IDS).logits, ours(input_ids=IDS).logits, rtol=1e-4, atol=1e-5)


def test_a_new_head_under_lora_and_a_bad_num_labels_are_one_line(qwen3, tmp_path, capsys):
    data = CF.write_jsonl([{"text": t, "label": y} for t, y in F.sentences(12)], tmp_path / "texts.jsonl")
    common = ["--model", str(qwen3), "--data", str(data), "--steps", "1", "--batch-size", "4", "--no-progress",
              "--no-plot"]
    capsys.readouterr()
    assert cli_here("finetune", *common, "--task", "seqcls", "--lora", "r=4", "--output-dir", str(tmp_path / "a")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LoRA would leave untrained" in err[0], err
    assert cli_here("finetune", *common, "--task", "seqcls", "--num-labels", "0", "--output-dir",
                    str(tmp_path / "b")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-labels 0" in err[0], err
