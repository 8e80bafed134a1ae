"""Converting checkpoint folders: sharded <-> single file, dtype casts; streaming.

:func:`convert` reads any safetensors model folder (cuboid's or one written
by ``transformers``) one tensor at a time through ``safe_open`` (mmap), casts
it if asked, and appends it to the output file through the streaming writer.
The output header is planned from shapes and dtypes alone and no output
buffer is assembled, so the peak memory is **one source tensor plus its cast
copy**, whatever the model size (``safe_open`` tensors are backed by the
mmap'd file: without a cast nothing is allocated beyond page cache). Tensor
names are kept as they are. The output is a cuboid checkpoint (checksums
recorded), written atomically like :func:`save`; ``config.json`` and the
other small files (tokenizer, generation config) are copied, ``torch_dtype``
updated on a cast; optimizer and training state are not (they belong to the
original dtype).

Companion files are data the output records with checksums, so they are
copied only from inside the source folder (:func:`companion_inside`): a
symbolic link that resolves elsewhere (to a key, a password file) is skipped
with a warning (``config.json`` so linked is refused), except the links of a
Hugging Face cache snapshot into its own ``blobs/``. Shards may be links
anywhere (the HF cache links them; they are read as tensors, not copied).
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import folder as folder_mod
from .folder import is_tokenizer_file
from .format import CheckpointError, FileRecord, fsync_file, parse_json, sha256_file, write_bytes
from .shards import Size, Source, meta, plan_shards
from .reader import TensorFolder
from .writer import Job, finish, write_model_files

DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
               "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp64": torch.float64, "float64": torch.float64}
_COPY_SUFFIXES = (".json", ".txt", ".model", ".md", ".py", ".jinja")  # configs, tokenizers, cards


GENERATION_CONFIG = "generation_config.json"


def companion_inside(p: Path, root: Path) -> bool:
    """Whether the file ``p`` of the folder ``root`` may be copied: not a link, or a link that resolves inside
    ``root``, or a Hugging Face cache link (``snapshots/<rev>/name`` -> ``../../blobs/<hash>``)."""
    if not p.is_symlink():
        return True
    target, home = p.resolve(), Path(root).resolve()
    return target.is_relative_to(home) or (home.parent.name == "snapshots"
                                           and target.parent == home.parent.parent / "blobs")


def _outside(p: Path) -> str:
    return f"skipped {p.name}: a link to {p.resolve()}, outside the source folder {p.parent}"


def tokenizer_files(folder) -> list:
    """The tokenizer files of a model folder (none: the folder has no tokenizer of its own); links that leave
    the folder are skipped with a warning (module docstring)."""
    found = sorted(p for p in Path(folder).iterdir() if p.is_file() and is_tokenizer_file(p.name))
    for p in found:
        if not companion_inside(p, folder):
            warnings.warn(_outside(p), RuntimeWarning, stacklevel=2)
    return [p for p in found if companion_inside(p, folder)]


def copy_companions(dst, *folders) -> list:
    """Copy into ``dst`` the tokenizer of the first of ``folders`` that has one and the first
    ``generation_config.json`` among them (a merged LoRA folder gets the adapters' tokenizer, else the
    base's, as the fine-tune's ``final/`` holds them). Returns the names copied."""
    dst, folders = Path(dst), [Path(f) for f in folders if f is not None and Path(f).is_dir()]
    chosen = next((files for files in map(tokenizer_files, folders) if files), [])
    chosen += [f / GENERATION_CONFIG for f in folders if (f / GENERATION_CONFIG).is_file()
               and companion_inside(f / GENERATION_CONFIG, f)][:1]
    for p in chosen:
        shutil.copyfile(p, dst / p.name)
    return [p.name for p in chosen]


def _copied(p: Path, root: Path) -> bool:
    """Small companion files that travel with the weights (not weights, not training state), from inside
    ``root`` (a link elsewhere: skipped with a warning)."""
    if not (p.is_file() and p.suffix in _COPY_SUFFIXES and p.name != "config.json" and not p.name.startswith(".")
            and not p.name.endswith(".index.json") and p.name != "trainer_state.json"):
        return False
    if not companion_inside(p, root):
        warnings.warn(_outside(p), RuntimeWarning, stacklevel=3)
        return False
    return True


def parse_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPE_NAMES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(DTYPE_NAMES)}") from None


def _read_tensor(folder: TensorFolder, name: str) -> torch.Tensor:
    """One source tensor (instrumented by the tests: at most one is alive at a time)."""
    return folder.get_tensor(name)


def _fetch(folder: TensorFolder, name: str, dtype: Optional[torch.dtype]):
    def fetch():
        t = _read_tensor(folder, name)
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        return [t]

    return fetch


def _config(src: Path, dtype: Optional[torch.dtype]) -> Optional[bytes]:
    path = src / "config.json"
    if not path.is_file():
        return None
    if not companion_inside(path, src):
        raise CheckpointError(f"{path} is a link to {path.resolve()}, outside the source folder: copy the config "
                              "into the folder to convert it")
    if dtype is None:
        return path.read_bytes()
    cfg = parse_json(path.read_bytes(), path)
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: not a config (a JSON {type(cfg).__name__}, not an object)")
    name = str(dtype).replace("torch.", "")
    cfg["torch_dtype"] = name
    if "dtype" in cfg:  # transformers >= 5 writes "dtype"
        cfg["dtype"] = name
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def convert(src, dst, *, max_shard_size: Size = None, dtype=None, progress: bool = True,
            overwrite: bool = False) -> Path:
    """Rewrite the model folder ``src`` as ``dst``.

    ``max_shard_size=None``: one ``model.safetensors``; a size ("2GB", bytes):
    HF-style shards + index (one file if it all fits). ``dtype`` ("bf16",
    ``torch.float16``, ...) casts floating-point tensors. ``dst`` must not exist
    unless ``overwrite``. Memory: see the module docstring. Returns ``dst``.
    """
    src_root = folder_mod.resolve(src)
    dst = folder_mod.real(dst)
    cast = parse_dtype(dtype)
    if dst.resolve() == src_root.resolve():
        raise CheckpointError(f"{dst}: source and destination are the same folder")
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists (pass overwrite=True / --overwrite to replace it)")
    folder = TensorFolder(src_root, "model")
    sources, total = [], 0
    for file in folder.files:  # file order, then offset order: sequential reads
        folder._open(file)
        header = folder._headers[file]
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        for name in names:
            if folder.weight_map.get(name) != file:
                continue
            shape, sdtype = folder.shape_dtype(name)
            out = cast if cast is not None and sdtype.is_floating_point else sdtype
            m = meta(shape, out)
            total += m.numel() * m.element_size()
            sources.append(Source((name,), (m,), _fetch(folder, name, cast)))
    plan = plan_shards(sources, "model", max_shard_size)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"convert {src_root.name}", leave=False)
    job = Job(True)
    try:
        job.tmp = folder_mod.begin(dst)  # one process: a refusal is raised here, before anything is written
        extra = {}
        cfg = _config(src_root, cast)
        if cfg is not None:
            rec = job.file("config.json", write_bytes, job.tmp / "config.json", cfg)
            if rec is not None:
                extra["config.json"] = rec
        for p in sorted(src_root.iterdir()):
            if _copied(p, src_root):
                rec = job.file(p.name, lambda p=p: _copy(p, job.tmp / p.name))
                if rec is not None:
                    extra[p.name] = rec
        write_model_files(plan, sources, job, extra, bar)
        job.call(folder_mod.commit, job.tmp, dst)
    except BaseException:
        if job.tmp is not None:
            folder_mod.abort(job.tmp)
        raise
    finally:
        if bar is not None:
            bar.close()
    finish(job, 1, dst)
    return dst


def _copy(src: Path, dst: Path) -> FileRecord:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        fsync_file(f)
    return FileRecord(dst.stat().st_size, sha256_file(dst))
