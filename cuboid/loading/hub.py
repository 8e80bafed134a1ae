"""Hugging Face Hub ids (``org/name``) as model folders: the local cache first, a download only when online.

:func:`locate` is what every command and ``cuboid.load`` do with a model name before anything else: a preset
name, a folder or an object is kept as it is; an ``org/name`` that is neither becomes the folder of its
snapshot in the Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``:
``models--org--name/snapshots/<commit>/``, the commit that ``refs/main`` names), as ``transformers`` resolves
it. Without the snapshot (or with one that holds no weights), and only when the hub is not switched off
(``HF_HUB_OFFLINE=1`` or ``TRANSFORMERS_OFFLINE=1`` switch it off), the model is downloaded into that cache
(its configs, tokenizer files and safetensors weights; never pickled weights, which cuboid does not read).
When nothing is found the error says where it looked.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

# what a download fetches: configs, tokenizer and template files, safetensors weights (no pickles)
DOWNLOAD = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a true environment variable


def is_hub_id(name: Any) -> bool:
    """Whether ``name`` reads as a hub model id ``org/name`` (one slash; what a local path rarely is when no
    such folder exists)."""
    if not isinstance(name, str) or name.count("/") != 1 or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def offline() -> bool:
    """Whether the hub is switched off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), read now, not at import."""
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper() in TRUE


def cache_dir() -> str:
    """The hub cache this process uses: ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.path.expandvars(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def complete(folder: Path) -> bool:
    """Whether a snapshot holds a model cuboid reads: a config with safetensors weights, or LoRA adapters."""
    model = (folder / "config.json").is_file() and any(
        (folder / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))
    adapters = (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    return model or adapters


def cached(repo_id: str, revision: Optional[str] = None) -> Optional[Path]:
    """The cache's snapshot folder of ``repo_id`` (at ``refs/main`` or ``revision``), None when absent."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None


def locate(source: Any, revision: Optional[str] = None) -> Any:
    """``source`` as cuboid reads it (module docstring): an ``org/name`` hub id that is not a folder here
    becomes its snapshot folder in the Hugging Face cache, downloaded first when it is not cached and the hub
    is on; anything else is returned as it is (a preset, a folder, a model object, a path that callers refuse
    in their own words). A FileNotFoundError saying where it looked when the id is found nowhere."""
    if not is_hub_id(source) or os.path.isdir(source):
        return source
    folder = cached(source, revision)
    if folder is not None and complete(folder):
        return os.fspath(folder)
    where = f"not a local folder, not in the Hugging Face cache {cache_dir()}"
    if folder is not None:
        where = f"not a local folder; its snapshot {folder} in the Hugging Face cache holds no safetensors weights"
    if offline():
        raise FileNotFoundError(f"model {source}: {where}, and the hub is off (HF_HUB_OFFLINE=1): place it in the "
                                f"cache or unset HF_HUB_OFFLINE to download it")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(source, revision=revision, cache_dir=cache_dir(), allow_patterns=DOWNLOAD))
    except Exception as e:  # a missing repo, no network, no access: said in the one line
        reason = " ".join(str(e).split()) or type(e).__name__
        raise FileNotFoundError(f"model {source}: {where}, and the hub's download failed: {reason[:300]}") from e
    if not complete(folder):
        raise FileNotFoundError(f"model {source}: the hub's {folder} holds no config.json with safetensors weights "
                                f"(cuboid reads no pickled .bin weights)")
    return os.fspath(folder)
