"""SFT data: our tokenizing against TRL's SFT preprocessing, the prefix method against the generation
markers, alpaca rows, truncation, packing and the batches' widths."""
from __future__ import annotations

import types

import pytest
import torch

from cuboid.data.chat import (encode_conversation, has_generation_markers, prompt_ids, render_prompt,
                         stop_token_ids)
from cuboid.data.formats import DataError, GlobalBatches
from cuboid.tasks import SFT, prepare
from cuboid.data.sft import SFTOptions, SFTStats, detect_format, tokenize_dataset, tokenize_example
from tests.front.chat_fixtures import (alpaca_rows, chat_tokenizer, conversations, messages_rows,
                                       prompt_completion_rows, sharegpt_rows)

datasets = pytest.importorskip("datasets")
CONFIG = types.SimpleNamespace(n_positions=256)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(style, markers) -> the chat tokenizer, loaded back from its folder as a user's would be."""
    from transformers import AutoTokenizer

    out = {}
    for style in ("qwen2", "llama3"):
        for markers in (True, False):
            folder = tmp_path_factory.mktemp(f"{style}-{markers}")
            chat_tokenizer(folder, style, markers)
            out[style, markers] = AutoTokenizer.from_pretrained(str(folder))
    return out


def _rows(ds) -> list:
    return [(list(r["input_ids"]), list(r["labels"])) for r in ds]


def _trl_reference(rows: list, tokenizer, tmp_path, **config) -> list:
    """TRL's own preprocessing of ``rows``: an SFTTrainer built on a tiny model, its train_dataset read."""
    trl = pytest.importorskip("trl")
    import transformers as T

    cfg = T.Qwen2Config(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=32, vocab_size=len(tokenizer), max_position_embeddings=512)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), packing=False, report_to=[], use_cpu=True, bf16=False,
                         **config)
    trainer = trl.SFTTrainer(model=T.Qwen2ForCausalLM(cfg), args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(rows))
    return _rows(trainer.train_dataset)


@pytest.mark.parametrize("style", ["qwen2", "llama3"])
def test_conversations_match_trl_assistant_only_loss(tokenizers, tmp_path, style):
    rows = messages_rows(12, seed=1)
    tok = tokenizers[style, True]
    ours, stats = tokenize_dataset(datasets.Dataset.from_list(rows), tok, SFTOptions(max_length=512))
    ref = _trl_reference(rows, tok, tmp_path, assistant_only_loss=True, max_length=512)
    assert _rows(ours) == ref
    assert stats.dropped == 0 and stats.truncated == 0 and stats.examples == 12
    assert stats.trained_tokens == sum(sum(1 for x in labels[1:] if x != -100) for _, labels in ref)
    # the fixture is what the check needs: system turns, several turns, answers of very different lengths
    convs = conversations(12, seed=1)
    assert any(c[0]["role"] == "system" for c in convs) and any(len(c) >= 6 for c in convs)
    trained = [sum(1 for x in labels if x != -100) for _, labels in ref]
    assert max(trained) > 5 * min(trained)


def test_sharegpt_reads_as_messages(tokenizers):
    tok = tokenizers["qwen2", True]
    rows = sharegpt_rows(6, seed=1)
    rows[0]["conversations"] = [{"from": {"user": "human", "assistant": "gpt"}.get(m["from"], m["from"]),
                                 "value": m["value"]} for m in rows[0]["conversations"]]
    shared, _ = tokenize_dataset(datasets.Dataset.from_list(rows), tok, SFTOptions())
    plain, _ = tokenize_dataset(datasets.Dataset.from_list(messages_rows(6, seed=1)), tok, SFTOptions())
    assert _rows(shared) == _rows(plain)


