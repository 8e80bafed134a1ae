"""Writing model folders: :func:`save`, :func:`export` (``zoo.to_hf``), and the shard writer the converter shares.

:func:`save` and :func:`export` share everything but the folder protocol: the
sources (:func:`~.shards.model_sources`: HF names, tied weights once), the
config and dtype rule (:func:`hf_config`) and the file writer below.

Every rank runs the same loop over the same plan: for each file, for each
tensor in the file's order, fetch its source (one ``full_tensor`` call per zoo
parameter; at most one source's tensors are alive at a time). Only rank 0
writes: it creates the temporary folder, writes each file through
:class:`~.format.StreamWriter` (one tensor in memory at a time, never a whole
shard), commits (:mod:`.folder`), then broadcasts its outcome, which is the
barrier the other ranks wait at; a failure on rank 0 is raised on every rank.
A rank-0 I/O error does not stop the loop: the fetches (collectives under
tensor parallelism) go on to the end so no rank is left waiting in one.

Under pipeline parallelism no rank holds every tensor: each stage writes its
own files into the same temporary folder and rank 0 writes the index last
(:mod:`.stages`, :func:`save`).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cuboid.parallel import zero

from ..families import family_of
from . import folder as folder_mod
from .adapters import has_adapters
from .format import (COMMIT_KEY, HASH_PLACEHOLDER, HEADER_PLACEHOLDER, INDEX, OPTIMIZER_INDEX, TRAINER_STATE,
                     CheckpointError, FileRecord, StreamWriter, fsync_file, layout, sha256_file, write_json)
from .shards import ShardPlan, Size, Source, model_sources, plan_shards
from .stages import StageLayout, describe, merge_optimizer_info, plan_stages, stage_layout, stage_part
from .state import dist_info, optimizer_sources, training_record


class Job:
    """The writing side of a save: active on rank 0 only, remembers the first error."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.error: Optional[BaseException] = None
        self.tmp: Optional[Path] = None

    @property
    def ok(self) -> bool:
        return self.active and self.error is None

    def call(self, fn: Callable, *args):
        if not self.ok:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by finish()
            self.error = e
            return None

    def file(self, name: str, fn: Callable, *args) -> Optional[FileRecord]:
        rec = self.call(fn, *args)
        if rec is not None:
            self.call(folder_mod.hook, f"file:{name}")
        return rec


def write_shards(plan: ShardPlan, sources: Sequence[Source], job: Job,
                 metadata_for: Callable[[str], Dict[str, str]], progress=None) -> Dict[str, FileRecord]:
    """Write ``plan``'s files into ``job.tmp``; every rank fetches every source in the same order."""
    where = {n: (src, i) for src in sources for i, n in enumerate(src.names)}
    records: Dict[str, FileRecord] = {}
    cur_src, cur = None, None
    for fname, names in plan.files.items():
        entries = [(n, plan.metas[n].dtype, tuple(plan.metas[n].shape)) for n in names]
        w = job.call(lambda: StreamWriter(job.tmp / fname, entries, metadata_for(fname)))
        for n, _, _ in layout(entries):
            src, i = where[n]
            if src is not cur_src:
                cur = None  # release the previous source before fetching the next
                cur = src.fetch()
                cur_src = src
            if w is not None and job.ok:
                job.call(w.write, n, cur[i])
            if progress is not None:
                progress.update(int(cur[i].numel() * cur[i].element_size()))
        if w is not None:
            if job.ok:
                rec = job.file(fname, w.close)
                if rec is not None:
                    records[fname] = rec
            else:
                w.abort()
    return records


def index_json(plan: ShardPlan, files: Dict[str, FileRecord], **metadata) -> dict:
    """An index file's content: ``weight_map``; metadata ``total_size`` and the records of ``files``."""
    return {"metadata": {"total_size": plan.total_size, "format": "cuboid", "version": 1,
                         "files": {f: r.to_json() for f, r in sorted(files.items())}, **metadata},
            "weight_map": dict(sorted(plan.weight_map.items()))}


def write_record(job: Job, name: str, content, extra: Dict[str, FileRecord]) -> None:
    """Write the JSON file ``name`` into ``job.tmp`` and record it in ``extra``."""
    rec = job.file(name, lambda: write_json(job.tmp / name, content))
    if rec is not None:
        extra[name] = rec


