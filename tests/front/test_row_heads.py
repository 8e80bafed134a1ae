"""Rows cut to a length are tokenized only as far as the cut (issue 49 item 15): the same tokens, labels and
counts as tokenizing the whole row and cutting it (SFT in every format, preference pairs, fixed-length rows,
streamed text), with the work bounded by the kept length, not the row's."""
from __future__ import annotations

import random
import sys
import tracemalloc
import types

import pytest

from cuboid.data import pairs as P
from cuboid.data import sft as S
from cuboid.data.chat import TextEncoder, common_prefix, has_generation_markers, head_ids
from cuboid.data.formats import fixed_rows
from cuboid.data.streaming import example_tokenizer
from tests.front.chat_fixtures import chat_tokenizer
from tests.front.fixtures import WORDS, bpe_tokenizer, wordpiece_tokenizer

datasets = pytest.importorskip("datasets")

_UNICODE = ["café", "naïve", "e\u0301te\u0301", "漢字かな交じり", "한국어", "Привет", "👍🏽", "🇫🇷", "ﬁ", "x\u200dy", "١٢٣"]
_SPACES = [" ", "  ", "\n", "\n\n", "\t", "\u00a0", "\u3000", " \n ", "\r\n"]


def random_text(rng: random.Random, size: int) -> str:
    """About ``size`` characters of words, unicode, runs of whitespace, long words without spaces, digits and
    punctuation runs, special-token text now and then."""
    out, n = [], 0
    while n < size:
        kind = rng.random()
        if kind < 0.45:
            piece = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        elif kind < 0.6:
            piece = rng.choice(_UNICODE) * rng.randint(1, 4)
        elif kind < 0.72:
            piece = rng.choice(_SPACES) * rng.randint(1, 40)
        elif kind < 0.8:  # a long word without spaces
            piece = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(30, 3000)))
        elif kind < 0.85:
            piece = rng.choice("a=-.!") * rng.randint(10, 2000)
        elif kind < 0.93:
            piece = str(rng.randint(0, 10 ** 12))
        elif kind < 0.97:
            piece = rng.choice("!?.,;:()[]{}'\"") * rng.randint(1, 6)
        else:
            piece = rng.choice(["<|endoftext|>", "<|im_end|>", "[SEP]", "<unk>", "<s>"])
        out.append(piece + rng.choice(["", " ", " ", "\n"]))
        n += len(out[-1])
    return "".join(out)


