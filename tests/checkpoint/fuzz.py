"""Seeded corruptions of a small sharded checkpoint, each loaded in a forked child with a time limit.

Used by ``test_fuzz.py``; ``python -m tests.checkpoint.fuzz [N] [SEED]`` (from the repository root)
prints the table of outcomes by kind.

The checkpoint is gpt-debug saved with ``max_shard_size="60KB"``: ten shards and an index. Three
variants of it are damaged:

- ``cuboid`` (6 cases in 10): the folder as cuboid writes it (the index records every file's size,
  SHA-256 and header SHA-256);
- ``foreign`` (2 in 10): the same shards under an index without records, as ``transformers`` writes
  one, so only the structural checks stand between a damaged file and the model;
- ``single`` (2 in 10): the model saved as one ``model.safetensors``, whose header metadata holds
  the record (data and header SHA-256, the other files).

Each case copies the pristine folder, applies one damage (kinds below), and forks a child from
this process (torch and cuboid are imported once, so a fresh child costs milliseconds, not an
interpreter start) that runs the loaders on it, each in its own ``try``:

- ``load``: ``checkpoint.load(model, path)`` into a model whose parameters are NaN;
- ``load_verify``: the same with ``verify=True`` (not in the foreign variant, which records nothing);
- ``verify``: ``checkpoint.verify(path)`` (the same);
- ``new``: ``cuboid.load(path)`` (the ``read_new`` path, tensors adopted from the mmap).

A loader that returns is compared with the saved parameters (``ok`` or ``wrong``); one that raises
is ``refused`` (a ``CheckpointError``) or ``error`` (anything else). The child sends its outcomes
through a pipe; a child that dies by a signal or exits without sending is a ``crash``, one still
running after the time limit a ``hang`` (killed).

Every damage is real, or classified: the damaged file always differs from the original, and each
case says what the loaders may do (``Case.plain`` for ``load`` / ``new``, ``Case.verified`` for
``load_verify`` / ``verify``): ``refuse``; ``right`` (refuse, or load the right values: damage
that changes no tensor, such as a header flip that leaves the parsed header unchanged apart from
``__metadata__`` where nothing records the header bytes, or a well-formed wrong SHA-256 in the
index); or ``any`` (data flips without verify: only the SHA-256 check sees them, and the figures
count how many loaded wrong values).
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import shutil
import struct
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

INDEX = "model.safetensors.index.json"
LIMIT_S = 20.0  # per case; a healthy case takes well under a second

# Each variant's kinds (repeated to weigh them): its cases take them in turn. Case i damages VARIANTS[i % 10].
_HEADER = ["truncate", "header-flip", "header-shape", "header-dtype", "header-offsets"]
KINDS = {
    "cuboid": ["truncate", "header-flip", "data-flip", "header-flip", "truncate", "header-shape", "data-flip",
               "header-dtype", "header-offsets", "header-flip", "index-missing", "index-escape", "total-size",
               "index-json", "index-fields"],
    "foreign": _HEADER + ["index-missing", "index-escape", "index-json"],
    "single": _HEADER + ["data-flip", "header-flip", "data-flip"],
}
VARIANTS = ["cuboid", "cuboid", "foreign", "cuboid", "single", "cuboid", "cuboid", "foreign", "cuboid", "single"]
VERIFYING = ("load_verify", "verify")


@dataclass
class Case:
    """One damage: what was done, which names a refusal may give, and what each loader may do."""

    index: int
    variant: str
    kind: str
    file: str = ""
    detail: str = ""
    names: Tuple[str, ...] = ()
    plain: str = "refuse"  # what load / new may do: "refuse", "right" (or load the right values), "any"
    verified: str = "refuse"  # what load_verify / verify may do
    outcomes: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    status: str = ""  # "", "crash", "hang"
    seconds: float = 0.0

    @property
    def ops(self) -> Tuple[str, ...]:
        return ("load", "new") if self.variant == "foreign" else ("load", "load_verify", "verify", "new")

    def may(self, op: str) -> str:
        return self.verified if op in VERIFYING else self.plain

    def problems(self) -> List[str]:
        """Why this case fails the contract (empty: it passes)."""
        if self.status:
            return [f"{self.status}"]
        out = []
        for op in self.ops:
            what, text = self.outcomes.get(op, ("missing", ""))
            if what == "error":
                out.append(f"{op}: not a CheckpointError: {text}")
            elif what == "refused":
                if "\n" in text:
                    out.append(f"{op}: a multi-line error: {text!r}")
                if self.may(op) == "refuse" and not any(n in text for n in self.names):
                    out.append(f"{op}: the error names none of {self.names}: {text}")
            elif self.may(op) == "refuse" or (what == "wrong" and self.may(op) != "any"):
                out.append(f"{op}: {what}, not refused")
        return out

    def describe(self) -> str:
        return f"case {self.index} ({self.variant} {self.kind} {self.file}: {self.detail})"


# ----------------------------------------------------------------------------- damage


def split(raw: bytes) -> Tuple[int, dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def join(header: dict, data: bytes, pad_to: int) -> bytes:
    """A file from a header and data; the header padded to ``pad_to`` bytes when it fits (same size)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (pad_to - len(h) if len(h) <= pad_to else -len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _tensors(header: dict) -> List[str]:
    return [k for k in header if k != "__metadata__"]


def _without_meta(header: dict) -> dict:
    return {k: v for k, v in header.items() if k != "__metadata__"}


class Damage:
    """The generators: each damages the folder ``root`` for ``case`` with the random source ``rng``."""

    def __init__(self, root: Path, case: Case, rng: random.Random) -> None:
        self.root, self.case, self.rng = root, case, rng
        self.shards = sorted(p.name for p in root.glob("model*.safetensors"))

    def shard(self) -> Tuple[Path, bytes]:
        name = self.rng.choice(self.shards)
        self.case.file, self.case.names = name, (name,)
        return self.root / name, (self.root / name).read_bytes()

    def write(self, path: Path, old: bytes, new: bytes) -> None:
        assert new != old, self.case.describe()  # real damage: the bytes changed
        path.write_bytes(new)

    def index(self) -> dict:
        return json.loads((self.root / INDEX).read_text())

    def write_index(self, index, text: Optional[bytes] = None) -> None:
        self.case.file = INDEX
        self.case.names = self.case.names or (INDEX,)
        path = self.root / INDEX
        old = path.read_bytes()
        self.write(path, old, text if text is not None else json.dumps(index, indent=2).encode())

    # -- shard files

    def truncate(self) -> None:
        path, raw = self.shard()
        n = split(raw)[0]
        lo, hi = self.rng.choice([(0, 8), (8, 8 + n), (8 + n, len(raw))])
        cut = self.rng.randrange(lo, hi)
        self.case.detail = f"cut to {cut} of {len(raw)} bytes"
        self.write(path, raw, raw[:cut])

    def header_flip(self) -> None:
        path, raw = self.shard()
        n, header, _ = split(raw)
        at = self.rng.randrange(0, 8 + n)
        # a random byte, one flipped bit, or an ASCII-preserving change (the JSON still decodes as text)
        mask = self.rng.choice([self.rng.randrange(1, 256), 1 << self.rng.randrange(8), self.rng.randrange(1, 128)])
        new = bytearray(raw)
        new[at] ^= mask
        self.case.detail = f"byte {at} ^= {mask:#04x}"
        try:
            n2, h2, _ = split(bytes(new))
            same = n2 == n and _without_meta(h2) == _without_meta(header)
        except (ValueError, UnicodeDecodeError):
            same = False
        if same and self.case.variant != "cuboid":  # a cuboid index records the shard's header SHA-256
            self.case.plain = "right"  # a single file's own record may be what the flip hit (its data hash)
        self.write(path, raw, bytes(new))

    def data_flip(self) -> None:
        path, raw = self.shard()
        n = split(raw)[0]
        at, mask = self.rng.randrange(8 + n, len(raw)), self.rng.randrange(1, 256)
        new = bytearray(raw)
        new[at] ^= mask
        self.case.detail = f"data byte {at} ^= {mask:#04x}"
        self.case.plain = "any"
        self.write(path, raw, bytes(new))

    def _edit_header(self, edit: Callable[[dict, str], str]) -> None:
        path, raw = self.shard()
        n, header, data = split(raw)
        name = self.rng.choice(_tensors(header))
        self.case.detail = f"{name}: " + edit(header, name)
        self.case.names += (name,)
        self.write(path, raw, join(header, data, n))

    def header_shape(self) -> None:
        def edit(header, name):
            shape = header[name]["shape"]
            numel = math.prod(shape)
            same = [s for s in ([*reversed(shape)], [numel], [*shape, 1], [1, *shape]) if s != shape]
            new = self.rng.choice(same) if self.rng.random() < 0.6 else [
                max(0, s + self.rng.choice([-1, 1, 7])) for s in shape]
            if new == shape:
                new = [*shape, 2]
            header[name]["shape"] = new
            return f"shape {shape} -> {new}"

        self._edit_header(edit)

    def header_dtype(self) -> None:
        def edit(header, name):
            new = self.rng.choice(["I32", "U32", "F16", "BF16", "F64", "I8", "BOOL", "F31", "f32", "", 32, None])
            header[name]["dtype"] = new
            return f"dtype F32 -> {new!r}"

        self._edit_header(edit)

    def header_offsets(self) -> None:
        def edit(header, name):
            b, e = header[name]["data_offsets"]
            same = [k for k in _tensors(header) if k != name and header[k]["data_offsets"][1]
                    - header[k]["data_offsets"][0] == e - b]
            choices = ["end+", "end-", "begin+", "reversed", "beyond", "string", "one", "null", "negative", "huge",
                       "float", "overlap"]
            if same and self.case.variant == "cuboid":  # a valid file with other values: only records see it
                choices.append("swap")
            how = self.rng.choice(choices)
            k = self.rng.randrange(1, 9)
            new = {"end+": [b, e + k], "end-": [b, e - k], "begin+": [b + k, e], "reversed": [e, b],
                   "beyond": [b + (1 << 20), e + (1 << 20)], "string": [b, str(e)], "one": [b], "null": None,
                   "negative": [b - e - 8, -8], "huge": [b, 2 ** 64 + e], "float": [float(b), e + 0.5],
                   "overlap": [0, e - b]}.get(how)
            if how == "overlap" and b == 0:
                new = [e, 2 * e - b] if len(_tensors(header)) > 1 else [b, e + 4]
            if how == "swap":
                other = self.rng.choice(same)
                header[name]["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], [b, e]
                return f"offsets swapped with {other}"
            header[name]["data_offsets"] = new
            return f"offsets [{b}, {e}] -> {new} ({how})"

        self._edit_header(edit)

    # -- the index

    def index_missing(self) -> None:
        index = self.index()
        wm = index["weight_map"]
        name = self.rng.choice(sorted(wm))
        how = self.rng.choice(["absent-file", "deleted", "dropped-entry", "other-shard", "long-name", "nul"])
        if how == "deleted":
            gone = self.rng.choice(self.shards)
            (self.root / gone).unlink()
            self.case.file, self.case.names, self.case.detail = gone, (gone,), f"{gone} deleted"
            return
        if how == "dropped-entry":
            del wm[name]
        elif how == "other-shard":
            wm[name] = self.rng.choice([s for s in self.shards if s != wm[name]])
        else:
            wm[name] = {"absent-file": "model-00011-of-00010.safetensors", "long-name": "m" * 300 + ".safetensors",
                        "nul": "model\0.safetensors"}[how]
        self.case.names = (INDEX, name, str(wm.get(name, name))[:60])
        self.case.detail = f"{how}: {name} -> {wm.get(name, '(no entry)')!r}"[:120]
        self.write_index(index)

    def index_escape(self) -> None:
        index = self.index()
        wm = index["weight_map"]
        name = self.rng.choice(sorted(wm))
        shard = wm[name]
        evil = self.rng.choice([f"../{shard}", "../x.safetensors", "/etc/passwd", str(self.root / shard),
                                f"sub/{shard}", "", ".", "..", f"x\\..\\{shard}", f"~/{shard}",
                                f"../{self.root.name}/{shard}"])
        wm[name] = evil
        self.case.detail = f"{name} -> {evil!r}"
        self.write_index(index)

    def total_size(self) -> None:
        index = self.index()
        n = index["metadata"]["total_size"]
        new = self.rng.choice([n + self.rng.randrange(1, 9), n - self.rng.randrange(1, 9), 0, -1, str(n),
                               n + 0.5, None, n * 2, "absent"])
        if new == "absent":
            del index["metadata"]["total_size"]
        else:
            index["metadata"]["total_size"] = new
        self.case.detail = f"total_size {n} -> {new!r}"
        self.write_index(index)

    def index_json(self) -> None:
        text = (self.root / INDEX).read_bytes()
        how = self.rng.choice(["cut", "structure", "not-utf8", "empty", "not-object", "no-weight-map"])
        if how == "cut":
            cut = self.rng.randrange(0, text.rindex(b"}"))
            new = text[:cut]
        elif how == "structure":
            while True:  # a byte of the JSON syntax replaced so that the text no longer parses
                at = self.rng.choice([i for i, c in enumerate(text) if c in b'{}[]:,"'])
                new = text[:at] + bytes([self.rng.randrange(32, 127)]) + text[at + 1:]
                try:
                    json.loads(new)
                except ValueError:
                    break
        elif how == "not-utf8":
            at = self.rng.choice([i for i, c in enumerate(text) if c == ord("_")])
            new = text[:at] + bytes([self.rng.randrange(0x80, 0x100)]) + text[at + 1:]
        elif how == "empty":
            new = b""
        elif how == "not-object":
            new = self.rng.choice([b"[]", b"null", b"5", b'"model"', b"true"])
        else:
            new = json.dumps({"metadata": self.index()["metadata"]}).encode()
        self.case.detail = how
        self.write_index(None, new)

    def index_fields(self) -> None:
        """Valid JSON with a field of the wrong type or an emptied map."""
        index = self.index()
        md, wm = index["metadata"], index["weight_map"]
        shard = self.rng.choice(self.shards)
        how = self.rng.choice(["metadata", "files", "record", "size", "sha256", "weight_map", "value",
                               "empty-map", "unrecorded-shard"])
        if how == "metadata":
            index["metadata"] = self.rng.choice([5, "x", [1]])
        elif how == "files":
            md["files"] = self.rng.choice([5, "x", [shard]])
        elif how == "record":
            md["files"][shard] = self.rng.choice([5, "x", None, [1, 2]])
        elif how == "size":
            md["files"][shard]["size"] = self.rng.choice([str(md["files"][shard]["size"]), None, -1, 1.5])
        elif how == "sha256":
            md["files"][shard]["sha256"] = self.rng.choice([5, None, "0" * 64])
        elif how == "weight_map":
            index["weight_map"] = self.rng.choice([5, "x", [shard], None])
        elif how == "value":
            wm[self.rng.choice(sorted(wm))] = self.rng.choice([5, None, [shard], {"file": shard}])
        elif how == "empty-map":
            index["weight_map"] = {}
        else:  # the shard's tensors listed in no weight_map entry: its records and file still there
            for k in [k for k, v in wm.items() if v == shard]:
                del wm[k]
        self.case.detail = how
        self.case.names = (INDEX, shard) if how in ("record", "size", "sha256", "unrecorded-shard") else (INDEX,)
        if how == "empty-map":  # refused by the first recorded shard whose tensors the index no longer lists
            self.case.names += tuple(self.shards)
        if how == "sha256" and isinstance(md["files"][shard]["sha256"], str):
            self.case.plain = "right"  # a well-formed wrong hash: only the check that reads it sees it
        self.write_index(index)


def make_case(pristine: Dict[str, Path], root: Path, i: int, seed: int) -> Case:
    """Case ``i``: a copy of the variant's pristine folder at ``root``, damaged."""
    variant = VARIANTS[i % len(VARIANTS)]
    kinds = KINDS[variant]
    nth = i // len(VARIANTS) * VARIANTS.count(variant) + VARIANTS[:i % len(VARIANTS)].count(variant)
    case = Case(i, variant, kinds[nth % len(kinds)])
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(pristine[variant], root)
    getattr(Damage(root, case, random.Random(seed * 1_000_003 + i)), case.kind.replace("-", "_"))()
    return case


# ---------------------------------------------------------------------------- running


def make_pristine(tmp: Path) -> Tuple[Dict[str, Path], Dict[str, torch.Tensor]]:
    """The pristine folders of the variants and the parameters they hold."""
    import cuboid
    from cuboid.zoo import checkpoint

    model = cuboid.load("gpt-debug", seed=0)
    path = checkpoint.save(model, tmp / "cuboid", max_shard_size="60KB")
    foreign = tmp / "foreign"
    shutil.copytree(path, foreign)
    index = json.loads((path / INDEX).read_text())
    (foreign / INDEX).write_text(json.dumps({"metadata": {"total_size": index["metadata"]["total_size"]},
                                             "weight_map": index["weight_map"]}, indent=2))
    single = checkpoint.save(model, tmp / "single")
    assert (single / "model.safetensors").is_file() and not (single / INDEX).exists()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"cuboid": path, "foreign": foreign, "single": single}, params


def _same(model: torch.nn.Module, expected: Dict[str, torch.Tensor]) -> bool:
    got = dict(model.named_parameters())
    return got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())