def write_model_files(plan: ShardPlan, sources: Sequence[Source], job: Job,
                      extra: Dict[str, FileRecord], progress=None) -> None:
    """The model's files, the commit file last: the index, or the single file that records the rest."""
    if plan.sharded:
        shards = write_shards(plan, sources, job, lambda f: {"format": "pt"}, progress)
        job.file(INDEX, lambda: write_json(job.tmp / INDEX, index_json(plan, {**extra, **shards})))
    else:
        # version 2: the record holds header_sha256 (a reader requires it unless the record says version 1)
        record = json.dumps({"version": 2, "data_sha256": HASH_PLACEHOLDER, "header_sha256": HEADER_PLACEHOLDER,
                             "files": {f: r.to_json() for f, r in sorted(extra.items())}}, sort_keys=True)
        write_shards(plan, sources, job, lambda f: {"format": "pt", COMMIT_KEY: record}, progress)


def write_tokenizer(job: Job, tokenizer, extra: Dict[str, FileRecord]) -> None:
    """``tokenizer.save_pretrained`` into ``job.tmp`` (still empty of other files), each file it wrote fsync'd
    and recorded in ``extra``: inside the commit, so :func:`~.reader.verify` checks the tokenizer too."""
    if tokenizer is None or not job.ok:
        return

    def run() -> Dict[str, FileRecord]:
        before = set(os.listdir(job.tmp))
        tokenizer.save_pretrained(str(job.tmp))
        out = {}
        for name in sorted(set(os.listdir(job.tmp)) - before):
            p = job.tmp / name
            if p.is_file() and not p.is_symlink():
                with open(p, "rb+") as f:
                    fsync_file(f)
                out[name] = FileRecord(p.stat().st_size, sha256_file(p))
        return out

    for name, rec in (job.call(run) or {}).items():
        job.call(folder_mod.hook, f"file:{name}")
        extra[name] = rec


def finish(job: Job, world: int, path: Path) -> None:
    """Clean up after a failure, and raise rank 0's outcome on every rank (the barrier)."""
    if job.error is not None and job.tmp is not None:
        folder_mod.abort(job.tmp)
    if world > 1:
        import torch.distributed as dist

        msg = [f"{type(job.error).__name__}: {job.error}" if job.error is not None else None]
        dist.broadcast_object_list(msg, src=0)
        if job.error is None and msg[0] is not None:
            raise CheckpointError(f"rank 0 failed to write {path}: {msg[0]}")
    if job.error is not None:
        raise job.error


def hf_config(model: torch.nn.Module) -> dict:
    """``config.json`` of every folder cuboid writes (:func:`save` and :func:`export`).

    The family's config, its architecture, and ``torch_dtype``: the dtype of
    the floating-point parameters, which is the dtype the tensors are stored in.
    """
    family = family_of(model)
    cfg = family.config_to_hf(model.config)
    cfg["architectures"] = [family.architecture_of(model.config)]
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    from .quant_sources import quantization_config

    quant = quantization_config(model)  # a 4-bit NF4 base: transformers' bitsandbytes config
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def export(model: torch.nn.Module, path) -> Path:
    """Write ``model`` into the folder ``path`` as ``config.json`` + one ``model.safetensors`` (``zoo.to_hf``).

    The same sources, config and dtype rules as :func:`save`, without its
    folder replacement: ``path`` is created if need be (a link: the folder it
    points to) and its other files (a tokenizer, a model card) are kept. Each
    file is written under a temporary folder inside ``path`` and renamed into
    place, ``config.json`` last. What an earlier save left that the new
    weights replace goes (:func:`~.folder.stale_files`): the old model index
    before the new files move in (so a crash leaves no index to win over the
    new ``model.safetensors``), its shards and the old training state after.
    Call it on every rank of a sharded model (every rank gathers, rank 0 writes).
    """
    path = folder_mod.real(path)
    rank, world = dist_info()
    if stage_layout(model, rank).stages > 1:
        raise CheckpointError("writing a Hugging Face folder from pipeline stages: use "
                              "cuboid.zoo.checkpoint.save(model, path), which transformers loads too")
    sources = model_sources(model)
    plan = plan_shards(sources, "model", None)
    cfg = hf_config(model)

    def scratch() -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".cuboid-export-", dir=path))

    def move_in() -> None:
        stale = folder_mod.stale_files(path)
        for p in stale[:1] if stale and stale[0].name == INDEX else []:  # the old commit file first
            p.unlink()
            folder_mod.fsync_dir(path)
        for name in ("model.safetensors", "config.json"):
            os.replace(job.tmp / name, path / name)
        for p in stale:
            p.unlink(missing_ok=True)
        folder_mod.fsync_dir(path)

    job = Job(rank == 0)
    try:
        job.tmp = job.call(scratch)
        rec = job.file("config.json", lambda: write_json(job.tmp / "config.json", cfg))
        write_model_files(plan, sources, job, {"config.json": rec} if rec is not None else {})
        job.call(move_in)
    finally:
        if job.tmp is not None:
            folder_mod.abort(job.tmp)
    finish(job, world, path)
    return path