@pytest.mark.parametrize("style", ["qwen2", "llama3"])
@pytest.mark.parametrize("conversational", [False, True])
def test_prompt_completion_matches_trl_completion_only_loss(tokenizers, tmp_path, style, conversational):
    rows = prompt_completion_rows(10, seed=2, conversational=conversational)
    tok = tokenizers[style, True]
    ours, _ = tokenize_dataset(datasets.Dataset.from_list(rows), tok, SFTOptions(max_length=512))
    ref = _trl_reference(rows, tok, tmp_path, completion_only_loss=True, max_length=512)
    assert _rows(ours) == ref
    ids, labels = ref[0]
    assert -100 in labels and labels[-1] == ids[-1]  # the prompt is masked, the end of the completion trained
    if not conversational:
        assert ids[-1] == tok.eos_token_id          # the eos appended to a plain completion


@pytest.mark.parametrize("style", ["qwen2", "llama3"])
def test_prefix_method_marks_what_the_markers_mark(tokenizers, style):
    plain, marked = tokenizers[style, False], tokenizers[style, True]
    assert not has_generation_markers(plain.chat_template) and has_generation_markers(marked.chat_template)
    ds = datasets.Dataset.from_list(messages_rows(10, seed=3))
    with_markers, _ = tokenize_dataset(ds, marked, SFTOptions(max_length=512))
    by_prefixes, _ = tokenize_dataset(ds, plain, SFTOptions(max_length=512))
    assert _rows(by_prefixes) == _rows(with_markers)
    conv = conversations(4, seed=3)[1]
    ids, mask = encode_conversation(conv, marked, marked.chat_template, markers=False)
    assert (ids, mask) == encode_conversation(conv, marked, marked.chat_template, markers=True)
    eot = marked.convert_tokens_to_ids("<|im_end|>" if style == "qwen2" else "<|eot_id|>")
    ends = [i for i, t in enumerate(ids) if t == eot and mask[i]]
    assert len(ends) == sum(m["role"] == "assistant" for m in conv)  # each answer's end-of-turn is trained


