"""Chat templates: rendering conversations and finding the assistant's tokens in them.

A model folder's template is its tokenizer's (``tokenizer_config.json``'s ``chat_template`` or
``chat_template.jinja``, which transformers reads); ``--chat-template FILE`` overrides it.

:func:`encode_conversation` gives a conversation's token ids and a 0/1 mask of the assistant's tokens:

- a template with ``{% generation %}`` markers (TRL's training templates have them) marks the spans
  itself, read through transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
- any other template is split by rendering prefixes of the conversation: before each assistant turn
  ``i``, ``messages[:i]`` with the generation prompt, and ``messages[:i + 1]``; the tokens between the
  two are the turn's (its content and the end-of-turn text that follows it). Every rendered prefix must
  be a token prefix of the whole conversation; a template that renders a turn differently once more
  turns follow (one that drops earlier reasoning, say) cannot be split this way, and says so.

:func:`render_prompt` renders a conversation for generation (the template's generation prompt at its
end), and :func:`stop_token_ids` names the tokens that end an assistant turn.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence, Union

from cuboid.data.errors import DataError

__all__ = ["DataError", "template_of", "require_template", "has_generation_markers", "encode_conversation",
           "render_prompt", "prompt_ids", "stop_token_ids", "NO_TEMPLATE", "common_prefix"]


_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
NO_TEMPLATE = ("the data holds chat messages but the tokenizer has no chat template: pass --chat-template FILE "
               "or use a model folder whose tokenizer_config.json or chat_template.jinja has one")


def _read_override(chat_template: str) -> str:
    """``chat_template`` read from a file when it names one (whatever characters the path holds); else the
    template text itself when it has a ``{``; else a one-line DataError (a file that is not there)."""
    path = Path(chat_template)
    try:
        is_file = path.is_file()
    except OSError:  # template text too long to be a path
        is_file = False
    if is_file:
        from cuboid.data.damage import check_text_file

        check_text_file(path, "--chat-template")
        return path.read_text(encoding="utf-8")
    if "{" not in chat_template:
        raise DataError(f"chat template {chat_template}: no such file")
    return chat_template


def _template_in_folder(folder: Path) -> Optional[str]:
    import json

    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, list):  # named templates: the default one
            value = next((t["template"] for t in value if t.get("name") == "default"), None)
        return value or None
    return None


def template_of(tokenizer, chat_template: Optional[str] = None) -> Optional[str]:
    """The chat template to use: ``chat_template`` (a file or template text) when given, else the
    tokenizer's, else one in the folder the tokenizer came from; None when there is none."""
    if chat_template:
        return _read_override(chat_template)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    if own:
        return own
    source = getattr(tokenizer, "name_or_path", None)
    if source:
        path = Path(source)
        folder = path if path.is_dir() else path.parent
        if folder.is_dir():
            return _template_in_folder(folder)
    return None


def require_template(tokenizer, chat_template: Optional[str] = None) -> str:
    """:func:`template_of`, or a one-line :class:`DataError` saying how to give one."""
    template = template_of(tokenizer, chat_template)
    if not template:
        raise DataError(NO_TEMPLATE)
    return template


def has_generation_markers(template: str) -> bool:
    """Whether the template marks assistant output with ``{% generation %}``."""
    return bool(_MARKER.search(template))


def _ids(tokenizer, messages: Sequence[dict], template: str, tools=None, **kwargs) -> list:
    out = tokenizer.apply_chat_template(list(messages), chat_template=template, tools=tools, tokenize=True,
                                        return_dict=True, **kwargs)
    return list(out["input_ids"])


def encode_conversation(messages: Sequence[dict], tokenizer, template: str, *, tools=None,
                        markers: Optional[bool] = None) -> tuple[list, list]:
    """(input ids, assistant mask) of a conversation (module docstring). ``markers`` forces the marker
    method (True) or the prefix method (False); default: markers when the template has them."""
    if markers is None:
        markers = has_generation_markers(template)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or (m.get("content") is None and not m.get("tool_calls")):
            role = m.get("role", "?") if isinstance(m, dict) else type(m).__name__
            raise DataError(f"a conversation's turn {i + 1} ({role}) has no 'content': each message is "
                            "{'role': ..., 'content': ...}")
    try:
        if markers:
            out = tokenizer.apply_chat_template(list(messages), chat_template=template, tools=tools, tokenize=True,
                                                return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return _prefix_split(messages, tokenizer, template, tools)
    except Exception as e:  # noqa: BLE001 - the template's own errors (jinja2's) are one line; others are ours
        if type(e).__module__.split(".")[0] != "jinja2":
            raise
        first = next((str(m.get("content"))[:40] for m in messages if isinstance(m, dict)), "")
        raise DataError(f"the chat template failed on the conversation that starts {first!r}: "
                        f"{type(e).__name__}: {' '.join(str(e).split())}") from None


def _prefix_split(messages: Sequence[dict], tokenizer, template: str, tools) -> tuple[list, list]:
    whole = _ids(tokenizer, messages, template, tools)
    mask = [0] * len(whole)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _prefix_len(messages, i, whole, tokenizer, template, tools, generation_prompt=True)
        end = _prefix_len(messages, i + 1, whole, tokenizer, template, tools, generation_prompt=False)
        mask[start:end] = [1] * (end - start)
    return whole, mask


def _prefix_len(messages, n: int, whole: list, tokenizer, template: str, tools, generation_prompt: bool) -> int:
    """The token count of ``messages[:n]`` rendered alone, checked to be a token prefix of ``whole``."""
    what = (f"the conversation up to assistant turn {n + 1} (with the generation prompt)" if generation_prompt
            else f"the conversation through turn {n}")
    if n == 0 and not generation_prompt:
        return 0
    try:
        part = _ids(tokenizer, messages[:n], template, tools, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template refuses a prefix (raise_exception in Jinja, a missing turn)
        if n == 0:  # a conversation that opens with the assistant: its turn starts the tokens
            return 0
        raise DataError(f"the chat template cannot be split into turns: rendering {what} failed "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); use a template with "
                        "{% generation %} markers (--chat-template FILE)") from None
    if whole[:len(part)] != part:
        raise DataError(f"the chat template cannot be split into turns: {what} does not render as a prefix of "
                        "the whole conversation; use a template with {% generation %} markers "
                        "(--chat-template FILE)")
    return len(part)


def _as_messages(messages: Union[str, Sequence[dict]], system: Optional[str]) -> list:
    msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    if system is not None:
        msgs = [m for m in msgs if m.get("role") != "system"]
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def render_prompt(messages: Union[str, Sequence[dict]], tokenizer, system: Optional[str] = None,
                  add_generation_prompt: bool = True, chat_template: Optional[str] = None) -> str:
    """The text of a conversation (or one user message given as a string) for generation: ``system``
    (when given) replaces any system turn, and the template's generation prompt ends it. Tokenize the
    text with ``add_special_tokens=False`` (the template writes its own bos), or use :func:`prompt_ids`."""
    template = require_template(tokenizer, chat_template)
    return tokenizer.apply_chat_template(_as_messages(messages, system), chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def prompt_ids(messages: Union[str, Sequence[dict]], tokenizer, system: Optional[str] = None,
               add_generation_prompt: bool = True, chat_template: Optional[str] = None) -> list:
    """The token ids of :func:`render_prompt`'s text."""
    text = render_prompt(messages, tokenizer, system, add_generation_prompt, chat_template)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer, chat_template: Optional[str] = None) -> list:
    """The ids that end an assistant turn: the eos, and the special token the template writes right after
    an assistant's content (``<|im_end|>``, ``<|eot_id|>``), when it has one."""
    stops = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    template = template_of(tokenizer, chat_template)
    if template:
        mark = "qzxq"
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": mark}],
                                                 chat_template=template, tokenize=False)
        except Exception:  # a template that needs more than a user and an assistant turn
            text = ""
        after = text[text.rfind(mark) + len(mark):] if mark in text else ""
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        special = set(getattr(tokenizer, "all_special_ids", []))
        special |= {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(t, "special", False)}  # an end-of-turn token only in the added tokens
        if ids and ids[0] in special and ids[0] not in stops:
            stops.append(int(ids[0]))
    return stops


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (where an answer starts after its rendered prompt)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