def save(model: torch.nn.Module, path, *, max_shard_size: Size = "5GB", optimizer=None, scheduler=None,
         state: Optional[dict] = None, tokenizer=None, config_fields: Optional[dict] = None,
         generation_config: Optional[dict] = None) -> Path:
    """Save ``model`` (and optionally its training state) as a sharded safetensors folder.

    Layout (Hugging Face's, so ``transformers.AutoModel*.from_pretrained(path)``
    loads it): ``config.json``; ``model-0000i-of-0000N.safetensors`` +
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``,
    and ``metadata.files``: size and SHA-256 of every other file), or one
    ``model.safetensors`` when everything fits in ``max_shard_size`` (HF units:
    "5GB" = 5e9 bytes), whose header metadata ``cuboid`` records the SHA-256 of
    its data section and the other files. Tensors are under the model's HF
    names; tied weights are stored once.

    ``optimizer`` / ``scheduler`` / ``state`` (a dict of JSON values: the data
    position, ``step``) add the training state of :mod:`.state`. ``tokenizer``
    (anything with ``save_pretrained(folder)``, on the writing rank) is written
    into the folder before its commit file and recorded with its checksums, as
    the trainer's ``final/`` holds it. ``config_fields`` (the special token ids a tokenizer gives) join
    ``config.json``; ``generation_config`` is written as ``generation_config.json`` (what ``transformers``'
    ``generate`` reads its stop ids from), both recorded inside the commit.

    ``path`` is resolved (a link: the folder it points to, the link kept) and
    replaced only when it is empty, cuboid's own or nothing but model files
    (:mod:`.folder`): otherwise a :class:`CheckpointError` names the file in the way.

    Call it on every rank of an initialised process group with the same
    arguments: every rank gathers every tensor in the same order, rank 0
    writes, all return once the checkpoint is committed. The write is atomic
    (:mod:`.folder`). Returns ``path``.

    Under pipeline parallelism (``state_of(model).mesh`` with ``pp > 1``) each stage
    writes its own tensors (:mod:`.stages`): always an index, each stage's
    tensors in files of their own, a tied tensor once, optimizer state per
    stage; no rank gathers the model.

    A LoRA model (``cuboid.load(..., lora=...)``) is saved by the package's
    ``checkpoint.save`` as its adapters in ``peft``'s layout
    (:func:`~.lora_state.save_adapters`, what a LoRA fine-tune's ``final/``
    holds); its training state goes through ``cuboid.zoo.lora.save_checkpoint``.
    """
    path = folder_mod.real(path)
    if has_adapters(model):
        raise CheckpointError("a LoRA model is saved by cuboid.zoo.checkpoint.save (its adapters) or "
                              "cuboid.zoo.lora.save_checkpoint (with its optimizer and state)")
    rank, world = dist_info()
    where = stage_layout(model, rank)
    if where.stages > 1:
        return _save_stages(model, path, where, rank, world, max_shard_size, optimizer, scheduler, state,
                            tokenizer, config_fields, generation_config)
    zero.reshard(model)  # ZeRO-3 after an evaluation forward: the sharded parameters back on the modules
    msources = model_sources(model)
    mplan = plan_shards(msources, "model", max_shard_size)
    oplan, osources, oinfo = None, [], None
    if optimizer is not None:
        osources, oinfo = optimizer_sources(model, optimizer)
        oplan = plan_shards(osources, "optimizer", max_shard_size)
    training = optimizer is not None or scheduler is not None or state is not None
    trainer = training_record(model, optimizer, scheduler, state, world) if training else None
    cfg = {**hf_config(model), **(config_fields or {})}

    job = Job(rank == 0)
    try:
        job.tmp = job.call(folder_mod.begin, path)
        extra: Dict[str, FileRecord] = {}
        write_tokenizer(job, tokenizer, extra)
        write_record(job, "config.json", cfg, extra)
        if generation_config is not None:
            write_record(job, "generation_config.json", generation_config, extra)
        if oplan is not None:
            shards = write_shards(oplan, osources, job, lambda f: {"format": "pt"})
            extra.update(shards)
            write_record(job, OPTIMIZER_INDEX, index_json(oplan, shards, optimizer=oinfo), extra)
        if trainer is not None:
            write_record(job, TRAINER_STATE, trainer, extra)
        write_model_files(mplan, msources, job, extra)
        job.call(folder_mod.commit, job.tmp, path)
    except BaseException:
        if job.tmp is not None:
            folder_mod.abort(job.tmp)
        raise
    finish(job, world, path)
    return path


def _error_text(e: Optional[BaseException]) -> Optional[str]:
    return None if e is None else f"{type(e).__name__}: {e}"


