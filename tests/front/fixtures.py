"""Tiny local models, tokenizers and data files for the fine-tune tests (nothing downloaded)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega red green blue cat dog sun moon good bad happy sad").split()


def sentences(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(text, label) pairs: label 1 when 'good'/'happy' outnumber 'bad'/'sad'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        label = rng.randrange(2)
        mood = ["good", "happy"] if label else ["bad", "sad"]
        words = [rng.choice(WORDS[:-6]) for _ in range(rng.randint(4, 10))] + [rng.choice(mood) for _ in range(2)]
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


def wordpiece_tokenizer(folder: Path):
    """A BERT-style WordPiece tokenizer trained on the test sentences, saved in ``folder``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator([t for t, _ in sentences(300)], trainers.WordPieceTrainer(vocab_size=120,
                                                                                     special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(folder))
    return fast


def bpe_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (GPT-2 style) trained on the test sentences, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([t for t, _ in sentences(300)], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    return fast


def hf_bert_folder(folder: Path, head: str = "cls", num_labels: int = 2) -> Path:
    import transformers as T

    tok = wordpiece_tokenizer(folder)
    cfg = T.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                       vocab_size=len(tok), max_position_embeddings=64, num_labels=num_labels,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = (T.BertForSequenceClassification if head == "cls" else T.BertForMaskedLM)(cfg)
    model.save_pretrained(str(folder))
    return folder


def hf_gpt2_folder(folder: Path) -> Path:
    import transformers as T

    tok = bpe_tokenizer(folder)
    cfg = T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tok), n_positions=64,
                       bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.GPT2LMHeadModel(cfg).save_pretrained(str(folder))
    return folder


def hf_qwen2_folder(folder: Path, head: str = "lm", num_labels: int = 2) -> Path:
    """A tiny random Qwen2 (grouped-query attention, q/k/v biases, tied embeddings) with a local BPE tokenizer."""
    import transformers as T

    tok = bpe_tokenizer(folder)
    cfg = T.Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=96, vocab_size=len(tok), max_position_embeddings=64,
                        tie_word_embeddings=True, num_labels=num_labels, pad_token_id=tok.eos_token_id,
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    (T.Qwen2ForCausalLM if head == "lm" else T.Qwen2ForSequenceClassification)(cfg).save_pretrained(str(folder))
    return folder


def image_folder(folder: Path, per_class: int = 12, size: int = 20) -> Path:
    """Two classes of PNGs: bright top half vs bright bottom half."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for label, name in enumerate(("top", "bottom")):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            a = rng.integers(0, 60, (size, size, 3), dtype=np.uint8)
            rows = slice(0, size // 2) if label == 0 else slice(size // 2, size)
            a[rows] += 180
            Image.fromarray(a).save(folder / name / f"{i}.png")
    return folder
