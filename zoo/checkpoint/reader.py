"""Reading model folders: validated lazy access, :func:`verify`, and the one loader.

:class:`TensorFolder` opens a ``{stem}.safetensors`` file or a
``{stem}.safetensors.index.json`` with its shards (cuboid's or anyone's),
checking before any tensor is read that every shard name stays inside the
folder, every named shard exists, has the size the index recorded (cuboid
indexes record sizes and SHA-256s under ``metadata.files``), has a valid
safetensors header and holds the tensors the index says it holds. Tensors are
read through ``safe_open`` (mmap): ``get_slice`` reads only the block asked for,
as a view of the mapped file.

A cuboid index (one with ``metadata.files``, the records of the other files)
is held to more, since cuboid wrote both sides: every shard's header must
hash to its recorded ``header_sha256`` and list exactly the tensors the
weight_map puts in it, a recorded shard of the set must not hold tensors the
weight_map leaves out, and ``total_size`` must equal the tensor bytes of the
headers; so every header is read when the folder opens. A single cuboid
``model.safetensors`` carries its record in its header metadata, with the
header's own SHA-256 (taken with the two hash values as placeholders).
Foreign folders (``transformers``', with no records) get the structural
checks only. Tensor data is hashed only by :func:`verify`
(``load(..., verify=True)``).

Every folder load goes through :func:`plan_reads` and the mapping's lazy views:
:func:`load` (``checkpoint.load``: into an existing model, copied into its
tensors) and :func:`read_new` (``cuboid.load(folder)`` / ``zoo.from_hf``: into
a new model, adopting what was read without copying it).
"""
from __future__ import annotations

import hashlib
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from cuboid.parallel import zero
from cuboid.parallel.layers import to_empty

from ..common import sharded_parameters
from .. import hf_io
from ..families import family_of
from .folder import resolve
from .format import (COMMIT_KEY, CheckpointError, DTYPE_OF_NAME, data_end, masked_header, parse_json, read_header,
                     sha256_file)
from .shards import hf_prefix, meta
from .stages import elsewhere


def check_name(where: Path, file: str, what: str) -> None:
    """Refuse a file name that is not a plain name inside the folder (``where`` names the index)."""
    p = Path(file)
    if not file or p.is_absolute() or ".." in p.parts or len(p.parts) != 1 or "\\" in file or "\0" in file:
        raise CheckpointError(f"{where}: shard name {file!r} for {what} escapes the folder")


def record_problem(rec) -> Optional[str]:
    if not isinstance(rec, dict):
        return "not an object"
    size = rec.get("size")
    if "size" in rec and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        return f"size {size!r} is not a byte count"
    for key in ("sha256", "header_sha256"):
        h = rec.get(key)
        if (key in rec or key == "sha256") and not (isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h)):
            return f"{key} {h!r} is not a SHA-256"
    return None


class NoWeightsError(CheckpointError, FileNotFoundError):
    """A folder without safetensors weights (a checkpoint problem, and a missing file)."""


