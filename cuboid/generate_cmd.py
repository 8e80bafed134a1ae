"""``cuboid generate``: text from a causal LM, streamed as it comes.

    cuboid generate --model FOLDER|PRESET --prompt "Once upon a time" [--max-new-tokens 64]
    cuboid generate --model FOLDER --prompts prompts.txt --temperature 0.8 --top-p 0.9 --seed 0

One prompt streams its continuation token by token; ``--prompts`` (one per
line) generates for all of them as one left-padded batch and prints each.
Greedy unless ``--temperature``, ``--top-k`` or ``--top-p`` ask for sampling.
Under torchrun, ``--plan`` spreads the model (tensor parallelism; every rank
draws the same tokens, rank 0 prints). Errors are one line, exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys

from cuboid.eval_cmd import add_model_arguments, load_model_and_tokenizer


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
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts is None):
        raise ValueError("give one of --prompt TEXT or --prompts FILE")
    prompts = [args.prompt] if args.prompt is not None else [
        line.rstrip("\n") for line in open(args.prompts, encoding="utf-8") if line.strip()]
    if not prompts:
        raise ValueError(f"{args.prompts} holds no prompts")
    model, tok = load_model_and_tokenizer(args)
    tok.padding_side = "left"
    enc = tok(prompts, padding=True, return_tensors="pt", add_special_tokens=False)
    if enc["input_ids"].shape[1] == 0:
        raise ValueError("the prompt is empty after tokenisation")
    sample = args.temperature is not None or args.top_k > 0 or args.top_p < 1.0
    printing = int(os.environ.get("RANK", "0")) == 0
    streamed: list = []

    def stream(tokens):  # one prompt: print the new text as it grows
        streamed.append(int(tokens[0]))
        text = tok.decode(streamed, skip_special_tokens=True)
        shown = tok.decode(streamed[:-1], skip_special_tokens=True)
        if printing:
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()

    single = len(prompts) == 1
    if single and printing:
        sys.stdout.write(prompts[0])
    out = model.generate(enc["input_ids"], enc["attention_mask"], max_new_tokens=args.max_new_tokens,
                         do_sample=sample, temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seed=args.seed,
                         streamer=stream if single else None)
    if printing:
        if single:
            sys.stdout.write("\n")
        else:
            width = enc["input_ids"].shape[1]
            for i, prompt in enumerate(prompts):
                print(f"[{i}] {prompt}{tok.decode(out[i, width:], skip_special_tokens=True)}")
    return 0