def _child(conn, case: Case, path: Path, model: torch.nn.Module, expected: Dict[str, torch.Tensor]) -> None:
    import cuboid
    from cuboid.zoo import checkpoint
    from cuboid.zoo.checkpoint import CheckpointError

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    def into(verify: bool):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        checkpoint.load(model, path, verify=verify)
        return model

    ops = {"load": lambda: into(False), "load_verify": lambda: into(True),
           "verify": lambda: checkpoint.verify(path), "new": lambda: cuboid.load(str(path))}
    out = {}
    for op in case.ops:
        try:
            got = ops[op]()
            out[op] = ("ok", "") if not isinstance(got, torch.nn.Module) or _same(got, expected) else ("wrong", "")
        except CheckpointError as e:
            out[op] = ("refused", str(e))
        except BaseException as e:  # noqa: BLE001 - pyo3 panics are BaseExceptions: they are what we look for
            out[op] = ("error", f"{type(e).__name__}: {e}")
    conn.send(out)
    conn.close()


def run_case(case: Case, path: Path, model, expected, limit: float = LIMIT_S, child: Callable = None) -> Case:
    """Load ``path`` in a forked child; fill ``case.outcomes`` or ``case.status`` and ``case.seconds``.

    ``child`` replaces the loading child (the tests give it one that crashes or sleeps).
    """
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    proc = ctx.Process(target=child or _child, args=(send, case, path, model, expected), daemon=True)
    proc.start()
    send.close()
    got = recv.poll(limit)
    if got:
        try:
            case.outcomes = recv.recv()
        except EOFError:  # the child died without sending
            got = False
    proc.join(limit if got else 0.5)
    case.seconds = time.perf_counter() - t0
    if proc.is_alive():
        proc.kill()
        proc.join()
        case.status = "hang"
    elif proc.exitcode != 0 or not got:
        case.status = "crash"
        case.detail += f" (exit code {proc.exitcode})"
    recv.close()
    return case