class TensorFolder:
    """Name-addressed tensors of one file set (``stem`` "model" or "optimizer") in ``path``."""

    def __init__(self, path: Path, stem: str = "model") -> None:
        self.path = Path(path)
        self.stem = stem
        self.index_path = self.path / f"{stem}.safetensors.index.json"
        single = f"{stem}.safetensors"
        self.metadata: dict = {}
        self._headers: Dict[str, dict] = {}
        self._handles: Dict[str, object] = {}
        self._checked: set = set()
        self.single = not self.index_path.is_file()
        if self.index_path.is_file() and (self.path / single).is_file() and not self._index_names(single):
            raise CheckpointError(f"{self.path}: holds both {single} and {self.index_path.name}, so which "
                                  "weights it holds is unclear (one is left over from an earlier save): remove "
                                  "the stale one, or save into an empty folder")
        if self.index_path.is_file():
            self._read_index()
            if self.recorded:
                self._check_recorded()
        elif (self.path / single).is_file():
            self._check_file(single)
            self.weight_map = {k: single for k in self._headers[single] if k != "__metadata__"}
            record = self._headers[single].get("__metadata__", {}).get(COMMIT_KEY)
            self.metadata = parse_json(record, self.path / single, what=f"corrupt {COMMIT_KEY!r} record in the "
                                       "header metadata") if record else {}
            if not isinstance(self.metadata, dict):
                raise CheckpointError(f"{self.path / single}: corrupt {COMMIT_KEY!r} record in the header "
                                      "metadata (not a JSON object)")
            self._check_records(self.path / single)
            self._check_own_header(self.path / single)
        else:
            extra = " (only PyTorch .bin weights found: convert them to safetensors)" if any(
                self.path.glob("*.bin")) else ""
            raise NoWeightsError(f"{self.path}: no {single} or {self.index_path.name}{extra}")

    def _index_names(self, name: str) -> bool:
        """Whether this file set's index maps some tensor to ``name`` (a one-shard index beside its shard,
        as the optimizer's state is written, is not a leftover)."""
        try:
            index = parse_json(self.index_path.read_bytes(), self.index_path)
        except CheckpointError:
            return False  # the index itself is refused when it is read
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        return isinstance(weight_map, dict) and name in weight_map.values()

    def _read_index(self) -> None:
        """Parse and check the index: an object, a weight_map of plain file names, well-formed records."""
        ix = self.index_path
        index = parse_json(ix.read_bytes(), ix)
        if not isinstance(index, dict):
            raise CheckpointError(f"{ix}: not an index (a JSON {type(index).__name__}, not an object)")
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{ix}: no weight_map of tensor -> file names")
        for name, file in wm.items():
            check_name(ix, file, name)
        self.weight_map: Dict[str, str] = dict(wm)
        metadata = index.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise CheckpointError(f"{ix}: metadata is a JSON {type(metadata).__name__}, not an object")
        self.metadata = metadata or {}
        self._check_records(ix)

    def _check_records(self, where: Path) -> None:
        files = self.metadata.get("files")
        if "files" in self.metadata and not isinstance(files, dict):
            raise CheckpointError(f"{where}: metadata.files is not a map of file -> record")
        for file, rec in (files or {}).items():
            check_name(where, file, "a recorded file")
            problem = record_problem(rec)
            if problem is not None:
                raise CheckpointError(f"{where}: the record of {file} is corrupt ({problem})")

    def _check_own_header(self, full: Path) -> None:
        """A single file's header against the header SHA-256 its own record holds (cuboid's, when present)."""
        want = self.metadata.get("header_sha256")
        if not self.metadata or ("header_sha256" not in self.metadata and self.metadata.get("version") == 1):
            return  # written by transformers, or by cuboid before header hashes (version 1)
        if not isinstance(want, str):
            raise CheckpointError(f"{full}: the {COMMIT_KEY!r} record in the header metadata has no header "
                                  "SHA-256 (corrupted)")
        with open(full, "rb") as f:
            raw = f.read(8)
            raw += f.read(struct.unpack("<Q", raw)[0])  # the length was checked when the header was read
        got = hashlib.sha256(masked_header(raw, self.metadata.get("data_sha256"), want)).hexdigest()
        if got != want:
            raise CheckpointError(f"{full}: safetensors header SHA-256 mismatch (corrupted): the file's record "
                                  f"holds {want!r}")

    @property
    def recorded(self) -> bool:
        """A cuboid index: it records the other files (sizes, SHA-256s), so the strict checks apply."""
        return not self.single and isinstance(self.metadata.get("files"), dict)

    def _check_recorded(self) -> None:
        """A cuboid index's checks on every header: listed tensors, recorded shards, ``total_size``."""
        own = re.compile(rf"{re.escape(self.stem)}-\d+-of-\d+\.safetensors")
        shards = self.files + [f for f in self.records if own.fullmatch(f) and f not in self.weight_map.values()]
        total = 0
        for file in shards:  # every file there first: a missing shard is the clearest diagnosis
            self._size(file)
        for file in shards:
            self._check_file(file)
            total += sum(e - b for k, v in self._headers[file].items() if k != "__metadata__"
                         for b, e in [v["data_offsets"]])
        want = self.metadata.get("total_size")
        if want != total or isinstance(want, bool):
            raise CheckpointError(f"{self.index_path}: total_size {want!r} does not match the {total} bytes of "
                                  "tensors in the shards' headers")

    @property
    def files(self) -> List[str]:
        return list(dict.fromkeys(self.weight_map.values()))

    @property
    def records(self) -> Dict[str, dict]:
        files = self.metadata.get("files")
        return files if isinstance(files, dict) else {}

    def _size(self, file: str) -> int:
        """The size of a named file that exists and has its recorded size."""
        full = self.path / file
        try:
            size = full.stat().st_size if full.is_file() else None
        except OSError as e:  # a name too long for the file system, say
            short = file if len(file) <= 80 else file[:60] + "..." + file[-12:]
            raise CheckpointError(f"{self.index_path}: names {short!r}, which cannot be opened "
                                  f"({e.strerror})") from None
        if size is None:
            raise CheckpointError(f"{self.index_path}: names {file}, which does not exist (missing shard)")
        rec = self.records.get(file)
        if rec is not None and "size" in rec and rec["size"] != size:
            raise CheckpointError(f"{full}: {size} bytes, the index recorded {rec['size']} "
                                  f"({'truncated' if size < rec['size'] else 'wrong size'})")
        return size

    def _check_file(self, file: str) -> None:
        """Existence, recorded size, header validity, data extent; once per file."""
        if file in self._checked:
            return
        full = self.path / file
        size = self._size(file)
        rec = self.records.get(file)
        n, header = read_header(full, rec.get("header_sha256") if rec is not None else None)
        if 8 + n + data_end(header) != size:
            raise CheckpointError(f"{full}: the header describes {8 + n + data_end(header)} bytes, "
                                  f"the file has {size} (truncated or wrong size)")
        if self.recorded:
            held = {k for k in header if k != "__metadata__"}
            listed = {k for k, f in self.weight_map.items() if f == file}
            for names, what in ((sorted(listed - held), "lists {} in this file, which does not hold {}"),
                                (sorted(held - listed), "does not list {} in this file, which holds {}")):
                if names:
                    them = "them" if len(names) > 1 else "it"
                    raise CheckpointError(f"{full}: the index " + what.format(", ".join(names[:5]), them))
        self._headers[file] = header
        self._checked.add(file)

    def _open(self, file: str):
        h = self._handles.get(file)
        if h is None:
            self._check_file(file)
            try:
                h = safe_open(str(self.path / file), framework="pt")
            except BaseException as e:  # safetensors' own error types; a Rust panic is a BaseException
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                raise CheckpointError(f"{self.path / file}: not a valid safetensors file ({e})") from None
            stored = set(h.keys())
            listed = [n for n, f in self.weight_map.items() if f == file and n not in stored]
            if listed:
                raise CheckpointError(f"{self.path / file}: the index lists {', '.join(listed[:5])} "
                                      f"in this file, which does not hold {'them' if len(listed) > 1 else 'it'}")
            self._handles[file] = h
        return h

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def get_slice(self, name: str):
        """The lazy view of ``name``: ``get_shape()``, ``get_dtype()``, and ``[slices]`` reads."""
        return self._open(self.weight_map[name]).get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._open(self.weight_map[name]).get_tensor(name)

    def shape_dtype(self, name: str):
        sl = self.get_slice(name)
        return tuple(sl.get_shape()), DTYPE_OF_NAME.get(sl.get_dtype(), sl.get_dtype())