def test_a_template_that_cannot_be_split_says_so(tokenizers):
    tok = tokenizers["qwen2", False]
    counting = ("{{- messages | length }} turns\n{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    ds = datasets.Dataset.from_list(messages_rows(2, seed=4))
    with pytest.raises(DataError, match=r"cannot be split into turns: the conversation up to assistant turn \d+"):
        tokenize_dataset(ds, tok, SFTOptions(chat_template=counting))


def test_messages_without_a_chat_template_name_the_fix(tmp_path):
    from tests.front.fixtures import bpe_tokenizer

    tok = bpe_tokenizer(tmp_path)
    with pytest.raises(DataError, match="--chat-template FILE"):
        tokenize_dataset(datasets.Dataset.from_list(messages_rows(2)), tok, SFTOptions())


def test_alpaca_rows_through_the_alpaca_template(tokenizers):
    tok = tokenizers["llama3", True]
    rows = alpaca_rows(6, seed=5)
    ds, stats = tokenize_dataset(datasets.Dataset.from_list(rows), tok, SFTOptions(template="alpaca"))
    assert stats.kept == 6
    for row, out in zip(rows, ds):
        ids, labels = out["input_ids"], out["labels"]
        text = tok.decode(ids)
        head = "Below is an instruction that describes a task"
        if row["input"]:
            assert f"### Instruction:\n{row['instruction']}\n\n### Input:\n{row['input']}\n\n### Response:" in text
            assert text.startswith(f"<|begin_of_text|>{head}, paired with an input")
        else:
            assert "### Input:" not in text and text.startswith(f"<|begin_of_text|>{head}. Write a response")
        trained = [t for t in labels if t != -100]
        assert tok.decode(trained).strip() == row["output"] + "<|eot_id|>"
        assert ids[len(ids) - len(trained):] == trained  # one trained span, at the end


def test_truncation_keeps_the_start_and_drops_rows_with_nothing_to_learn(tokenizers):
    tok, max_length = tokenizers["qwen2", True], 48
    ds = datasets.Dataset.from_list(messages_rows(24, seed=6))
    full, _ = tokenize_dataset(ds, tok, SFTOptions(max_length=4096))
    cut, stats = tokenize_dataset(ds, tok, SFTOptions(max_length=max_length))
    kept = [(ids[:max_length], labels[:max_length]) for ids, labels in _rows(full)
            if any(x != -100 for x in labels[1:max_length])]
    truncated = sum(len(ids) > max_length for ids, labels in _rows(full)
                    if any(x != -100 for x in labels[1:max_length]))
    assert _rows(cut) == kept
    assert (stats.examples, stats.dropped, stats.truncated) == (24, 24 - len(kept), truncated)
    assert stats.dropped > 0 and truncated > 0 and len(kept) > truncated  # all three kinds of row occur
    assert stats.tokens == sum(len(ids) for ids, _ in kept)
    row = tokenize_example(ds[0], tok, SFTOptions(max_length=4096), "messages")
    assert (row["input_ids"], row["labels"], row["truncated"]) == (*_rows(full)[0], False)


def test_train_on_prompt_trains_every_token(tokenizers):
    tok = tokenizers["qwen2", True]
    ds, _ = tokenize_dataset(datasets.Dataset.from_list(messages_rows(3)), tok, SFTOptions(train_on_prompt=True))
    assert all(ids == labels for ids, labels in _rows(ds))


def test_formats_from_the_columns():
    opts = SFTOptions()
    assert detect_format(["messages"], opts) == "messages"
    assert detect_format(["conversations", "id"], opts) == "messages"
    assert detect_format(["prompt", "completion"], opts) == "prompt_completion"
    assert detect_format(["instruction", "input", "output"], opts) == "alpaca"
    assert detect_format(["text", "meta"], opts) == "text"
    assert detect_format(["body"], SFTOptions(text_column="body")) == "text"
    with pytest.raises(DataError, match=r"no SFT data format fits the columns \(question, answer\); formats: mess"):
        detect_format(["question", "answer"], opts)
    with pytest.raises(DataError, match="unknown template 'vicuna'; templates: alpaca"):
        detect_format(["instruction", "output"], SFTOptions(template="vicuna"))
    with pytest.raises(DataError, match="needs column"):
        detect_format(["text"], SFTOptions(format="messages"))


def test_prepare_pads_to_the_longest_row_and_batches_trim_to_theirs(tokenizers):
    tok = tokenizers["qwen2", True]
    ds = datasets.Dataset.from_list(messages_rows(16, seed=7))
    stats = SFTStats()
    t = prepare(ds, "sft", config=CONFIG, tokenizer=tok, sft=SFTOptions(max_length=256), sft_stats=stats)
    lengths = t["attention_mask"].sum(1)
    assert t["input_ids"].shape == (16, int(lengths.max())) and stats.examples == 16
    assert (t["labels"][t["attention_mask"] == 0] == -100).all()
    assert int((t["labels"][:, 1:] != -100).sum()) == stats.trained_tokens
    for multiple in (1, 8):
        batches = GlobalBatches(t, batch_size=4, seed=0, width_multiple=multiple)
        widths = set()
        for _ in range(4):
            idx = batches.indices(batches.position)
            b = batches.next()
            longest = int(lengths[idx].max())
            assert b["input_ids"].shape[1] == -(-longest // multiple) * multiple
            n = min(longest, b["input_ids"].shape[1])
            assert torch.equal(b["input_ids"][:, :n], t["input_ids"][idx, :n])
            assert (b["labels"][b["attention_mask"] == 0] == -100).all()
            widths.add(b["input_ids"].shape[1])
        assert batches.position == 4 and len(widths) > 1


def test_packed_sft_rows_keep_the_masks(tokenizers):
    tok = tokenizers["llama3", True]
    ds = datasets.Dataset.from_list(messages_rows(16, seed=8))
    plain = prepare(ds, "sft", config=CONFIG, tokenizer=tok, sft=SFTOptions(max_length=128))
    packed = prepare(ds, "sft", config=CONFIG, tokenizer=tok, sft=SFTOptions(max_length=128), packing=True)
    assert packed["input_ids"].shape[1] == 128 and packed["input_ids"].shape[0] < 16
    starts = packed["position_ids"] == 0
    assert (packed["labels"][starts] == -100).all()  # each document's first label
    trained = lambda b: sorted(b["labels"][b["labels"] != -100].tolist())  # noqa: E731
    assert trained(packed) == trained(plain)
    b = GlobalBatches(packed, batch_size=2, width_multiple=8).next()
    assert b["input_ids"].shape[1] == 128  # packed batches are left as they are


def test_a_prepared_folder_is_used_as_is(tokenizers, tmp_path):
    from cuboid.data.packing import pack_dataset

    tok = tokenizers["qwen2", True]
    tokens, _ = tokenize_dataset(datasets.Dataset.from_list(messages_rows(8, seed=9)), tok, SFTOptions())
    tokens.save_to_disk(str(tmp_path / "plain"))
    from_disk = datasets.load_from_disk(str(tmp_path / "plain"))
    direct = prepare(datasets.Dataset.from_list(messages_rows(8, seed=9)), "sft", config=CONFIG, tokenizer=tok)
    again = prepare(from_disk, "sft", config=CONFIG, tokenizer=tok)
    assert all(torch.equal(direct[k], again[k]) for k in ("input_ids", "labels", "attention_mask"))
    packed = pack_dataset(tokens, 200, labels_column="labels", pad_id=tok.pad_token_id)
    t = prepare(packed, "causal", config=CONFIG, tokenizer=tok)
    assert set(t) == {"input_ids", "labels", "position_ids", "attention_mask"} and t["input_ids"].shape[1] == 200
    assert torch.equal(t["labels"], torch.tensor(packed["labels"]))


def test_render_prompt_and_stop_tokens(tokenizers):
    tok = tokenizers["qwen2", False]
    text = render_prompt("alpha beta?", tok, system="Be brief.")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nalpha beta?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert render_prompt([{"role": "user", "content": "hi"}], tok).startswith("<|im_start|>system\nYou are")
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    llama = tokenizers["llama3", False]
    ids = prompt_ids("hi", llama)
    assert ids[0] == llama.bos_token_id and ids.count(llama.bos_token_id) == 1
    assert stop_token_ids(llama) == [llama.convert_tokens_to_ids("<|eot_id|>")]


def test_finetune_config_checks_and_data_options():
    from cuboid.data.formats import eval_batches
    from cuboid.train.config import FinetuneConfig, checked, data_options

    with pytest.raises(ValueError, match="unknown --template 'vicuna'; templates: alpaca"):
        checked(FinetuneConfig(task="sft", template="vicuna"))
    with pytest.raises(ValueError, match="--train-on-prompt apply to --task sft, not causal"):
        checked(FinetuneConfig(task="clm", train_on_prompt=True))
    with pytest.raises(ValueError, match="unknown --data-format 'chat'"):
        checked(FinetuneConfig(task="sft", data_format="chat"))
    cfg = checked(FinetuneConfig(task="sft", packing=True, seq_len=4096, template="alpaca", text_column="body"))
    opts = data_options(cfg, CONFIG, tokenizer=None)
    assert opts["packing"] and isinstance(cfg.task, SFT) and cfg.task.describe() == "sft,template=alpaca"
    assert cfg.task.sft_options(256, opts["text_column"]) == SFTOptions(template="alpaca", max_length=256,
                                                                        text_column="body")
    assert checked(FinetuneConfig(task="clm")).task.name == "causal"
    assert SFT.fits("gpt", "lm") and SFT.fits("llama", "lm") and not SFT.fits("bert", "cls")
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])
    batch = next(eval_batches({"input_ids": mask * 7, "attention_mask": mask}, 2, width_multiple=2))
    assert batch["input_ids"].tolist() == [[7, 7, 0, 0], [7, 7, 7, 0]]