def run(n: int, seed: int, tmp: Path, limit: float = LIMIT_S) -> List[Case]:
    import cuboid
    from cuboid.kernels import use_backend

    pristine, expected = make_pristine(tmp)
    model = cuboid.load("gpt-debug", seed=1)  # the loaders' target: overwritten (NaN first) in each child
    cases = []
    with use_backend("torch"):
        for i in range(n):
            root = tmp / "case"
            case = make_case(pristine, root, i, seed)
            cases.append(run_case(case, root, model, expected, limit))
    shutil.rmtree(tmp / "case", ignore_errors=True)
    return cases


def table(cases: List[Case]) -> str:
    """Outcomes by variant and kind (markdown): refusals by the plain and the verifying loaders."""
    rows = ["| variant | kind | cases | may load right values | refused without verify | refused with verify "
            "| loaded wrong without verify | other errors | crashes | hangs | slowest s |", "|" + "---|" * 11]
    groups: Dict[Tuple[str, str], List[Case]] = {}
    for c in sorted(cases, key=lambda c: (VARIANTS.index(c.variant), KINDS[c.variant].index(c.kind))):
        groups.setdefault((c.variant, c.kind), []).append(c)
    groups[("all", "all")] = cases
    for (variant, kind), cs in groups.items():
        def count(ops, what="refused", every=True) -> int:
            test = all if every else any
            return sum(1 for c in cs if not c.status and any(o in c.ops for o in ops)
                       and test(c.outcomes[o][0] == what for o in ops if o in c.ops))

        verified = "-" if variant == "foreign" else count(VERIFYING)
        rows.append(f"| {variant} | {kind} | {len(cs)} | {sum(c.plain == 'right' for c in cs)} | "
                    f"{count(('load', 'new'))} | {verified} | {count(('load', 'new'), 'wrong', False)} | "
                    f"{count(('load', 'new') + VERIFYING, 'error', False)} | "
                    f"{sum(c.status == 'crash' for c in cs)} | {sum(c.status == 'hang' for c in cs)} | "
                    f"{max(c.seconds for c in cs):.2f} |")
    return "\n".join(rows)


def examples(cases: List[Case]) -> Dict[str, str]:
    """One refusal message per kind: the plain load's, or the verifying load's for data flips."""
    out: Dict[str, str] = {}
    for c in cases:
        op = "load" if c.plain == "refuse" else "load_verify"
        if c.outcomes.get(op, ("",))[0] == "refused":
            out.setdefault(f"{c.variant} {c.kind}", c.outcomes[op][1])
    return out


def main(argv: List[str]) -> None:
    import tempfile

    n = int(argv[0]) if argv else 200
    seed = int(argv[1]) if len(argv) > 1 else 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cases = run(n, seed, Path(tmp))
    print(table(cases))
    slowest = max(cases, key=lambda c: c.seconds)
    print(f"\n{n} cases in {time.perf_counter() - t0:.1f} s; slowest {slowest.seconds:.2f} s: {slowest.describe()}")
    for c in cases:
        for problem in c.problems():
            print(f"FAIL {c.describe()}: {problem}")
    print("\nexample errors:")
    for kind, text in examples(cases).items():
        print(f"  {kind}: {text}")


if __name__ == "__main__":
    main(sys.argv[1:])