# ------------------------------------------------------------------------ verify


def check_record(path: Path, file: str, rec: Optional[dict], data_hash: bool = False) -> int:
    full = path / file
    if rec is None:
        raise CheckpointError(f"{full}: no SHA-256 recorded (not written by cuboid; "
                              "`cuboid convert` it to add checksums)")
    if not full.is_file():
        raise CheckpointError(f"{path}: the checkpoint records {file}, which does not exist")
    size = full.stat().st_size
    if "size" in rec and size != rec["size"]:
        raise CheckpointError(f"{full}: {size} bytes, recorded {rec['size']} (truncated or wrong size)")
    start = 8 + read_header(full)[0] if data_hash else 0
    got = sha256_file(full, start)
    if got != rec.get("sha256"):
        raise CheckpointError(f"{full}: SHA-256 mismatch (corrupted): recorded {rec.get('sha256')}, got {got}")
    return size


def verify(path, *, require_checksums: bool = True) -> dict:
    """Check every file of a checkpoint against its recorded size and SHA-256.

    Reads every byte once. Covers the model files, every file the commit file
    records (config.json, the optimizer shards and index, trainer_state.json)
    and the optimizer shards its index records. Structural checks come first
    (shard names inside the folder, shards present, headers valid, index and
    headers agree). ``require_checksums=False`` accepts files without a record
    (folders written by ``transformers``) after the structural checks.
    Returns {"path", "files", "tensors", "bytes"}; raises
    :class:`CheckpointError` naming the first bad file.
    """
    root = resolve(path)
    hashed: Dict[str, int] = {}
    tensors = 0

    def check(file: str, rec: Optional[dict], data_hash: bool = False) -> None:
        if file not in hashed and (rec is not None or require_checksums):
            hashed[file] = check_record(root, file, rec, data_hash)

    sets = [TensorFolder(root, "model")]
    if (root / "optimizer.safetensors.index.json").is_file():
        sets.append(TensorFolder(root, "optimizer"))
    for ts in sets:
        for file in ts.files:
            ts._open(file)
            tensors += sum(1 for k in ts._headers[file] if k != "__metadata__")
        for file in ts.files:
            if ts.single:
                sha = ts.metadata.get("data_sha256")
                check(file, {"sha256": sha} if sha else None, data_hash=True)
            else:
                check(file, ts.records.get(file))
        for file, rec in ts.records.items():  # names and records checked when ts opened
            check(file, rec)
    for name in ("config.json", "trainer_state.json"):
        if (root / name).is_file():
            parse_json((root / name).read_bytes(), root / name)
    return {"path": str(root), "files": len(hashed), "tensors": tensors, "bytes": sum(hashed.values())}


