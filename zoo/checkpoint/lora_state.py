"""A LoRA run's folders, kept as carefully as a full checkpoint: safetensors and JSON, checksummed.

A LoRA fine-tune's ``checkpoint-<step>/`` holds::

    adapter_config.json                peft's config (peft loads the folder as adapters), naming the base
    adapter_model.safetensors          every adapter as a full tensor under its peft name
    config.json                        the model's HF config
    optimizer.safetensors              the adapters' optimizer state as full tensors by zoo parameter name
    optimizer.safetensors.index.json   + class, param groups and per-parameter steps (as a full checkpoint's)
    trainer_state.json                 step, scheduler, every rank's RNG, the caller's state, plan, world size
    tokenizer files, generation_config.json   the run's, when it has them (as in ``final/``)
    base_quantization_config.json      a QLoRA run's: its base's NF4 settings (transformers' BitsAndBytesConfig)
    lora-checkpoint.json               the commit file, written last: size and SHA-256 of every file above

and its ``final/`` (:func:`save_adapters`, what ``checkpoint.save`` writes for
a LoRA model) holds ``adapter_config.json``, ``adapter_model.safetensors``,
the tokenizer's files when given, a QLoRA run's ``base_quantization_config.json``,
and ``lora-adapters.json``, the commit file recording them (peft ignores both).

Every file is fsync'd, the folder is written under a temporary name and
renamed into place (:mod:`.folder`: a crash mid-write leaves the previous
folder, and only a folder cuboid wrote or one of model files is replaced).
Nothing is pickled: the optimizer state is stored by parameter name as full
tensors (gathered as :func:`~.writer.save` gathers them), so
:func:`cuboid.zoo.lora.load_checkpoint` reads it into any plan or world size
through :func:`~.resume.load_training_state`, after :func:`verify_lora` has
checked every recorded file. Any other file in the folder (a
``lora-rank00000.pt`` of an older layout) is never read.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from . import folder as folder_mod
from .adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_QUANTIZATION, PEFT_PREFIX, adapter_config,
                       adapter_state, base_quantization)
from .format import (ADAPTERS_COMMIT, LORA_COMMIT, OPTIMIZER_INDEX, TRAINER_STATE, CheckpointError, FileRecord,
                     lora_commit, parse_json, read_header, write_json)
from .shards import Source, meta, plan_shards
from .stages import merge_optimizer_info, stage_layout
from .state import dist_info, optimizer_sources, training_record

OLD_RANK_STATE = "lora-rank00000.pt"  # an older layout's pickled state: recognised to refuse it, never read
# commit file -> (its format tag, the files it must record)
COMMITS = {LORA_COMMIT: ("cuboid-lora-checkpoint", (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "config.json", TRAINER_STATE)),
           ADAPTERS_COMMIT: ("cuboid-lora-adapters", (ADAPTER_CONFIG, ADAPTER_WEIGHTS))}
LORA_FORMAT = COMMITS[LORA_COMMIT][0]


def is_lora_checkpoint(path) -> bool:
    """A committed LoRA training checkpoint (its commit file is there; :func:`verify_lora` checks the rest)."""
    return (Path(path) / LORA_COMMIT).is_file()


def is_adapter_folder(path) -> bool:
    """Whether ``path`` holds LoRA adapters without model weights (peft's ``adapter_config.json``, no
    ``model.safetensors`` or index): what ``checkpoint.save`` writes for a LoRA model (:func:`save_adapters`),
    and a LoRA run's training checkpoint (its ``config.json`` is the base's, beside no weights)."""
    p = Path(path)
    weights = (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()
    return (p / ADAPTER_CONFIG).is_file() and not weights


def adapter_base(path) -> str:
    """The base model an adapter folder names (peft's ``base_model_name_or_path``: a folder or a hub id), which
    ``cuboid.load(path)`` loads with the adapters on; a one-sentence error for a folder that names none (a
    model built from a preset: its base is its seed's, which the adapters do not record)."""
    cfg = parse_json((Path(path) / ADAPTER_CONFIG).read_bytes(), Path(path) / ADAPTER_CONFIG)
    base = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
    if not base:
        raise CheckpointError(f"{path} holds LoRA adapters alone and names no base model: load them onto their "
                              f"base with cuboid.load(base, lora={str(path)!r})")
    return str(base)


def _gather(obj, world: int) -> list:
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _sources(tensors: Dict[str, torch.Tensor]) -> list:
    return [Source((n,), (meta(t.shape, t.dtype),), (lambda t=t: [t])) for n, t in sorted(tensors.items())]


def _optimizer_tensors(model, optimizer, rank: int, world: int):
    """({zoo name/state key: full tensor}, optimizer record) of the whole model, on rank 0.

    Every rank fetches its sources in the same order (a collective over each layer's shard group); under
    pipeline parallelism each stage's tensors and record travel to rank 0 (the adapters' state is small)."""
    if optimizer is None:
        return {}, None
    sources, info = optimizer_sources(model, optimizer)
    where = stage_layout(model, rank)
    mine = {n: t for src in sources for n, t in zip(src.names, src.fetch())} if where.fetches else None
    if where.stages == 1:
        return mine, info
    parts = _gather((where.stage, mine, info), world)
    by_stage: dict = {}
    for stage, tensors, stage_info in parts:
        if tensors is not None:
            by_stage.setdefault(stage, (tensors, stage_info))
    ordered = [by_stage[s] for s in range(where.stages)]
    return {n: t for tensors, _ in ordered for n, t in tensors.items()}, merge_optimizer_info(
        [i for _, i in ordered])


def _committed(path: Path, world: int, rank: int, commit_name: str, body) -> Path:
    """Write a folder under ``commit_name``'s protocol: rank 0 opens the temporary folder, ``body(job, files)``
    writes and records the files, the commit file records them last, and the folder is renamed into place;
    every rank raises rank 0's error (:func:`~.writer.finish`)."""
    from .writer import Job, finish

    job, written = Job(rank == 0), False
    try:
        if job.active:
            job.tmp = job.call(folder_mod.begin, path)
            files: Dict[str, FileRecord] = {}
            body(job, files)
            commit = {"format": COMMITS[commit_name][0], "version": 1,
                      "files": {f: r.to_json() for f, r in sorted(files.items())}}
            job.file(commit_name, lambda: write_json(job.tmp / commit_name, commit))
            job.call(folder_mod.commit, job.tmp, path)
        written = True
    finally:  # an interrupt (KeyboardInterrupt) mid-write: no temporary folder stays behind
        if not written and job.tmp is not None:
            folder_mod.abort(job.tmp)
    finish(job, world, path)
    return path


def _write_adapters(job, files: dict, adapters: dict) -> None:
    from .writer import write_shards

    aplan = plan_shards(_sources(adapters), ADAPTER_WEIGHTS[:-len(".safetensors")], None)
    files.update(write_shards(aplan, _sources(adapters), job, lambda f: {"format": "pt"}))


def _write_quantization(job, model, files: dict) -> None:
    """A QLoRA model's base quantization (:func:`~.adapters.base_quantization`), recorded beside its adapters."""
    from .writer import write_record

    record = base_quantization(model)
    if record is not None:
        write_record(job, BASE_QUANTIZATION, record, files)


def _modules(adapters: dict) -> set:
    """peft's target modules: the adapted linears (the experts' adapters are its ``target_parameters``)."""
    found = {k[len(PEFT_PREFIX):-len(".lora_A.weight")] for k in adapters if k.endswith(".lora_A.weight")}
    return {m for m in found if not m.endswith((".experts", ".experts.base_layer"))}


def _all_adapters(model, rank: int, world: int) -> dict:
    """Every stage's adapters under their peft names: a collective. Every rank of a stage holds them whole
    (:func:`~.adapters.adapter_state`), so only the stage's writing rank sends its copy."""
    mine = adapter_state(model)
    if world == 1:
        return mine
    sent = mine if stage_layout(model, rank).writes else {}
    return {k: v for part in _gather(sent, world) for k, v in part.items()}


def save_adapters(model, path, *, base: Optional[str] = None, tokenizer=None,
                  generation_config: Optional[dict] = None) -> Path:
    """Write ``model``'s adapters as a peft folder (``adapter_config.json``, ``adapter_model.safetensors``, and
    ``tokenizer``'s files when given) under the commit file ``lora-adapters.json``, atomically: a crash
    mid-write leaves the folder that was there, and ``path`` is replaced only when it is empty, cuboid's own
    or nothing but model files (:mod:`.folder`). ``base``: the base model folder peft's config names.
    ``generation_config``: written as ``generation_config.json`` (the run's stop ids; ``cuboid convert
    --merge-lora`` carries it into the merged folder). Every rank calls it (the adapters are gathered); rank 0
    writes."""
    from .writer import write_record, write_tokenizer

    path = folder_mod.real(path)
    rank, world = dist_info()
    adapters = _all_adapters(model, rank, world)

    def body(job, files: dict) -> None:
        write_tokenizer(job, tokenizer, files)  # first: it records what save_pretrained added to the folder
        _write_adapters(job, files, adapters)
        write_record(job, ADAPTER_CONFIG, adapter_config(model, _modules(adapters), base), files)
        _write_quantization(job, model, files)
        if generation_config is not None:
            write_record(job, "generation_config.json", generation_config, files)

    return _committed(path, world, rank, ADAPTERS_COMMIT, body)


def save_lora_checkpoint(model, path, *, optimizer=None, scheduler=None, state: Optional[dict] = None,
                         base: Optional[str] = None, tokenizer=None, generation_config: Optional[dict] = None) -> Path:
    """Write a LoRA run's training checkpoint (module docstring) to ``path``, atomically. Every rank calls it
    with the same arguments (the gathers are collectives); rank 0 writes; every rank raises rank 0's error.
    ``base``, ``tokenizer`` and ``generation_config`` as :func:`save_adapters` takes them, so the checkpoint
    loads, generates and evaluates as ``final/`` does (HF's Trainer saves the tokenizer in every checkpoint)."""
    from .writer import hf_config, index_json, write_record, write_shards, write_tokenizer

    path = folder_mod.real(path)
    rank, world = dist_info()
    adapters = _all_adapters(model, rank, world)
    otensors, oinfo = _optimizer_tensors(model, optimizer, rank, world)
    trainer = dict(training_record(model, optimizer, scheduler, state, world), lora=True)

    def body(job, files: dict) -> None:
        write_tokenizer(job, tokenizer, files)  # first: it records what save_pretrained added to the folder
        _write_adapters(job, files, adapters)
        write_record(job, ADAPTER_CONFIG, adapter_config(model, _modules(adapters), base), files)
        write_record(job, "config.json", hf_config(model), files)
        _write_quantization(job, model, files)
        if generation_config is not None:
            write_record(job, "generation_config.json", generation_config, files)
        if oinfo is not None:
            oplan = plan_shards(_sources(otensors), "optimizer", None)
            shards = write_shards(oplan, _sources(otensors), job, lambda f: {"format": "pt"})
            files.update(shards)
            write_record(job, OPTIMIZER_INDEX, index_json(oplan, shards, optimizer=oinfo), files)
        write_record(job, TRAINER_STATE, trainer, files)

    return _committed(path, world, rank, LORA_COMMIT, body)


def commit_name(root: Path) -> str:
    """The LoRA commit file of the folder ``root`` (a training checkpoint's, else an adapter folder's), or a
    :class:`CheckpointError` when it has none."""
    name = lora_commit(root)
    if name is not None:
        return name
    old = " (an older cuboid's LoRA checkpoint with pickled state, which cuboid no longer reads: " \
          "restart the run)" if (root / OLD_RANK_STATE).exists() else ""
    raise CheckpointError(f"{root}: not a LoRA training checkpoint: no {LORA_COMMIT}{old}")


def _commit_files(root: Path) -> dict:
    """The commit file's records, checked for shape (names inside the folder, sizes, SHA-256s, the required
    files present)."""
    from .reader import check_name, record_problem

    name = commit_name(root)
    fmt, required = COMMITS[name]
    file = root / name
    rec = parse_json(file.read_bytes(), file)
    if not isinstance(rec, dict) or set(rec) != {"format", "version", "files"} or rec["format"] != fmt \
            or rec["version"] != 1 or not isinstance(rec["files"], dict):
        raise CheckpointError(f"{file}: not a cuboid LoRA record (corrupted)")
    for f, r in rec["files"].items():
        check_name(file, f, "a recorded file")
        keys = set(r) if isinstance(r, dict) else set()
        problem = record_problem(r) or (None if {"size", "sha256"} <= keys <= {"size", "sha256", "header_sha256"}
                                         else f"fields {sorted(keys)}")
        if problem is not None:
            raise CheckpointError(f"{file}: the record of {f} is corrupt ({problem})")
    missing = [f for f in required if f not in rec["files"]]
    if missing:
        raise CheckpointError(f"{file}: records no {', '.join(missing)} (corrupted)")
    return rec["files"]


def verify_lora(path) -> dict:
    """Check every file of a LoRA training checkpoint or adapter folder against its recorded size and SHA-256,
    the safetensors headers, the optimizer index against its shards and the JSON files; the same answer as
    :func:`~.reader.verify` ({"path", "files", "tensors", "bytes"}), or a :class:`CheckpointError` naming the
    first bad file. Reads every byte once; no tensor is built."""
    from .reader import TensorFolder, check_record

    root = folder_mod.resolve(path)
    files = _commit_files(root)
    total = 0
    for name, rec in sorted(files.items()):
        total += check_record(root, name, rec)
    n, header = read_header(root / ADAPTER_WEIGHTS, files[ADAPTER_WEIGHTS].get("header_sha256"))
    tensors = sum(1 for k in header if k != "__metadata__")
    if OPTIMIZER_INDEX in files:
        ts = TensorFolder(root, "optimizer")
        for shard in ts.files:
            if shard not in files:
                raise CheckpointError(f"{root / OPTIMIZER_INDEX}: names {shard}, which the commit does not record")
            ts._open(shard)
            tensors += sum(1 for k in ts._headers[shard] if k != "__metadata__")
    for name in (ADAPTER_CONFIG, "config.json", TRAINER_STATE):
        if name in files and not isinstance(parse_json((root / name).read_bytes(), root / name), dict):
            raise CheckpointError(f"{root / name}: not a JSON object (corrupted)")
    return {"path": str(root), "files": len(files) + 1, "tensors": tensors, "bytes": total}