def _first_failure(outcomes: Sequence[tuple]) -> Optional[Tuple[int, str]]:
    """(rank, error) of the lowest rank whose outcome (anything, error text) has an error."""
    return next(((r, o[-1]) for r, o in enumerate(outcomes) if o[-1] is not None), None)


def _save_stages(model: torch.nn.Module, path: Path, where: StageLayout, rank: int, world: int,
                 max_shard_size: Size, optimizer, scheduler, state: Optional[dict], tokenizer=None,
                 config_fields: Optional[dict] = None, generation_config: Optional[dict] = None) -> Path:
    """:func:`save` of a pipeline stage model: each stage writes its own files, rank 0 the index last.

    The collectives, the same on every rank and in this order: one
    ``all_gather_object`` of every rank's descriptions (or its error), the
    RNG gather of the training state, rank 0's broadcast of the temporary
    folder, the stages' fetches (inside each stage's tensor groups), one
    ``all_gather_object`` of every rank's file records (or its error), and
    rank 0's broadcast of the commit's outcome. A failure anywhere is raised
    on every rank (naming the rank) without leaving one in a collective.
    """
    import torch.distributed as dist

    def gather(obj) -> list:
        out: List[object] = [None] * world
        dist.all_gather_object(out, obj)
        return out

    mine, err = None, None
    try:
        msources = model_sources(model)
        osources, oinfo = optimizer_sources(model, optimizer) if optimizer is not None else ([], None)
        mine = (where.stage, describe(msources), describe(osources), oinfo)
    except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
        err = e
    described = gather((mine, _error_text(err)))
    failed = _first_failure(described)
    if failed is not None:
        if err is not None:
            raise err
        raise CheckpointError(f"rank {failed[0]} cannot save {path}: {failed[1]}")
    stages: Dict[int, tuple] = {}
    for (stage, *rest), _ in described:
        stages.setdefault(stage, tuple(rest))
    ordered = [stages[s] for s in range(where.stages)]
    mplan, mowner = plan_stages([m for m, _, _ in ordered], "model", max_shard_size)
    oplan, oowner = plan_stages([o for _, o, _ in ordered], "optimizer", max_shard_size) \
        if optimizer is not None else (None, {})
    oinfo = merge_optimizer_info([i for _, _, i in ordered])
    training = optimizer is not None or scheduler is not None or state is not None
    trainer = training_record(model, optimizer, scheduler, state, world) if training else None

    job = Job(where.writes)
    if rank == 0:
        job.tmp = job.call(folder_mod.begin, path)
    opened = [str(job.tmp) if job.tmp is not None else None, _error_text(job.error)]
    dist.broadcast_object_list(opened, src=0)
    if opened[1] is not None:
        if job.error is not None:
            raise job.error
        raise CheckpointError(f"rank 0 failed to write {path}: {opened[1]}")
    job.tmp = Path(opened[0])

    records: Dict[str, FileRecord] = {}
    err = None
    try:
        if where.fetches:
            if oplan is not None:
                records.update(write_shards(stage_part(oplan, oowner, where.stage), osources, job,
                                            lambda f: {"format": "pt"}))
            records.update(write_shards(stage_part(mplan, mowner, where.stage), msources, job,
                                        lambda f: {"format": "pt"}))
    except Exception as e:  # noqa: BLE001 - a fetch failed: told to every rank below
        err = e
    err = job.error or err
    written = gather((records, _error_text(err)))
    failed = _first_failure(written)
    if failed is not None:
        if rank == 0:
            folder_mod.abort(job.tmp)
        if err is not None:
            raise err
        raise CheckpointError(f"rank {failed[0]} failed to write {path}: {failed[1]}")

    def complete() -> None:  # rank 0: the small files, the model index last, then the commit
        files: Dict[str, FileRecord] = {f: r for recs, _ in written for f, r in recs.items()}
        extra: Dict[str, FileRecord] = {}
        write_tokenizer(job, tokenizer, extra)
        write_record(job, "config.json", {**hf_config(model), **(config_fields or {})}, extra)
        if generation_config is not None:
            write_record(job, "generation_config.json", generation_config, extra)
        if oplan is not None:
            shards = {f: files[f] for f in oplan.files}
            extra.update(shards)
            write_record(job, OPTIMIZER_INDEX, index_json(oplan, shards, optimizer=oinfo), extra)
        if trainer is not None:
            write_record(job, TRAINER_STATE, trainer, extra)
        shards = {f: files[f] for f in mplan.files}
        write_record(job, INDEX, index_json(mplan, {**extra, **shards}), {})
        job.call(folder_mod.commit, job.tmp, path)

    if rank == 0:
        job.call(complete)
    finish(job, world, path)  # rank 0's outcome on every rank; a failed folder is removed
    return path
