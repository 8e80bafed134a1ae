"""``cuboid generate``: text from a causal LM, streamed as it comes.

    cuboid generate --model FOLDER|PRESET --prompt "Once upon a time" [--max-new-tokens 64]
    cuboid generate --model FOLDER --prompts prompts.txt --temperature 0.8 --top-p 0.9 --seed 0
    cuboid generate --model FOLDER --chat --prompt "What is a cuboid?" [--system "Be brief."]

One prompt streams its continuation token by token; ``--prompts`` (one per
line) generates for all of them as one left-padded batch and prints each.
Greedy unless ``--temperature``, ``--top-k`` or ``--top-p`` ask for sampling.
``--chat`` renders the prompt as a user turn with the folder's chat template
(``--system`` adds a system turn; with ``--prompts`` each line is a
conversation: a user message, or a JSON list of role/content messages) and
prints only the answer, which ends at the template's end-of-turn token or eos.
Under torchrun, ``--plan`` spreads the model (tensor parallelism; every rank
draws the same tokens, rank 0 prints). Errors are one line, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from cuboid.cli.eval import add_model_arguments, load_model_and_tokenizer


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``generate`` on an ``add_subparsers()`` object; the handler is ``args.func``."""
    p = subparsers.add_parser("generate", help="generate text from a causal LM with a key/value cache",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    add_model_arguments(p)
    p.add_argument("--prompt", help="one prompt (streamed)")
    p.add_argument("--prompts", help="a text file of prompts, one per line (a batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to add (default 64)")
    p.add_argument("--temperature", type=float, help="sample with this temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this probability")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--chat", action="store_true", help="apply the folder's chat template; print only the answer")
    p.add_argument("--system", help="--chat: a system turn before each conversation (replacing its own)")
    p.add_argument("--chat-template", help="--chat: a Jinja chat template file used instead of the folder's")
    p.set_defaults(func=run)
    return p


def _conversation(line: str):
    """A ``--prompts`` line under ``--chat``: a JSON list of messages (or an object with ``messages``), else
    the text of one user turn."""
    if line.lstrip()[:1] in "[{":
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            return line
        value = value.get("messages") if isinstance(value, dict) else value
        if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
            return value
        raise ValueError(f"a --prompts line holds JSON that is not a list of role/content messages: {line[:60]}")
    return line


def _encode(args: argparse.Namespace, prompts: list, tok):
    """(input ids, attention mask) of the prompts, left-padded, and the ids that stop an answer."""
    if not args.chat:
        if args.system is not None or args.chat_template is not None:
            raise ValueError("--system and --chat-template go with --chat")
        enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"], [tok.eos_token_id]
    from cuboid.data.chat import prompt_ids, stop_token_ids

    ids = [prompt_ids(_conversation(p), tok, system=args.system, chat_template=args.chat_template) for p in prompts]
    enc = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], stop_token_ids(tok, args.chat_template)


def _answer(tokens, stops: list) -> list:
    """``tokens`` up to the first stop id."""
    tokens = [int(t) for t in tokens]
    cut = [tokens.index(s) for s in stops if s is not None and s in tokens]
    return tokens[:min(cut)] if cut else tokens


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("give one of --prompt TEXT or --prompts FILE")
    if args.prompts is not None:
        from cuboid.data.damage import check_text_file

        check_text_file(args.prompts, "--prompts")  # empty, or not UTF-8: one line naming the file and line
    numbered = [(0, args.prompt)] if args.prompt is not None else [
        (n, line.rstrip("\n")) for n, line in enumerate(open(args.prompts, encoding="utf-8"), 1) if line.strip()]
    if not numbered:
        raise ValueError(f"{args.prompts} holds no prompts")
    for n, line in numbered if args.chat and args.prompts is not None else ():
        try:  # a bad line named by file and line (1-based), before any model loads
            _conversation(line)
        except ValueError as e:
            raise ValueError(f"{args.prompts}:{n}: {e}") from None
    prompts = [line for _, line in numbered]
    model, tok = load_model_and_tokenizer(args)
    tok.padding_side = "left"
    input_ids, attention_mask, stops = _encode(args, prompts, tok)
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty after tokenisation")
    sample = args.temperature is not None or args.top_k > 0 or args.top_p < 1.0
    printing = int(os.environ.get("RANK", "0")) == 0
    streamed: list = []

    def stream(tokens):  # one prompt: print the new text as it grows, up to the first stop token
        if streamed and streamed[-1] in stops:
            return
        streamed.append(int(tokens[0]))
        text = tok.decode(_answer(streamed, stops), skip_special_tokens=True)
        shown = tok.decode(_answer(streamed[:-1], stops), skip_special_tokens=True)
        if printing:
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()

    single = len(prompts) == 1
    if single and printing and not args.chat:
        sys.stdout.write(prompts[0])
    # a row stops at the first of its stop ids: the eos, or (--chat) the turn's end
    out = model.generate(input_ids, attention_mask, max_new_tokens=args.max_new_tokens,
                         do_sample=sample, temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
                         eos_token_id=[s for s in stops if s is not None] or None, pad_token_id=tok.pad_token_id,
                         seed=args.seed,
                         streamer=stream if single else None)
    if printing:
        if single:
            sys.stdout.write("\n")
        else:
            width = input_ids.shape[1]
            for i, prompt in enumerate(prompts):
                answer = tok.decode(_answer(out[i, width:], stops), skip_special_tokens=True)
                print(f"[{i}] {answer}" if args.chat else f"[{i}] {prompt}{answer}")
    return 0
