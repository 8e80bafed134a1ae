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

Rows cut to a length (``max_length``) need only their first tokens: :func:`head_text` finds a prefix of a
text whose tokens begin with the whole text's, so that a row's work and memory follow the length kept, not
the row's (one 4 MB line is tokenized as a few kilobytes); :func:`encode_conversation_head` does the same
for a conversation, with the same tokens and mask as the whole conversation's cut.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence, Union

from cuboid.data.errors import DataError

__all__ = ["DataError", "template_of", "require_template", "has_generation_markers", "encode_conversation",
           "render_prompt", "prompt_ids", "stop_token_ids", "NO_TEMPLATE", "common_prefix", "head_text", "head_ids",
           "head_ids_batch", "encode_conversation_head", "render", "TextEncoder"]


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


def render(tokenizer, messages: Sequence[dict], template: str, tools=None, **kwargs) -> str:
    """The text of a conversation under ``template``; its tokens (``add_special_tokens=False``: the template
    writes its own) are ``apply_chat_template(..., tokenize=True)``'s."""
    return tokenizer.apply_chat_template(list(messages), chat_template=template, tools=tools, tokenize=False,
                                         **kwargs)


def encode_conversation(messages: Sequence[dict], tokenizer, template: str, *, tools=None,
                        markers: Optional[bool] = None) -> tuple[list, list]:
    """(input ids, assistant mask) of a conversation (module docstring). ``markers`` forces the marker
    method (True) or the prefix method (False); default: markers when the template has them."""
    ids, mask, _ = encode_conversation_head(messages, tokenizer, template, None, tools=tools, markers=markers)
    return ids, mask


def encode_conversation_head(messages: Sequence[dict], tokenizer, template: str, n: Optional[int], *, tools=None,
                             markers: Optional[bool] = None) -> tuple[list, list, bool]:
    """(the first ``n`` input ids, their assistant mask, ``later``) of a conversation: the tokens and mask of
    :func:`encode_conversation` cut to ``n`` (all when ``n`` is None), the work bounded by ``n`` (:func:`head_text`).
    ``later``: an assistant token lies past the first ``n``. A template that cannot be split is found from the
    turns that start within them."""
    if markers is None:
        markers = has_generation_markers(template)
    check_turns(messages)
    try:
        if markers:
            return _marked(messages, tokenizer, template, tools, n)
        return _prefix_split(messages, tokenizer, template, tools, n)
    except Exception as e:  # noqa: BLE001 - the template's own errors (jinja2's) are one line; others are ours
        raise template_failure(e, messages) from None


def check_turns(messages: Sequence[dict], what: str = "a conversation") -> None:
    """A one-line :class:`DataError` for a turn that is not ``{'role': ..., 'content': ...}``: not a dict, no
    ``content`` (and no tool calls), or a content that is neither text nor a list of parts."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or (m.get("content") is None and not m.get("tool_calls")):
            role = m.get("role", "?") if isinstance(m, dict) else type(m).__name__
            raise DataError(f"{what}'s turn {i + 1} ({role}) has no 'content': each message is "
                            "{'role': ..., 'content': ...}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"{what}'s turn {i + 1} ({m.get('role', '?')}) has a content of type "
                            f"{type(content).__name__} ({content!r:.40}): a content is text (or a list of parts)")


def template_failure(e: Exception, messages: Sequence[dict]) -> DataError:
    """The chat template's own error (jinja2's: a sandbox refusal, an undefined name) as one line naming the
    conversation; any other error is not the data's and is raised as it is."""
    if type(e).__module__.split(".")[0] != "jinja2":
        raise e
    first = next((str(m.get("content"))[:40] for m in messages if isinstance(m, dict)), "")
    return DataError(f"the chat template failed on the conversation that starts {first!r}: "
                     f"{type(e).__name__}: {' '.join(str(e).split())}")


