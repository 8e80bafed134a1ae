"""safetensors files written one tensor at a time, and the byte-level checks.

``safetensors.torch.save_file`` takes a dict of tensors that are all in
memory; a writer that must never hold more than one gathered tensor (and a
converter that must not hold a whole model) needs to stream. The format is
small and fixed (https://github.com/huggingface/safetensors#format):

    8 bytes   N, the header length, unsigned little-endian
    N bytes   JSON header: {"__metadata__": {str: str}, name: {"dtype", "shape",
              "data_offsets": [begin, end]}, ...}, padded with spaces to a
              multiple of 8 so the data starts aligned
    data      each tensor's raw little-endian bytes, back to back

Since the header only needs shapes and dtypes, :class:`StreamWriter` writes it
first (from the shard plan) and then appends each tensor as it arrives.
Tensors are laid out by descending element size (as the Rust writer does) so
every tensor is aligned to its element size. Reading is left to
``safetensors.safe_open``, which validates headers and offsets; files written
here are read back by it in the tests, and by ``transformers``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _attr, _name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _attr):
        DTYPES[getattr(torch, _attr)] = _name
DTYPE_OF_NAME = {v: k for k, v in DTYPES.items()}

HASH_PLACEHOLDER = "?" * 64  # patched with the data's SHA-256 once the data is written
HEADER_PLACEHOLDER = "!" * 64  # patched with the header's SHA-256 (taken with both placeholders in place)

# the names both sides of a folder agree on (the reader and the writer import them from here)
COMMIT_KEY = "cuboid"  # safetensors header metadata key of a single-file checkpoint's record
INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
TRAINER_STATE = "trainer_state.json"
LORA_COMMIT = "lora-checkpoint.json"  # a LoRA training checkpoint's commit file (.lora_state)
ADAPTERS_COMMIT = "lora-adapters.json"  # a LoRA adapter folder's commit file (a fine-tune's final/; .lora_state)
_CHUNK = 8 << 20


def lora_commit(root: Path) -> Optional[str]:
    """The name of the LoRA commit file in the folder ``root`` (a training checkpoint's, else an adapter
    folder's), or None."""
    return next((n for n in (LORA_COMMIT, ADAPTERS_COMMIT) if (Path(root) / n).is_file()), None)


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete, corrupt, or does not fit the model."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in safetensors") from None


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class FileRecord:
    """What the commit file records of every other file: its size and SHA-256.

    A safetensors shard's record also holds ``header_sha256``, the SHA-256 of
    its first 8 + N bytes (length and header): every load checks it, at the
    cost of hashing a few kilobytes, so a damaged header is refused even when
    it still parses (a swapped offset, a flipped metadata byte), while the
    data is hashed only by :func:`~.reader.verify`.
    """

    size: int
    sha256: str
    header_sha256: Optional[str] = None

    def to_json(self) -> dict:
        out = {"size": self.size, "sha256": self.sha256}
        if self.header_sha256 is not None:
            out["header_sha256"] = self.header_sha256
        return out


def fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def write_bytes(path: Path, data: bytes) -> FileRecord:
    """Write a small file durably and return its record."""
    with open(path, "wb") as f:
        f.write(data)
        fsync_file(f)
    return FileRecord(len(data), hashlib.sha256(data).hexdigest())


def write_json(path: Path, obj) -> FileRecord:
    return write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def layout(entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]]) -> List[Tuple[str, torch.dtype, tuple]]:
    """Write order inside one file: descending element size, then plan order (stable)."""
    items = [(n, d, tuple(int(s) for s in shape)) for n, d, shape in entries]
    return sorted(items, key=lambda e: -torch.empty((), dtype=e[1]).element_size())


