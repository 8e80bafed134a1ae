"""What a model folder's ``config.json`` must agree on with its weights before a model is built from it.

``zoo.from_hf`` builds the model its config describes (on the meta device) and only then reads the
weights' headers, so a config that lies costs before anything says so: ``n_layer=20000`` over a
two-layer weight map built for many seconds before "missing keys", and a string ``n_layer`` ended in a
``TypeError`` deep inside the build. :func:`check_folder` (``cuboid.load(folder)`` runs it first)
reads the config and the weights' names alone and says in one sentence what does not fit:

- ``config.json`` is a JSON object (bad JSON, nesting too deep to parse: a :class:`CheckpointError`);
- every whole-number, real, boolean and text field of the family's config holds such a value (the
  sentence names the ``config.json`` key that gave it);
- the blocks the config declares are in the weight map: the last declared block's tensors are stored
  (the check reads the names of a two-block model of the same config, never builds the declared one).

Fewer declared layers than stored is left to the reader's "unexpected" keys: nothing large is built first.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, List, Optional

from .. import hf_io
from ..families import FAMILIES
from .folder import resolve
from .format import CheckpointError, parse_json
from .reader import TensorFolder

_TYPES = {"int": (int, "a whole number"), "float": ((int, float), "a number"), "bool": (bool, "true or false"),
          "str": (str, "a string")}  # a zoo config field's annotation -> the values it takes
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def read_config(path) -> dict:
    """``path/config.json`` as a dict, or a one-line error (missing, not JSON, not an object)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: no config.json")
    cfg = parse_json(file.read_bytes(), file)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: not a model config (a JSON {type(cfg).__name__}, not an object)")
    return cfg


def _key_of(cfg: dict, value: Any, default: str) -> str:
    """The config.json key that holds ``value`` (the object itself), else ``default``."""
    return next((k for k, v in cfg.items() if v is value), default)


def check_fields(config: Any, cfg: dict, file: Path) -> None:
    """Every field annotated ``int`` / ``float`` / ``bool`` / ``str`` of the zoo ``config`` holds one."""
    for f in dataclasses.fields(config):
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        value = getattr(config, f.name)
        if kind not in _TYPES or (isinstance(value, _TYPES[kind][0]) and (kind == "bool"
                                                                         or not isinstance(value, bool))):
            continue
        raise CheckpointError(f"{file}: {_key_of(cfg, value, f.name)} is {value!r}, not {_TYPES[kind][1]}")


def _block_names(family: hf_io.Family, config: Any) -> Optional[List[str]]:
    """Templates (``"h.{}.ln_1.weight"``) of one block's stored names, from a two-block config; None when the
    family's names do not follow that pattern (the check is then left to the reader)."""
    changes = {"n_layers": 2}
    if getattr(config, "layer_types", None) is not None:
        changes["layer_types"] = tuple(config.layer_types[:1]) * 2
    try:
        rows = family.tensor_maps(dataclasses.replace(config, **changes))
    except Exception:  # noqa: BLE001 - a config this check cannot shrink: the reader's checks stand
        return None
    # rows with another stored form (gpt-oss's MXFP4 experts) left to the reader, which knows which is there
    first = [h for r in rows if r.zoo.startswith("blocks.0.") and not r.top and r.alt is None for h in r.hf]
    second = [h for r in rows if r.zoo.startswith("blocks.1.") and not r.top and r.alt is None for h in r.hf]
    if not first or len(first) != len(second):
        return None
    out = []
    for a, b in zip(first, second):
        pa, pb = a.split("."), b.split(".")
        diff = [i for i, (x, y) in enumerate(zip(pa, pb)) if x != y]
        if len(pa) != len(pb) or len(diff) != 1 or (pa[diff[0]], pb[diff[0]]) != ("0", "1"):
            return None
        pa[diff[0]] = "{}"
        out.append(".".join(pa))
    return out


def check_layers(root: Path, family: hf_io.Family, config: Any, cfg: dict) -> None:
    """The last block ``config`` declares is in the weight map (module docstring)."""
    layers = getattr(config, "n_layers", None)
    if not isinstance(layers, int) or layers < 2:
        return
    names = _block_names(family, config)
    if names is None:
        return
    stored = hf_io.normalise_keys(TensorFolder(root, "model").keys(), family)

    def held(i: int) -> bool:
        return all(n.format(i) in stored for n in names)

    if held(layers - 1):
        return
    have = 0
    while have < layers and held(have):
        have += 1
    key = next((k for k in _LAYER_KEYS if cfg.get(k) == layers), "n_layers")
    blocks = f" (blocks 0..{have - 1})" if have else ""
    raise CheckpointError(f"{root / 'config.json'}: {key} is {layers}, but the weights hold {have} blocks{blocks}: "
                          "the config does not describe these weights")


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_folder(path) -> None:
    """The checks of the module docstring on the folder ``path``, before any model is built from it."""
    root = resolve(path)
    cfg = read_config(root)
    family, arch = hf_io.architecture_from_config(cfg, list(FAMILIES.values()), root)
    file = root / "config.json"
    for key in _LAYER_KEYS:  # before the family's config, whose own checks would trip over it less clearly
        if key in cfg and (not isinstance(cfg[key], int) or isinstance(cfg[key], bool)):
            raise CheckpointError(f"{file}: {key} is {cfg[key]!r}, not a whole number")
    try:
        config = family.config_from_hf(cfg, arch)
    except KeyError as e:
        raise CheckpointError(f"{file}: {arch} needs {e.args[0]!r}, which it lacks") from None
    except (TypeError, AttributeError) as e:
        key = next((k for k, v in cfg.items() if isinstance(v, str) and _numeric(v)), None)
        if key is not None:  # the usual cause: a number written as a string
            raise CheckpointError(f"{file}: {key} is {cfg[key]!r}, not a number") from None
        raise CheckpointError(f"{file}: a value has the wrong type for {arch} ({' '.join(str(e).split())})") from None
    check_fields(config, cfg, file)
    check_layers(root, family, config, cfg)
