"""`cuboid generate --chat`: the folder's chat template applied (with --system), the answer alone printed, ending
at the template's end-of-turn token or at eos, the same tokens as transformers' generate on the rendered prompt."""
from __future__ import annotations

import json

import pytest
import torch

from . import chat_fixtures as CF
from . import fixtures as F
from .test_finetune import cli, cli_here

EOS, EOT = "<|end_of_text|>", "<|eot_id|>"
SYSTEM, QUESTION = "Be brief.", "what is red"


def base_style_folder(folder):
    """The llama3-style chat folder with a base model's tokenizer: eos ``<|end_of_text|>``, so the turn's
    end ``<|eot_id|>`` is another token (as in Llama 3 and Qwen2.5 base tokenizers)."""
    import transformers as T

    CF.hf_chat_llama_folder(folder)
    tok = T.AutoTokenizer.from_pretrained(folder)
    tok.eos_token = EOS
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", EOT]})
    tok.save_pretrained(folder)
    return folder


def greedy(folder, conversations: list, new: int) -> list:
    """transformers' greedy tokens after each rendered conversation (one left-padded batch), untruncated."""
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = T.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
           for c in conversations]
    enc = tok.pad({"input_ids": ids}, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    return [row.tolist() for row in out[:, enc["input_ids"].shape[1]:]]


def swap_head_rows(folder, a: int, b: int) -> None:
    """The LM head's rows of tokens ``a`` and ``b`` swapped: the model now says ``b`` where it said ``a``."""
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        w = model.lm_head.weight
        w[[a, b]] = w[[b, a]]
    model.save_pretrained(folder)


def first_new(tokens: list) -> int:
    """The first step k >= 1 whose token was not said before it."""
    return next(k for k in range(1, len(tokens)) if tokens[k] not in tokens[:k])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return base_style_folder(tmp_path_factory.mktemp("chat") / "llama")


@pytest.mark.parametrize("stop", [EOT, EOS])
def test_the_answer_ends_at_the_turns_end_or_at_eos(folder, tmp_path, stop):
    import shutil

    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    said = greedy(folder, [conversation], 8)[0]
    stop_id = tok.convert_tokens_to_ids(stop)
    assert tok.convert_tokens_to_ids(EOT) not in said and tok.eos_token_id not in said
    k = first_new(said)
    model = shutil.copytree(folder, tmp_path / "model")
    swap_head_rows(model, said[k], stop_id)  # the model now ends its turn (or says eos) at step k
    assert greedy(model, [conversation], 8)[0][:k + 1] == said[:k] + [stop_id]
    rc, out, err = cli("generate", "--model", str(model), "--chat", "--system", SYSTEM, "--prompt", QUESTION,
                       "--max-new-tokens", "8")
    assert rc == 0, err
    assert out == tok.decode(said[:k], skip_special_tokens=True) + "\n"  # no prompt, nothing after the stop
    assert k >= 1 and out.strip()


def test_prompts_file_holds_one_conversation_a_line(folder, tmp_path):
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(folder)
    turns = [{"role": "user", "content": "blue cat"}, {"role": "assistant", "content": "sun"},
             {"role": "user", "content": "and the moon"}]
    (tmp_path / "chats.txt").write_text(f"{QUESTION}\n\n{json.dumps(turns)}\n{json.dumps({'messages': turns[:1]})}\n")
    rc, out, err = cli("generate", "--model", str(folder), "--chat", "--system", SYSTEM, "--prompts",
                       str(tmp_path / "chats.txt"), "--max-new-tokens", "5")
    assert rc == 0, err
    system = [{"role": "system", "content": SYSTEM}]
    want = greedy(folder, [system + [{"role": "user", "content": QUESTION}], system + turns, system + turns[:1]], 5)
    stops = {tok.eos_token_id, tok.convert_tokens_to_ids(EOT)}
    lines = []
    for i, tokens in enumerate(want):
        cut = next((j for j, t in enumerate(tokens) if t in stops), len(tokens))
        lines.append(f"[{i}] {tok.decode(tokens[:cut], skip_special_tokens=True)}")
    assert out == "\n".join(lines) + "\n"


def test_chat_needs_a_template_and_system_needs_chat(tmp_path, capsys):
    plain = F.hf_qwen2_folder(tmp_path / "plain")  # its tokenizer has no chat template
    capsys.readouterr()
    # the refusals in this process (no model runs); the run that generates as a user runs it
    rc = cli_here("generate", "--model", str(plain), "--chat", "--prompt", "hi", "--max-new-tokens", "2")
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "no chat template" in err and len(err.strip().splitlines()) == 1, err
    rc = cli_here("generate", "--model", str(plain), "--system", "Be brief.", "--prompt", "hi")
    err = capsys.readouterr().err
    assert rc == 2 and "--system and --chat-template go with --chat" in err, err
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                         "{% if add_generation_prompt %}assistant:{% endif %}")
    rc, out, err = cli("generate", "--model", str(plain), "--chat", "--chat-template", str(tmp_path / "chat.jinja"),
                       "--prompt", "hi", "--max-new-tokens", "2")
    assert rc == 0 and out.endswith("\n") and "<|im_start|>" not in out, err