_verify = verify


# -------------------------------------------------------------------------- load
#
# One reading path for every folder load: checkpoint.load (into a model that
# exists) and from_hf / cuboid.load(folder) (into a meta model, allocated
# here). Both plan the reads from the headers alone (every problem found
# before any byte is read), then hand each layer a lazy, zoo-shaped view of
# its stored tensors (safetensors get_slice objects, through the mapping's
# Transposed / Stacked / Reshaped views), so each rank reads only its
# shard_slices from the memory-mapped files.


@dataclass
class _Read:
    """One zoo parameter to fill: its mapping row, its layer, and the stored names it reads."""

    row: hf_io.TensorMap
    mod: torch.nn.Module
    local: str
    stored: Tuple[str, ...]
    shared: bool = False  # a stored tensor that feeds another parameter too: never adopted, copied


def _kind(dtype) -> str:
    if not isinstance(dtype, torch.dtype):
        return str(dtype)
    return "float" if dtype.is_floating_point else ("complex" if dtype.is_complex else "int")


def plan_reads(model: torch.nn.Module, folder: TensorFolder) -> Tuple[List[_Read], dict]:
    """What to read for each parameter, and every problem, from the headers alone (no tensor data).

    A parameter under a placeholder (another pipeline stage's layer) is
    skipped: its stored tensors are that stage's to read and check.
    """
    family = family_of(model)
    stored = hf_io.normalise_keys(folder.keys(), family)
    prefix = hf_prefix(model, family)
    params = {name: (mod, local, p) for name, mod, local, p in sharded_parameters(model)}
    used, missing, mismatched, reads = set(), [], [], []
    covered = set()
    for row in family.tensor_maps(model.config):
        if row.zoo not in params:
            if elsewhere(model, row.zoo):  # another pipeline stage's: read there, neither missing nor unexpected
                used.update(row.hf)
            continue
        covered.add(row.zoo)
        mod, local, p = params[row.zoo]
        absent = [h for h in row.hf if h not in stored]
        if absent and row.alt is not None and all(h in stored for h in row.alt.hf):
            row, absent = row.alt, []  # the tensor's other stored form (gpt-oss's MXFP4 experts)
        # the stored tensors' shapes and kinds (float, int) as the row writes them
        expect = [(tuple(m.shape), m.dtype) for m in row.to_hf(meta(mod.full_shape(local), p.dtype))]
        if absent:
            missing.extend(h if row.top else prefix + h for h in absent)
            continue
        used.update(row.hf)
        bad = []
        for h, (want, kind) in zip(row.hf, expect):
            shape, dtype = folder.shape_dtype(stored[h])
            if shape != want or _kind(dtype) != _kind(kind):
                bad.append(f"{stored[h]} (-> {row.zoo}): checkpoint {shape} {dtype}, model {want} {p.dtype} "
                           f"(stored in {folder.weight_map[stored[h]]})")
        if bad:
            mismatched.extend(bad)
            continue
        reads.append(_Read(row, mod, local, tuple(stored[h] for h in row.hf)))
    missing.extend(n for n in params if n not in covered)
    unexpected = [k for k in stored if k not in used and not k.endswith(tuple(family.ignored))]
    uses = Counter(n for r in reads for n in r.stored)
    for r in reads:
        r.shared = any(uses[n] > 1 for n in r.stored)
    return reads, {"missing": missing, "unexpected": [stored[k] for k in unexpected], "mismatched": mismatched}