def _trained(kind: str):
    """A tokenizer trained on the random texts: ``byte-level`` (GPT-2's pre-tokenizer), ``metaspace``
    (SentencePiece-style unigram, words split at spaces), ``llama`` (BPE over the whole text as one word:
    a prepended and replaced space, no pre-tokenizer, a bos)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(7)
    corpus = [random_text(rng, 300) for _ in range(40)]
    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        specials = dict(eos_token="<|endoftext|>")
    elif kind == "metaspace":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"], unk_token="<unk>",
                                          seed_size=3000, max_piece_length=8, n_sub_iterations=1)
        specials = dict(eos_token="</s>", unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
        specials = dict(eos_token="</s>", bos_token="<s>", unk_token="<unk>")
    tok.train_from_iterator(corpus, trainer)
    if kind == "llama":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    out = {kind: _trained(kind) for kind in ("byte-level", "metaspace", "llama")}
    out["tests-bpe"] = bpe_tokenizer(tmp_path_factory.mktemp("bpe"))
    out["wordpiece"] = wordpiece_tokenizer(tmp_path_factory.mktemp("wordpiece"))
    for style in ("qwen2", "llama3"):
        for markers in (True, False):
            out[style, markers] = chat_tokenizer(tmp_path_factory.mktemp(f"{style}-{markers}"), style, markers)
    return out


class Counted:
    """Counts the characters a tokenizer is handed (every text and list of texts it tokenizes, including
    ``apply_chat_template``'s), while it is installed."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.chars, self.own = tokenizer, 0, tokenizer._encode_plus

    def __enter__(self):
        def counting(text, *args, **kwargs):
            self.chars += len(text) if isinstance(text, str) else sum(len(t) for t in text)
            return self.own(text, *args, **kwargs)

        self.tokenizer._encode_plus = counting
        return self

    def __exit__(self, *exc) -> None:
        del self.tokenizer._encode_plus


# ---------------------------------------------------------------- the first tokens of a text


@pytest.mark.parametrize("kind", ["byte-level", "metaspace", "llama", "tests-bpe", "wordpiece"])
def test_the_first_tokens_of_a_prefix_are_the_whole_text_s(toks, kind):
    tok, rng = toks[kind], random.Random(kind)
    texts = [random_text(rng, rng.choice([800, 3000, 8000])) for _ in range(20)]
    texts += ["".join(rng.choice("abcdefghij") for _ in range(12000)), "a" * 12000, " " * 9000 + "x",
              "\n" * 7000 + "end", "👍🏽" * 3000, "e\u0301" * 6000, "漢字" * 5000]
    for special in (True, False):
        encode = TextEncoder(tok, special)
        for text in texts:
            whole = encode(text)
            for n in (1, 4, 33, 120):
                assert head_ids(text, n, encode) == whole[:n], (kind, special, n, text[:60])


# ---------------------------------------------------------------- SFT rows


def _whole_row(example: dict, tok, fmt: str, template=None) -> tuple:
    """(ids, mask) of a record tokenized whole, by transformers' calls (what SFT did before cutting)."""
    eos = tok.eos_token
    with_eos = lambda s: s + eos if eos and not s.endswith(eos) else s  # noqa: E731
    if fmt == "text":
        ids = tok(with_eos(example["text"]))["input_ids"]
        return ids, [1] * len(ids)
    kw = dict(chat_template=template, tokenize=True, return_dict=True)
    if fmt == "prompt_completion" and isinstance(example["prompt"], str):
        p = tok(example["prompt"])["input_ids"]
        ids = tok(example["prompt"] + with_eos(example["completion"]))["input_ids"]
    elif fmt == "prompt_completion":
        p = tok.apply_chat_template(example["prompt"], add_generation_prompt=True, **kw)["input_ids"]
        ids = tok.apply_chat_template(example["prompt"] + example["completion"], **kw)["input_ids"]
    elif has_generation_markers(template):
        out = tok.apply_chat_template(example["messages"], return_assistant_tokens_mask=True, **kw)
        return list(out["input_ids"]), list(out["assistant_masks"])
    else:  # the prefix method: the turns' tokens between the renderings of the conversation's prefixes
        msgs = example["messages"]
        ids = tok.apply_chat_template(msgs, **kw)["input_ids"]
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                start = 0 if i == 0 else \
                    len(tok.apply_chat_template(msgs[:i], add_generation_prompt=True, **kw)["input_ids"])
                end = len(tok.apply_chat_template(msgs[:i + 1], **kw)["input_ids"])
                mask[start:end] = [1] * (end - start)
        return ids, mask
    n = common_prefix(p, ids)
    return ids, [0] * n + [1] * (len(ids) - n)


def _cut(ids: list, mask: list, max_length: int):
    labels = [t if m else -100 for t, m in zip(ids[:max_length], mask)]
    if all(x == -100 for x in labels[1:]):
        return None, not any(mask[1:])
    return {"input_ids": ids[:max_length], "labels": labels, "truncated": len(ids) > max_length}, False


def _records(rng: random.Random, fmt: str, n: int) -> list:
    """Records whose texts run from a few words to thousands of characters, the long part in the prompt or
    the answer, and some without an answer."""
    def text():
        return random_text(rng, rng.choice([20, 300, 3000, 9000]))

    rows = []
    for i in range(n):
        if fmt == "text":
            rows.append({"text": text()})
        elif fmt == "strings":
            rows.append({"prompt": text(), "completion": "" if i % 7 == 3 else text()})
        elif fmt == "conversational":
            rows.append({"prompt": [{"role": "user", "content": text()}],
                         "completion": [{"role": "assistant", "content": text()}]})
        else:
            msgs = [{"role": "system", "content": text()}] if i % 2 else []
            for _ in range(rng.randint(0 if i % 9 == 4 else 1, 3)):
                msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
            rows.append({"messages": msgs or [{"role": "user", "content": text()}]})
    return rows


CASES = [("text", "byte-level"), ("text", "llama"), ("strings", "metaspace"), ("strings", ("llama3", False)),
         ("conversational", ("qwen2", True)), ("messages", ("qwen2", True)), ("messages", ("qwen2", False)),
         ("messages", ("llama3", True)), ("messages", ("llama3", False))]


@pytest.mark.parametrize("fmt,kind", CASES, ids=[f"{f}-{k}" for f, k in CASES])
def test_sft_rows_are_the_whole_rows_cut(toks, fmt, kind):
    tok, rng = toks[kind], random.Random(f"{fmt}{kind}")
    template = tok.chat_template if isinstance(kind, tuple) else None
    records = _records(rng, fmt, 16)
    sft_fmt = {"strings": "prompt_completion", "conversational": "prompt_completion"}.get(fmt, fmt)
    wholes = [_whole_row(record, tok, sft_fmt, template) for record in records]
    for max_length in (3, 40):
        opts = S.SFTOptions(format=sft_fmt, max_length=max_length, chat_template=template)
        want_counts = S.SFTStats(examples=len(records))
        for record, whole in zip(records, wholes):
            want, no_answer = _cut(*whole, max_length)
            assert S.tokenize_example(record, tok, opts, sft_fmt) == want, (fmt, max_length)
            want_counts.no_answer += no_answer
            want_counts.dropped += want is None and not no_answer
            want_counts.truncated += bool(want and want["truncated"])
        ds = datasets.Dataset.from_list(records)
        _, stats = S.tokenize_dataset(ds, tok, opts)  # the batched path, with its counts
        assert (stats.dropped, stats.no_answer, stats.truncated) == \
            (want_counts.dropped, want_counts.no_answer, want_counts.truncated)


# ---------------------------------------------------------------- preference pairs, fixed rows, streamed text


@pytest.mark.parametrize("kind", ["byte-level", ("qwen2", False)], ids=["strings", "conversations"])
def test_preference_pairs_are_the_whole_pairs_cut(toks, kind):
    tok, rng = toks[kind], random.Random(str(kind))

    def text():
        return random_text(rng, rng.choice([10, 400, 6000]))

    if isinstance(kind, tuple):
        records = [{"prompt": [{"role": "user", "content": text()}],
                    "chosen": [{"role": "assistant", "content": text()}],
                    "rejected": [{"role": "assistant", "content": text()}]} for _ in range(20)]
    else:
        records = [{"prompt": text(), "chosen": text(), "rejected": text()} for _ in range(20)]
    for max_length in (5, 48):
        want, dropped = [], 0
        for record in records:
            p, c, r = P.tokenize_pair(record, tok)  # whole
            if len(p) >= max_length:
                dropped += 1
                continue
            want.append([((p + a)[:max_length], len(p)) for a in (c, r)])
        stats = P.PairStats()
        if want:
            assert P.pair_sequences(records, tok, max_length, stats=stats) == want
            assert stats.dropped == dropped


def test_fixed_rows_and_streamed_text_are_the_whole_text_cut(toks):
    rng = random.Random(3)
    texts = [random_text(rng, rng.choice([50, 3000, 9000])) for _ in range(12)]
    ds = datasets.Dataset.from_dict({"text": texts})
    for kind in ("wordpiece", "byte-level"):
        tok = toks[kind]
        tok.pad_token = tok.pad_token or tok.eos_token
        for seq_len in (6, 64):
            got = fixed_rows(ds, types.SimpleNamespace(n_positions=512), tok, seq_len)
            want = tok(texts, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
            assert got["input_ids"].tolist() == want["input_ids"].tolist()
            assert got["attention_mask"].tolist() == want["attention_mask"].tolist()
            row = example_tokenizer(tok, seq_len)
            for text in texts:
                eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
                ids = (tok(text, add_special_tokens=False)["input_ids"] + eos)[:seq_len]
                assert row({"text": text}) == {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------- the work follows the kept length


def _row(text: str, fmt: str) -> dict:
    if fmt == "text":
        return {"text": text}
    if fmt == "strings":
        return {"prompt": "Say it all:", "completion": " " + text}
    return {"messages": [{"role": "user", "content": "Say it all."}, {"role": "assistant", "content": text}]}


LONG = [("text", "byte-level"), ("strings", "metaspace"), ("messages", ("qwen2", True)),
        ("messages", ("llama3", False))]


@pytest.mark.parametrize("fmt,kind", LONG, ids=["text", "strings", "messages-markers", "messages-prefix"])
def test_a_multi_megabyte_row_costs_what_its_kept_tokens_cost(toks, fmt, kind):
    """A 3 MB row hands the tokenizer as many characters as a 100 kB row with the same start (both only
    their kept start), a small part of what tokenizing the 100 kB row whole hands it; the 3 MB row's Python
    memory stays within a few copies of its text (a whole tokenization holds millions of ids)."""
    tok = toks[kind]
    template = tok.chat_template if isinstance(kind, tuple) else None
    sft_fmt = "prompt_completion" if fmt == "strings" else fmt
    opts = S.SFTOptions(format=sft_fmt, max_length=64, chat_template=template)
    text = random_text(random.Random(11), 100_000)
    medium, big = _row(text, fmt), _row(text * 30, fmt)
    with Counted(tok) as whole:
        ids, _ = _whole_row(medium, tok, sft_fmt, template)
    with Counted(tok) as kept:
        row = S.tokenize_example(medium, tok, opts, sft_fmt)
    assert row["input_ids"] == ids[:64]
    assert kept.chars * 10 < whole.chars, (kept.chars, whole.chars)
    tracemalloc.start()
    try:
        with Counted(tok) as kept_big:
            row_big = S.tokenize_example(big, tok, opts, sft_fmt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert kept_big.chars == kept.chars and row_big == row, (kept_big.chars, kept.chars)
    assert row_big["truncated"] and len(row_big["input_ids"]) == 64
    size = sys.getsizeof(text * 30)
    assert peak < 3 * size, (peak, size)


def test_a_long_pair_and_a_long_fixed_row_cost_what_their_kept_tokens_cost(toks):
    tok = toks["byte-level"]
    tok.pad_token = tok.eos_token
    text = random_text(random.Random(5), 100_000) * 20
    record = {"prompt": "Q: " + text[:200], "chosen": text, "rejected": text[::-1]}
    with Counted(tok) as kept:
        got = P.pair_sequences([record], tok, 32)
    assert kept.chars < 50_000, kept.chars
    p, c, r = P.tokenize_pair({k: v[:20_000] for k, v in record.items()}, tok)  # the same start, tokenized whole
    assert got == [[((p + a)[:32], len(p)) for a in (c, r)]]
    ds = datasets.Dataset.from_dict({"text": [text]})
    with Counted(tok) as kept:
        fixed_rows(ds, types.SimpleNamespace(n_positions=512), tok, 32)
        example_tokenizer(tok, 32)({"text": text})
    assert kept.chars < 50_000, kept.chars


def test_without_transformers_rendering_the_marker_method_tokenizes_whole(toks, monkeypatch):
    """A transformers without ``render_jinja_template``: the marked conversation is tokenized whole, then cut."""
    from cuboid.data import chat

    monkeypatch.setattr(chat, "_render_spans", lambda *a: None)
    tok, rng = toks["qwen2", True], random.Random(9)
    opts = S.SFTOptions(format="messages", max_length=16, chat_template=tok.chat_template)
    for record in _records(rng, "messages", 6):
        want, _ = _cut(*_whole_row(record, tok, "messages", tok.chat_template), 16)
        assert S.tokenize_example(record, tok, opts, "messages") == want
