"""Chat-style tokenizers, tiny chat models and SFT data for the tests (nothing downloaded).

Two template styles, written in the spirit of the real ones:

- ``qwen2``: ChatML (``<|im_start|>role\\n...<|im_end|>\\n``), a default system turn when the
  conversation has none (as Qwen2.5's), eos ``<|im_end|>``, pad ``<|endoftext|>``;
- ``llama3``: a bos, then header blocks (``<|start_header_id|>role<|end_header_id|>\\n\\n``), each turn's
  content trimmed and ended by ``<|eot_id|>``; eos ``<|eot_id|>``, pad ``<|end_of_text|>``; the tokenizer
  puts the bos before plain text, as Llama 3's does.

With ``markers=True`` the template wraps each assistant turn's content and end-of-turn text in
``{% generation %}`` ... ``{% endgeneration %}``, as TRL's training templates do, so transformers'
``return_assistant_tokens_mask`` finds the assistant tokens.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

import torch

from tests.front.fixtures import WORDS, sentences

QWEN2_DEFAULT_SYSTEM = "You are a helpful assistant."

_QWEN2 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN2_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "@GEN{{- message['content'] + '<|im_end|>\\n' }}@END"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "@GEN{{- message['content'] | trim + '<|eot_id|>' }}@END"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# DeepSeek-V3's layout: a bos, the system prompt bare, <｜User｜> and <｜Assistant｜> turns, each answer ended by
# the eos <｜end▁of▁sentence｜>
_DEEPSEEK = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' }}"
    "@GEN{{- message['content'] + '<｜end▁of▁sentence｜>' }}@END"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# gpt-oss's harmony layout: <|start|>role<|message|>...<|end|> turns; the assistant answers in the final channel,
# <|return|> ending the conversation's last answer and <|end|> the others; the markers cover what the model writes
# after the generation prompt <|start|>assistant (the channel header, the answer, its end token)
_HARMONY = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant' }}"
    "@GEN{{- '<|channel|>final<|message|>' + message['content'] + ('<|return|>' if loop.last else '<|end|>') }}@END"
    "{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

STYLES = {
    # style: (template, special tokens, eos, pad, bos)
    "qwen2": (_QWEN2, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|endoftext|>", None),
    "llama3": (_LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>"], "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>"),
    "deepseek": (_DEEPSEEK, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                             "<｜▁pad▁｜>"], "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜begin▁of▁sentence｜>"),
    "harmony": (_HARMONY, ["<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"],
                "<|return|>", "<|endoftext|>", None),
}


def chat_template(style: str, markers: bool = True) -> str:
    """The Jinja chat template of ``style`` ("qwen2" | "llama3" | "deepseek" | "harmony"), with or without generation
    markers."""
    template = STYLES[style][0]
    gen, end = ("{%- generation %}", "{%- endgeneration %}") if markers else ("", "")
    return template.replace("@GEN", gen).replace("@END", end)


def _training_text() -> list[str]:
    extra = ["system user assistant You are a helpful assistant.", "Below is an instruction that describes a task.",
             "### Instruction: ### Input: ### Response: Question: Answer:"]
    return [t for t, _ in sentences(300)] + extra * 20


def chat_tokenizer(folder: Path, style: str = "qwen2", markers: bool = True):
    """A tiny byte-level BPE with the special tokens of ``style`` and its chat template, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if style not in STYLES:
        raise ValueError(f"unknown chat style {style!r}; styles: {', '.join(STYLES)}")
    _, specials, eos, pad, bos = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_training_text(), trainers.BpeTrainer(
        vocab_size=360, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:  # Llama 3's tokenizer puts the bos before plain text
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                                   additional_special_tokens=[s for s in specials if s not in (eos, pad, bos)])
    fast.chat_template = chat_template(style, markers)
    Path(folder).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


def hf_chat_qwen2_folder(folder: Path, markers: bool = True, max_positions: int = 256) -> Path:
    """A tiny random Qwen2ForCausalLM (as fixtures.hf_qwen2_folder) with the qwen2-style chat tokenizer."""
    import transformers as T

    tok = chat_tokenizer(folder, "qwen2", markers)
    cfg = T.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, vocab_size=len(tok), max_position_embeddings=max_positions,
                        tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=None,
                        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.Qwen2ForCausalLM(cfg).save_pretrained(str(folder))
    return Path(folder)


def hf_chat_llama_folder(folder: Path, markers: bool = True, max_positions: int = 256) -> Path:
    """A tiny random LlamaForCausalLM with the llama3-style chat tokenizer."""
    import transformers as T

    tok = chat_tokenizer(folder, "llama3", markers)
    cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, vocab_size=len(tok), max_position_embeddings=max_positions,
                        tie_word_embeddings=False, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(str(folder))
    return Path(folder)


# ---------------------------------------------------------------- data


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _answer(rng: random.Random) -> str:
    """Answers of very different lengths: one word, a few, or dozens."""
    return _words(rng, *rng.choice([(1, 1), (2, 5), (12, 40)]))


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations: every other one opens with a system turn, then 1-3 user/assistant pairs."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "You are " + _words(rng, 1, 3) + "."}] if i % 2 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": _words(rng, 2, 8) + "?"})
            msgs.append({"role": "assistant", "content": _answer(rng)})
        out.append(msgs)
    return out


def messages_rows(n: int, seed: int = 0) -> list[dict]:
    """``{"messages": [...]}`` rows of :func:`conversations`."""
    return [{"messages": c} for c in conversations(n, seed)]


def prompt_completion_rows(n: int, seed: int = 0, conversational: bool = False) -> list[dict]:
    """``prompt``/``completion`` rows: plain strings (the completion starting with a space, as TRL's
    examples), or message lists (a prompt of [system,] user, a completion of one assistant turn)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        question, answer = _words(rng, 2, 8), _answer(rng)
        if conversational:
            prompt = [{"role": "system", "content": "Be " + _words(rng, 1, 2) + "."}] if i % 2 == 0 else []
            prompt.append({"role": "user", "content": question + "?"})
            rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]})
        else:
            rows.append({"prompt": f"Question: {question}? Answer:", "completion": " " + answer})
    return rows


def alpaca_rows(n: int, seed: int = 0) -> list[dict]:
    """Alpaca-style ``instruction``/``input``/``output`` rows; every third input is empty."""
    rng = random.Random(seed)
    return [{"instruction": "Repeat " + _words(rng, 1, 4) + ".",
             "input": "" if i % 3 == 0 else _words(rng, 2, 6),
             "output": _answer(rng)} for i in range(n)]


def sharegpt_rows(n: int, seed: int = 0) -> list[dict]:
    """``{"conversations": [{"from", "value"}, ...]}`` rows (ShareGPT) of the same conversations."""
    return [{"conversations": [{"from": m["role"], "value": m["content"]} for m in c]}
            for c in conversations(n, seed)]


def write_jsonl(rows: Iterable[dict], path: Path) -> Path:
    """``rows`` as a jsonl file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path
