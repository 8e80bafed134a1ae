"""``cuboid eval --harness TASKS``: EleutherAI's lm-evaluation-harness over a cuboid model.

:class:`CuboidLM` is the harness's language model (its ``TemplateLM``: the harness tokenizes contexts and
continuations as it does for its own ``hf`` model) answering the three requests with a cuboid model under any
plan: ``loglikelihood`` (a continuation's summed log-probability and whether greedy decoding gives it),
``loglikelihood_rolling`` (a whole text's, in the harness's rolling windows of the model's length) and
``generate_until`` (greedy text up to a stop string, with cuboid's key/value cache). Every rank answers every
request, one sequence at a time, so the forwards match across the ranks of a tensor or pipeline plan; rank 0
prints the table. ``TASKS`` are the harness's task names or paths of task YAML files (a local task: a YAML
over a local jsonl, as ``dataset_path: json`` with ``dataset_kwargs: {data_files: ...}``), which run offline.
lm-eval is an optional dependency: ``pip install "cuboid[harness]"``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

INSTALL = 'pip install "cuboid[harness]" (or pip install lm-eval)'


def _template_lm():
    try:
        from lm_eval.api.model import TemplateLM
    except ImportError as e:
        raise ValueError(f"--harness needs lm-evaluation-harness: {INSTALL}") from e
    return TemplateLM


def make_lm(model, tokenizer, max_length: Optional[int] = None):
    """A harness language model (``lm_eval.api.model.TemplateLM``) answering with ``model`` and ``tokenizer``."""
    from cuboid.parallel import unwrap

    TemplateLM = _template_lm()
    core = unwrap(model)

    class CuboidLM(TemplateLM):
        """The three harness requests answered by a cuboid causal LM (module docstring)."""

        def __init__(self) -> None:
            super().__init__()
            self.model, self.core, self.tokenizer = model, core, tokenizer
            self.max_length = max_length or core.config.n_positions
            self.at = next(core.parameters()).device  # (the base class owns `device`)

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.eot_token_id

        def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list:
            if add_special_tokens is None and self.tokenizer.bos_token and string.startswith(self.tokenizer.bos_token):
                add_special_tokens = False  # the text carries its BOS already
            options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            return self.tokenizer.encode(string, **options)

        def tok_decode(self, tokens, **kwargs) -> str:
            return self.tokenizer.decode(tokens, **kwargs)

        def _score(self, context: list, continuation: list) -> tuple:
            """(summed log-probability of ``continuation`` after ``context``, whether it is the greedy one)."""
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            ids = torch.tensor([whole[:-1]], device=self.at)
            with torch.no_grad():
                logits = self.core(input_ids=ids).logits[0, -len(continuation):].float()  # (C, V)
            logp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(continuation, device=logp.device)
            total = float(logp.gather(1, target[:, None]).sum())
            return total, bool((logp.argmax(-1) == target).all())

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list:
            self.core.eval()
            out = []
            for key, context, continuation in requests:
                result = self._score(context, continuation)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, result)
                out.append(result)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list:
            from lm_eval import utils

            out = []
            for (text,) in [r.args for r in requests]:
                windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1))
                out.append(sum(s for s, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows])))
            return out

        def fit(self, ids: list, new: int) -> tuple:
            """(the context ids kept, the tokens to generate) within the model's positions: the context keeps
            its last ``max_length - new`` tokens, as the harness's ``hf`` model does, but at least half the
            positions (a model of <= 256 positions under the default ``max_gen_toks`` of 256 would keep
            none), and the generation is cut to the positions left."""
            ids = ids[-max(self.max_length - new, self.max_length // 2, 1):]
            return ids, max(1, min(new, self.max_length - len(ids)))

        def generate_until(self, requests, disable_tqdm: bool = False) -> list:
            out = []
            for context, options in [r.args for r in requests]:
                options = dict(options or {})
                until = options.pop("until", None) or [self.tok_decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                ids, new = self.fit(self.tok_encode(context), int(options.pop("max_gen_toks", 256)))
                prompt = torch.tensor([ids], device=self.at)
                tokens = self.model.generate(prompt, torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                                             eos_token_id=[self.eot_token_id],
                                             pad_token_id=self.tokenizer.pad_token_id)
                text = self.tok_decode(tokens[0, len(ids):].tolist(), skip_special_tokens=True)
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
            return out

    return CuboidLM()


def task_manager(tasks: list):
    """(the harness's TaskManager, the names to run): YAML paths are indexed from their folders (alone when
    every task is a file, so the harness's own thousands of tasks are not scanned)."""
    from lm_eval.tasks import TaskManager

    files = [t for t in tasks if t.endswith((".yaml", ".yml"))]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"--harness {f}: no such task file")
    names = [_task_name(f) if f in files else f for f in tasks]
    folders = sorted({str(Path(f).resolve().parent) for f in files})
    return TaskManager(include_path=folders or None, include_defaults=len(files) < len(tasks)), names


def _task_name(path: str) -> str:
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    name = data.get("task") if isinstance(data, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"--harness {path}: the YAML names no task (a 'task:' key)")
    return name


def run_harness(model, tokenizer, tasks: str, *, num_fewshot: Optional[int] = None, limit: Optional[float] = None,
                max_length: Optional[int] = None) -> dict:
    """The harness's results (``results``: per task its metrics, ``acc,none`` and such) of ``tasks`` (comma
    separated names or YAML files) with ``model``."""
    _template_lm()
    from lm_eval import simple_evaluate

    manager, names = task_manager([t.strip() for t in tasks.split(",") if t.strip()])
    if not names:
        raise ValueError("--harness needs one or more task names or task YAML files")
    results = simple_evaluate(model=make_lm(model, tokenizer, max_length), tasks=names, task_manager=manager,
                              num_fewshot=num_fewshot, limit=limit, log_samples=False, bootstrap_iters=0)
    if results is None:  # the harness reports on the process group's rank 0 only (it scored here all the same)
        return {"results": {}}
    return {"results": {k: {m: v for m, v in r.items() if m != "alias"} for k, r in results["results"].items()}}