def _open(model: torch.nn.Module, path, strict: bool, verify: bool):
    root = resolve(path)
    if verify:
        _verify(root)
    folder = TensorFolder(root, "model")
    reads, problems = plan_reads(model, folder)
    if strict and any(problems.values()):
        lines = [f"{kind}: {', '.join(v)}" for kind, v in problems.items() if v]
        raise CheckpointError(f"{root}: checkpoint does not fit the {family_of(model).name} model; "
                              + "; ".join(lines))
    return folder, reads, problems


def _view(folder: TensorFolder, r: _Read):
    """The zoo-shaped lazy view of ``r``'s stored tensors: slicing it reads only that block of the files."""
    return r.row.view([folder.get_slice(n) for n in r.stored])


def load(model: torch.nn.Module, path, *, strict: bool = True, verify: bool = False) -> dict:
    """Load a cuboid or Hugging Face checkpoint folder into ``model``, built under any plan.

    Every layer gets its part through ``load_full(name, view)``, where
    ``view`` is a lazy, zoo-shaped view of the stored tensors (safetensors
    ``get_slice`` objects behind the mapping's transposes, q/k/v stacks and
    reshapes): each rank reads only its ``shard_slices`` from the mmap (and,
    under pipeline parallelism, only its stages' tensors), and a
    transform materialises at most the rows asked for (never more than one
    stored tensor), not the whole transformed tensor. Values are
    copied into the model's own tensors. Floating-point tensors are cast to
    the parameter's dtype (a bf16 checkpoint loads into an fp32 model); a
    non-float tensor for a float parameter is a mismatch.

    Every problem is collected first: missing, unexpected and mis-shaped keys
    (with both shapes and dtypes). ``strict`` raises a :class:`CheckpointError`
    naming all of them and loads nothing; ``strict=False`` loads what fits and
    returns them. ``verify=True`` runs :func:`verify` first (reads every byte).
    Returns ``{"missing": [...], "unexpected": [...], "mismatched": [...]}``.
    """
    zero.reshard(model)
    folder, reads, problems = _open(model, path, strict, verify)
    for r in reads:
        r.mod.load_full(r.local, _view(folder, r))
    return problems


def _dense(t: torch.Tensor) -> bool:
    """Contiguous, or a 2-D transpose of a contiguous block (GPT-2 Conv1D weights as stored)."""
    return t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())


def _fill(r: _Read, view) -> None:
    """Make ``r``'s parameter this rank's part of ``view``: adopted without a copy where it can be."""
    param = getattr(r.mod, r.local)
    part = r.mod.local_part(r.local, view)
    if part.dtype != param.dtype:
        part = part.to(param.dtype)
    if tuple(part.shape) != tuple(param.shape):
        raise CheckpointError(f"{r.row.zoo}: {type(r.mod).__name__}.local_part gave {tuple(part.shape)} "
                              f"for a local parameter of {tuple(param.shape)}")
    with torch.no_grad():
        if not r.shared and part.device == param.device and _dense(part):
            param.data = part  # a view of the mapped file (copy-on-write), or a tensor made for it
        else:
            param.copy_(part)


def read_new(model: torch.nn.Module, path, *, device="cpu", strict: bool = True, seed: int = 0) -> dict:
    """Allocate the meta ``model`` on ``device`` and fill it from the folder ``path`` (what ``from_hf`` runs).

    The same plan and views as :func:`load`, but the parameters are new, so
    nothing is copied that need not be: each layer's ``local_part`` is
    adopted as the parameter when it is on ``device`` with the parameter's
    dtype and a dense layout. On CPU a part stored as it is used (a whole
    tensor, a block of rows, a GPT-2 Conv1D weight in its stored (in, out)
    layout, which the parameter then has: a transposed view, not
    contiguous) stays a view of the memory-mapped file, as ``transformers``
    keeps its weights: no anonymous memory until it is written, and
    copy-on-write then (the files must not be rewritten in place while the
    model lives; cuboid's writers replace files by rename). Parts that are
    assembled (tensor-parallel segments, stacked q/k/v, padding) or cast are
    made once and adopted. ``device="meta"``: the checks only, nothing
    allocated. Parameters the folder lacks (``strict=False``) are
    initialised by ``model.init_weights(seed)``, not left as garbage.
    """
    folder, reads, problems = _open(model, path, strict, False)
    if str(device) == "meta":
        return problems
    to_empty(model, device)
    if len(reads) < sum(1 for _ in sharded_parameters(model)):
        model.init_weights(seed)
    for r in reads:
        _fill(r, _view(folder, r))
    return problems