def _render_spans(messages: Sequence[dict], tokenizer, template: str, tools) -> Optional[tuple[str, list]]:
    """(the text, the (start, end) characters of each ``{% generation %}`` block): transformers' rendering for
    ``return_assistant_tokens_mask``, without its tokenizing; None with a transformers that lacks it."""
    try:
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
    except ImportError:
        return None
    texts, spans = render_jinja_template(
        conversations=[_normalize_chat_messages(list(messages))], tools=tools, documents=None,
        chat_template=tokenizer.get_chat_template(template, tools), return_assistant_tokens_mask=True,
        continue_final_message=False, add_generation_prompt=False, **tokenizer.special_tokens_map)
    return texts[0], [tuple(s) for s in spans[0]]


def _marked(messages, tokenizer, template: str, tools, n: Optional[int]) -> tuple[list, list, bool]:
    """The marker method: a token is the assistant's when its characters overlap a generation block (as
    transformers' ``return_assistant_tokens_mask`` decides)."""
    rendered = _render_spans(messages, tokenizer, template, tools)
    if rendered is None:  # tokenized whole, then cut
        out = tokenizer.apply_chat_template(list(messages), chat_template=template, tools=tools, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return ids[:n], mask[:n], n is not None and any(mask[n:])
    text, spans = rendered
    part = text if n is None else head_text(text, n, TextEncoder(tokenizer, special=False))
    enc = tokenizer(part, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    cut = n is not None and (len(part) < len(text) or len(ids) > n)
    if n is not None:
        ids, offsets = ids[:n], offsets[:n]
    mask, k = [0] * len(ids), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = int(end > spans[k][0])
    kept_end = offsets[-1][1] if offsets else 0
    later = cut and any(e > s and e > kept_end for s, e in spans)
    return ids, mask, later


def _prefix_split(messages, tokenizer, template: str, tools, n: Optional[int]) -> tuple[list, list, bool]:
    whole = head_ids(render(tokenizer, messages, template, tools), n, TextEncoder(tokenizer, special=False))
    mask, later = [0] * len(whole), False
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = _prefix_len(messages, i, whole, tokenizer, template, tools, True, n)
        end = _prefix_len(messages, i + 1, whole, tokenizer, template, tools, False, n)
        mask[start:end] = [1] * (end - start)
        if n is not None and end >= n:  # this turn runs past the kept tokens; later turns start past them
            later = True
            break
    return whole, mask, later


def _prefix_len(messages, k: int, whole: list, tokenizer, template: str, tools, generation_prompt: bool,
                n: Optional[int]) -> int:
    """The token count of ``messages[:k]`` rendered alone (at most ``n``), checked to be a token prefix of
    ``whole`` (the conversation's first ``n`` tokens)."""
    what = (f"the conversation up to assistant turn {k + 1} (with the generation prompt)" if generation_prompt
            else f"the conversation through turn {k}")
    if k == 0 and not generation_prompt:
        return 0
    try:
        text = render(tokenizer, messages[:k], template, tools, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template refuses a prefix (raise_exception in Jinja, a missing turn)
        if k == 0:  # a conversation that opens with the assistant: its turn starts the tokens
            return 0
        raise DataError(f"the chat template cannot be split into turns: rendering {what} failed "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); use a template with "
                        "{% generation %} markers (--chat-template FILE)") from None
    part = head_ids(text, n, TextEncoder(tokenizer, special=False))
    if whole[:len(part)] != part:
        raise DataError(f"the chat template cannot be split into turns: {what} does not render as a prefix of "
                        "the whole conversation; use a template with {% generation %} markers "
                        "(--chat-template FILE)")
    return len(part)


# ---------------------------------------------------------------- the first tokens of a long text

HEAD_MARGIN = 32  # tokens a prefix must yield past the ones kept before they are trusted


class TextEncoder:
    """``tokenizer(texts, add_special_tokens=special)["input_ids"]`` for a text or a list of texts, and where
    a long text may be cut for its first tokens (``cuts``): ``"any"`` for models whose cut changes only the
    tokens near it (BPE, WordPiece, WordLevel: merges and matches run from the left), ``"space"`` for a
    Unigram model over words split at spaces (its best split of a word can change at the word's start when
    the word is cut, so cuts fall between words), None where no cut is safe (a Unigram model over the
    whole text, a tokenizer without a ``tokenizers`` backend: the text is tokenized whole)."""

    def __init__(self, tokenizer, special: bool = True) -> None:
        self.tokenizer, self.special = tokenizer, special
        self.cuts = _cuts(tokenizer)

    def __call__(self, texts):
        return self.tokenizer(texts, add_special_tokens=self.special)["input_ids"]


def _cuts(tokenizer) -> Optional[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = type(backend.model).__name__
    if model in ("BPE", "WordPiece", "WordLevel"):
        return "any"
    splits = backend.pre_tokenizer is not None and len(backend.pre_tokenizer.pre_tokenize_str("a b")) == 2
    return "space" if model == "Unigram" and splits else None


def _first_size(n: int) -> int:
    """The characters of the first prefix tried for ``n`` tokens (a text up to twice as long is taken whole)."""
    return 8 * (n + HEAD_MARGIN)


def _cut(text: str, size: int, cuts: str) -> Optional[int]:
    """Where to cut ``text`` near ``size``: before its last space in the second half of ``text[:size]``, else
    (``cuts`` "any") at ``size``; None when no cut is allowed there."""
    space = text.rfind(" ", size // 2, size)
    return space if space > 0 else size if cuts == "any" else None


def _head(text: str, n: int, encode: TextEncoder) -> tuple[str, Optional[Sequence[int]]]:
    """(the prefix :func:`head_text` picks, its tokens when they were made on the way, else None)."""
    size = _first_size(n)
    if len(text) <= 2 * size or encode.cuts is None:
        return text, None
    trusted = None
    while size < len(text):
        cut = _cut(text, size, encode.cuts)
        ids = encode(text[:cut]) if cut is not None else ()
        if len(ids) >= n + HEAD_MARGIN:
            if trusted is not None and list(trusted[:n]) == list(ids[:n]):
                return text[:cut], ids
            trusted = ids
        size *= 2
    return text, None


def head_text(text: str, n: int, encode: TextEncoder) -> str:
    """A prefix of ``text`` whose first ``n`` tokens (by ``encode``) are the whole text's first ``n``: the whole
    text when it is short; else prefixes of doubling length, cut before a space where one is near (between
    two pre-tokens of most tokenizers), are tokenized until one yields ``HEAD_MARGIN`` tokens past the ``n``
    and the next, about twice as long, agrees with it on the ``n``. A cut changes only the tokens near it
    (the pre-token it splits, the merges within it), so the margin keeps the change away from the kept
    tokens, and the agreement of two cuts checks it. The work is a few times the kept text's."""
    return _head(text, n, encode)[0]


def head_ids(text: str, n: Optional[int], encode: TextEncoder) -> list:
    """``encode(text)[:n]`` (all of it when ``n`` is None), tokenizing only a prefix (:func:`head_text`)."""
    if n is None:
        return list(encode(text))
    part, ids = _head(text, n, encode)
    return list((encode(part) if ids is None else ids)[:n])


def head_ids_batch(texts: Sequence[str], n: Optional[int], encode: TextEncoder) -> list:
    """:func:`head_ids` of each text: the short texts in one call, each long one by its prefixes."""
    if n is None:
        return [list(ids) for ids in encode(list(texts))]
    short = [i for i, t in enumerate(texts) if len(t) <= 2 * _first_size(n)]
    out = [None] * len(texts)
    for i, ids in zip(short, encode([texts[i] for i in short]) if short else []):
        out[i] = list(ids[:n])
    for i in set(range(len(texts))) - set(short):
        out[i] = head_ids(texts[i], n, encode)
    return out


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
