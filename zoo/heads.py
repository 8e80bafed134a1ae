"""A model folder read under another head than its own: a causal LM's body (or a masked LM's, or a bare
backbone's) under a fresh sequence-classification head, as ``transformers``'
``AutoModelForSequenceClassification.from_pretrained`` reads a ``*ForCausalLM`` checkpoint (what TRL's
``RewardTrainer`` starts a reward model from): the body's weights load, the new head (HF's ``score``, BERT's
``classifier`` and pooler) is initialised, the old head's tensors (``lm_head``) are dropped.

:func:`folder_config` is the folder's zoo config with the head asked for; :func:`unexplained` keeps of a
strict read's problems only those the new head does not account for (its tensors missing, the old head's
unexpected), so anything else still fails as a strict read does; :func:`describe` says it in one line.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import hf_io
from .families import FAMILIES

NEW_HEADS = ("cls",)  # the heads a folder may be read under beside its own


def _stored(path: Path) -> tuple:
    """(family, architecture, zoo config) of the folder as it is."""
    cfg = hf_io.read_config(path)
    family, arch = hf_io.architecture_from_config(cfg, list(FAMILIES.values()), path)
    try:
        return family, arch, family.config_from_hf(cfg, arch)
    except KeyError as e:
        raise ValueError(f"{path / 'config.json'}: {arch} needs {e.args[0]!r}, which it lacks") from None


def folder_config(path, head: Optional[str] = None, num_labels: Optional[int] = None) -> tuple:
    """(family, zoo config, the folder's own config) of the folder ``path`` read with ``head`` (None: its own)
    and, for a new classification head, ``num_labels`` outputs (default: the config's, 2 when it names none, as
    transformers'). A head the family writes no Hugging Face class for, or ``num_labels`` for the folder's own
    head of another size, is refused in one sentence."""
    path = Path(path)
    family, arch, stored = _stored(path)
    own = getattr(stored, "head", None)
    if head is None or head == own:
        if num_labels is not None and getattr(stored, "num_labels", num_labels) != num_labels and own == "cls":
            raise ValueError(f"{path}: its classification head has {stored.num_labels} output(s), not "
                             f"num_labels={num_labels}")
        return family, stored, stored
    if head not in NEW_HEADS or not hasattr(stored, "num_labels"):
        raise ValueError(f"{path}: a {arch} folder is read with its own head {own!r} (a new {head!r} head is not "
                         f"made for it)")
    if num_labels is not None and (isinstance(num_labels, bool) or not isinstance(num_labels, int)
                                   or num_labels < 1):
        raise ValueError(f"num_labels {num_labels!r}: a classification head has 1 or more outputs")
    config = stored.replace(head=head, num_labels=num_labels if num_labels is not None else stored.num_labels)
    try:
        new_arch = family.architecture_of(config)
    except (KeyError, ValueError):
        new_arch = None
    if family.architectures.get(new_arch, {}).get("head") != head:
        raise ValueError(f"{path}: a {arch} folder has no sequence-classification form cuboid writes, so it cannot "
                         f"start a {head!r} head")
    return family, config, stored


def _names(family, config, reader) -> set:
    """The stored names of ``config``'s tensors as a read into a model of config ``reader`` reports them (the
    base prefix of ``reader``'s architecture on the body's, none on a head's)."""
    arch = family.architecture_of(reader)
    prefix = family.base_prefix if family.architectures[arch].get("prefixed", True) else ""
    return {h if row.top else prefix + h for row in family.tensor_maps(config) for h in row.hf}


def unexplained(problems: dict, model, family, stored) -> dict:
    """``problems`` (a read's missing, unexpected and mismatched tensors) less what reading the folder of
    ``stored`` (its own config) into ``model`` (another head) explains: the new head's tensors missing, the
    old head's unexpected. What is left is what a strict read would refuse."""
    new, old = _names(family, model.config, model.config), _names(family, stored, model.config)
    return {"missing": [n for n in problems["missing"] if n not in new - old],
            "unexpected": [n for n in problems["unexpected"] if n not in old - new],
            "mismatched": list(problems["mismatched"])}


def describe(path, head: Optional[str], num_labels: Optional[int] = None) -> Optional[str]:
    """One line for a folder read under a new head (None when ``head`` is its own): which head is dropped and
    which is made, as transformers' warning about newly initialised weights says it."""
    family, config, stored = folder_config(path, head, num_labels)
    if config.head == stored.head:
        return None
    new, old = _names(family, config, config), _names(family, stored, config)
    dropped = sorted({n.rsplit(".", 1)[0] for n in old - new})
    made = sorted({n.rsplit(".", 1)[0] for n in new - old})
    n = config.num_labels
    return (f"{path}: {family.architecture_of(stored)} read as {family.architecture_of(config)}: "
            f"{', '.join(dropped) or ('the tied LM head' if stored.head == 'lm' else 'no head')} dropped, "
            f"a new {' and '.join(made)} head of {n} output{'s' * (n != 1)} (initialised)")