class StreamWriter:
    """Write one safetensors file tensor by tensor, in the order of :func:`layout`.

    ``metadata`` goes into ``__metadata__`` (str -> str). If one of its values
    contains :data:`HASH_PLACEHOLDER`, that text is replaced on :meth:`close`
    by the SHA-256 of the data section (everything after the header), so a
    single file can carry its own checksum; :data:`HEADER_PLACEHOLDER` the
    same way by the SHA-256 of the length and header as first written (both
    placeholders in place: :func:`masked_header` undoes the patches). Otherwise
    :meth:`close` returns the SHA-256 of the whole file and of its header.
    Either is computed while writing (no second read), on a helper thread that
    hashes each tensor while it is written.
    """

    def __init__(self, path: Path, entries: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Optional[Dict[str, str]] = None) -> None:
        self.path = Path(path)
        self.order = layout(entries)
        header: dict = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, dtype, shape in self.order:
            n = nbytes(shape, dtype)
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        self.data_size = offset
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
        raw += b" " * (-len(raw) % 8)
        self._header = raw
        self._patch = raw.find(HASH_PLACEHOLDER.encode())
        self._head_patch = raw.find(HEADER_PLACEHOLDER.encode())
        self._head_hash = hashlib.sha256(struct.pack("<Q", len(raw)) + raw).hexdigest()
        self._hash = hashlib.sha256()  # of the data section if patched, else of the whole file
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="sha256")  # hashes while the file writes
        self._next = 0
        self._f = open(self.path, "wb")
        prefix = struct.pack("<Q", len(raw)) + raw
        self._f.write(prefix)
        if self._patch < 0:
            self._hash.update(prefix)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.order):
            raise CheckpointError(f"{self.path.name}: {name} is not planned for this file")
        want_name, want_dtype, want_shape = self.order[self._next]
        if name != want_name or tensor.dtype != want_dtype or tuple(tensor.shape) != want_shape:
            raise CheckpointError(
                f"{self.path.name}: planned {want_name} {want_shape} {want_dtype}, "
                f"got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self._next += 1
        if tensor.numel() == 0:
            return
        buf = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        hashed = self._hasher.submit(self._hash.update, buf)  # both release the GIL: they overlap
        self._f.write(buf)
        hashed.result()

    def close(self) -> FileRecord:
        """Finish the file (patch the data hash if asked), fsync it, return size and SHA-256.

        With a patched header the record's SHA-256 is the data section's.
        """
        if self._next != len(self.order):
            missing = [n for n, _, _ in self.order[self._next:]]
            self.abort()
            raise CheckpointError(f"{self.path.name}: {len(missing)} planned tensors never written: {missing[:3]}")
        digest = self._hash.hexdigest()
        if self._patch >= 0:
            self._f.seek(8 + self._patch)
            self._f.write(digest.encode())
        if self._head_patch >= 0:
            self._f.seek(8 + self._head_patch)
            self._f.write(self._head_hash.encode())
        fsync_file(self._f)
        self._f.close()
        self._hasher.shutdown(wait=True)
        return FileRecord(8 + len(self._header) + self.data_size, digest,
                          self._head_hash if self._patch < 0 and self._head_patch < 0 else None)

    def abort(self) -> None:
        self._hasher.shutdown(wait=True)
        if not self._f.closed:
            self._f.close()


# ----------------------------------------------------------------------- reading


MAX_HEADER = 100 << 20  # safetensors' own limit on the header length


def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def parse_json(raw, where, object_pairs_hook=None, what: str = "not valid JSON"):
    """``raw`` (bytes or text) parsed as JSON, or a one-line :class:`CheckpointError` "``where``: ``what``
    (why)".

    Undecodable bytes, bad syntax, a duplicate key (with ``_no_duplicates``) and nesting too deep for
    Python's parser (a ``RecursionError``, not a ``ValueError``) are all refused the same way.
    """
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError, as is a duplicate key
        raise CheckpointError(f"{where}: {what} ({' '.join(str(e).split())})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: {what} (nested too deeply to read)") from None


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _entry_problem(entry) -> Optional[str]:
    """What is wrong with one tensor's header entry, or None."""
    if not isinstance(entry, dict):
        return "not an object"
    absent = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if absent:
        return f"no {absent[0]}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or not dtype:
        return f"dtype {dtype!r} is not a name"
    if not isinstance(shape, list) or not all(_count(s) for s in shape):
        return f"shape {shape!r} is not a list of sizes"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        return f"data_offsets {offsets!r} are not [begin, end]"
    if dtype in DTYPE_OF_NAME and offsets[1] - offsets[0] != nbytes(shape, DTYPE_OF_NAME[dtype]):
        return (f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
                f"shape {shape} {dtype} needs {nbytes(shape, DTYPE_OF_NAME[dtype])}")
    return None  # a dtype torch has no name for (F4, F8_E8M0, a typo) is safetensors' to accept or refuse


def read_header(path: Path, sha256: Optional[str] = None) -> Tuple[int, dict]:
    """(header length, header dict) of a safetensors file, with clear errors on garbage.

    Every tensor entry is checked (a dtype name, a shape, offsets that hold
    exactly the shape's bytes when torch knows the dtype; the offsets tile the
    data section without gaps or overlaps, no name twice), so a header that
    passes can be read without surprises. With
    ``sha256`` (a record's ``header_sha256``) the length and header bytes must
    hash to it.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors file (truncated)")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER):
            raise CheckpointError(f"{path}: header length {n} does not fit the file's {size} bytes "
                                  "(truncated or not safetensors)")
        raw = f.read(n)
    if sha256 is not None and hashlib.sha256(head + raw).hexdigest() != sha256:
        raise CheckpointError(f"{path}: safetensors header SHA-256 mismatch (corrupted): the index recorded "
                              f"{sha256}")
    header = parse_json(raw, path, _no_duplicates, "corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ is not a map of strings)")
    for name, entry in header.items():
        problem = None if name == "__metadata__" else _entry_problem(entry)
        if problem is not None:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor {name!r}: {problem})")
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    at = 0
    for begin, end in spans:
        if begin != at:
            raise CheckpointError(f"{path}: corrupt safetensors header (tensor data "
                                  f"{'overlaps' if begin < at else 'leaves a gap'} at byte {min(begin, at)})")
        at = end
    return n, header


def masked_header(raw: bytes, data_sha256, header_sha256) -> bytes:
    """A single file's length and header with its own recorded hashes put back to the placeholders."""
    for value, placeholder in ((data_sha256, HASH_PLACEHOLDER), (header_sha256, HEADER_PLACEHOLDER)):
        if isinstance(value, str) and len(value) == 64:
            raw = raw.replace(value.encode(), placeholder.encode(), 1)
    return raw


def data_end(header: dict) -> int:
    return max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


def sha256_file(path: Path, start: int = 0) -> str:
    """SHA-256 of a file from byte ``start`` on, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()
