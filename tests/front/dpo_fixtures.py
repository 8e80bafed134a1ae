"""Preference pairs, a tiny chat policy and a different reference for the DPO tests (nothing downloaded)."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from tests.front.chat_fixtures import _answer, _words, hf_chat_qwen2_folder


def string_pairs(n: int, seed: int = 0) -> list[dict]:
    """Plain-text ``prompt``/``chosen``/``rejected`` rows (answers of very different lengths, some long enough
    to be truncated at 64 tokens); every third row has no prompt column value of its own but shares it."""
    rng = random.Random(seed)
    return [{"prompt": f"Question: {_words(rng, 2, 8)}? Answer:", "chosen": " " + _answer(rng),
             "rejected": " " + _answer(rng)} for _ in range(n)]


def conversation_pairs(n: int, seed: int = 0, whole: bool = False) -> list[dict]:
    """Conversational rows with a prompt column (a [system,] user turn), or (``whole``) as two whole dialogues
    without one (chosen/rejected carry the prompt turns, which are taken as the prompt)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": "Be " + _words(rng, 1, 2) + "."}] if i % 3 == 0 else []
        prompt.append({"role": "user", "content": _words(rng, 2, 8) + "?"})
        chosen = [{"role": "assistant", "content": _answer(rng)}]
        rejected = [{"role": "assistant", "content": _answer(rng)}]
        if whole:
            rows.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def policy_and_reference(folder: Path) -> tuple:
    """(policy folder, reference folder): the tiny random chat Qwen2 and the same model drawn with another
    seed, each with the chat tokenizer."""
    import transformers as T

    policy = hf_chat_qwen2_folder(Path(folder) / "policy")
    ref = Path(folder) / "ref"
    torch.manual_seed(1)
    T.Qwen2ForCausalLM(T.AutoConfig.from_pretrained(policy)).save_pretrained(str(ref))
    T.AutoTokenizer.from_pretrained(policy).save_pretrained(str(ref))
    return policy, ref
