"""The special token ids a fine-tune's folders carry, so that ``transformers`` generates from them as cuboid does.

A causal LM's ``final/`` and ``checkpoint-<step>/`` get ``bos_token_id``, ``eos_token_id`` and (when the model's
config has none) ``pad_token_id`` in ``config.json``, and a ``generation_config.json``: the source folder's
(its sampling settings kept) with the ids of the run's tokenizer. Its ``eos_token_id`` lists every id that
ends an answer: the source's, the tokenizer's eos, and for a chat model the end-of-turn token its template
writes after an assistant's content (``<|im_end|>``, ``<|eot_id|>``), as the hub's chat models have it, so
``AutoModelForCausalLM.generate`` stops where ``cuboid generate --chat`` stops. ``config.json``'s
``eos_token_id`` is the tokenizer's own (one id, as Qwen2.5's instruct models have it).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

__all__ = ["special_ids"]

ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _ids(value) -> list:
    """``value`` (an id, a list of ids, or None) as a list of ints."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def source_generation_config(model: Any) -> dict:
    """The ``generation_config.json`` of ``model`` when it is a local folder that has one (read as data);
    an empty dict otherwise, or when the file is not a JSON object."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return {}
    file = Path(model) / "generation_config.json"
    if not file.is_file():
        return {}
    from cuboid.zoo.checkpoint.format import CheckpointError, parse_json

    try:
        data = parse_json(file.read_bytes(), file)
    except (OSError, CheckpointError):
        return {}
    return dict(data) if isinstance(data, dict) else {}


def special_ids(model_config: Any, tokenizer, source: Any = None,
                chat_template: Optional[str] = None) -> tuple[dict, Optional[dict]]:
    """(the fields ``config.json`` gains, the ``generation_config.json`` content or None) for a model with
    ``model_config`` trained with ``tokenizer`` from ``source`` (a preset name, a folder, a module).

    Only a causal LM (``head`` "lm") generates: anything else, or no id known at all, gets ``({}, None)``.
    ``chat_template``: the template file the run used instead of the tokenizer's."""
    if getattr(model_config, "head", None) != "lm":
        return {}, None
    gen = source_generation_config(source)
    tok = {k: getattr(tokenizer, k, None) if tokenizer is not None else None for k in ID_KEYS}
    eos = []
    for i in _ids(gen.get("eos_token_id")) + _ids(tok["eos_token_id"]) + _turn_ends(tokenizer, chat_template):
        if i not in eos:
            eos.append(i)
    bos = next(iter(_ids(tok["bos_token_id"]) + _ids(gen.get("bos_token_id"))), None)
    pad = next(iter(_ids(tok["pad_token_id"]) + _ids(gen.get("pad_token_id"))), None)
    if not eos and bos is None and pad is None:
        return {}, None
    fields: dict = {}
    if bos is not None:
        fields["bos_token_id"] = bos
    if eos:
        fields["eos_token_id"] = next(iter(_ids(tok["eos_token_id"])), eos[0])
    if pad is not None and getattr(model_config, "pad_token_id", None) is None:
        fields["pad_token_id"] = pad  # a config that has one keeps it (a reward head reads rows by it)
    generation = {k: v for k, v in gen.items() if k not in ID_KEYS}
    if bos is not None:
        generation["bos_token_id"] = bos
    if eos:
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if pad is not None:
        generation["pad_token_id"] = pad
    return fields, generation


def _turn_ends(tokenizer, chat_template: Optional[str]) -> list:
    """The end-of-turn id of the chat template (beyond the eos), when the tokenizer has a template."""
    if tokenizer is None:
        return []
    from cuboid.data.chat import stop_token_ids

    return stop_token_ids(tokenizer, chat_template)
