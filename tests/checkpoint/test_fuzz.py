"""Damaged checkpoints are refused: 200 seeded corruptions, each loaded in a forked child with a time limit.

The generator and the child live in :mod:`tests.checkpoint.fuzz` (its docstring lists the kinds and
what each loader may do). Every case must end in a one-line ``CheckpointError`` naming the damaged
file (or the index, or the tensor the index got wrong) from every loader; data flips from the
verifying ones (``verify``, ``load(..., verify=True)``); no child may crash (a signal, a non-zero
exit without an outcome), hang past the limit, or raise anything but a ``CheckpointError``.
The harness's own crash and hang detection is tested first, with children that do exactly that.
"""
import faulthandler
import hashlib
import json
import os
import shutil
import signal
import struct
import time
from collections import Counter

import pytest
import torch

import cuboid
from cuboid.zoo import checkpoint
from cuboid.zoo.checkpoint import CheckpointError

from . import fuzz

N_CASES = 200


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return fuzz.make_pristine(tmp_path_factory.mktemp("pristine"))


def _segfault(conn, *args):
    faulthandler.disable()  # pytest's handler would print the child's stack: the crash is the point here
    os.kill(os.getpid(), signal.SIGSEGV)


def _sleep(conn, *args):
    time.sleep(60)


def _exit_silently(conn, *args):
    os._exit(0)


@pytest.mark.parametrize("child, status", [(_segfault, "crash"), (_exit_silently, "crash"), (_sleep, "hang")])
def test_the_harness_sees_crashes_and_hangs(pristine, child, status):
    folders, expected = pristine
    case = fuzz.Case(0, "cuboid", "none")
    t0 = time.perf_counter()
    fuzz.run_case(case, folders["cuboid"], None, expected, limit=1.0, child=child)
    assert case.status == status and case.problems() == [status]
    assert time.perf_counter() - t0 < 10


def test_an_undamaged_folder_loads_in_the_child(pristine):
    """The control: the pristine folders load the saved values through every loader."""
    folders, expected = pristine
    model = cuboid.load("gpt-debug", seed=1)
    for variant in fuzz.KINDS:
        case = fuzz.run_case(fuzz.Case(0, variant, "none"), folders[variant], model, expected)
        assert case.status == "" and case.outcomes == {op: ("ok", "") for op in case.ops}, case.outcomes


def _swap_offsets(path):
    """Swap the data of two equal-size tensors in the header: a valid file with other values."""
    a, b = "transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"
    wm = json.loads((path / fuzz.INDEX).read_text())["weight_map"]
    assert wm[a] == wm[b]
    shard = path / wm[a]
    n, header, data = fuzz.split(shard.read_bytes())
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    shard.write_bytes(fuzz.join(header, data, n))
    return shard


def test_a_rewritten_header_is_refused_by_its_recorded_hash(pristine, tmp_path):
    """Offsets swapped between two tensors of one size parse as a valid file: only the record sees it."""
    folders, _ = pristine
    for variant in ("cuboid", "foreign"):
        shutil.copytree(folders[variant], tmp_path / variant)
        shard = _swap_offsets(tmp_path / variant)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: safetensors header SHA-256 mismatch"):
        checkpoint.load(cuboid.load("gpt-debug", seed=1), tmp_path / "cuboid")
    model = cuboid.load("gpt-debug", seed=1)  # a transformers folder records nothing: it loads what it says
    checkpoint.load(model, tmp_path / "foreign")
    assert torch.equal(model.blocks[0].ln1.weight, cuboid.load("gpt-debug").blocks[0].ln1.bias)


def test_the_index_records_header_hashes(pristine):
    folders, _ = pristine
    index = json.loads((folders["cuboid"] / fuzz.INDEX).read_text())
    for name, rec in index["metadata"]["files"].items():
        if name.endswith(".safetensors"):
            raw = (folders["cuboid"] / name).read_bytes()
            (n,) = struct.unpack("<Q", raw[:8])
            assert rec["header_sha256"] == hashlib.sha256(raw[:8 + n]).hexdigest()
        else:
            assert "header_sha256" not in rec


def test_fuzz(tmp_path):
    t0 = time.perf_counter()
    cases = fuzz.run(N_CASES, seed=0, tmp=tmp_path)
    print(f"\n{fuzz.table(cases)}\n{N_CASES} cases in {time.perf_counter() - t0:.1f} s")
    failures = [f"{c.describe()}: {p}" for c in cases for p in c.problems()]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])

    kinds = Counter((c.variant, c.kind) for c in cases)
    assert set(kinds) == {(v, k) for v, ks in fuzz.KINDS.items() for k in ks}, kinds  # every kind ran
    assert min(kinds.values()) >= 5, kinds
    # honest classification: damage that changes no tensor may load, only with the right values
    lenient = [c for c in cases if c.plain == "right"]
    assert all((c.kind == "header-flip" and c.variant != "cuboid") or (c.kind, c.detail) == ("index-fields", "sha256")
               for c in lenient), [c.describe() for c in lenient]
    assert all(c.outcomes[op][0] in ("ok", "refused") for c in lenient for op in c.ops)
    # data flips: refused when verifying; without verify they load (the figures), never crash
    assert not [c for c in cases if c.plain == "any" and c.kind != "data-flip"]
    flips = [c for c in cases if c.kind == "data-flip"]
    assert flips and all(c.outcomes[op][0] == "refused" and "SHA-256 mismatch" in c.outcomes[op][1]
                         for c in flips for op in ("load_verify", "verify"))
    assert max(c.seconds for c in cases) < fuzz.LIMIT_S


def test_files_written_before_header_hashes_still_load(pristine, tmp_path):
    """Records without header_sha256 (cuboid before it; version 1 for a single file) are read as before."""
    folders, expected = pristine
    old = {"cuboid": tmp_path / "cuboid", "single": tmp_path / "single"}
    shutil.copytree(folders["cuboid"], old["cuboid"])
    index = json.loads((old["cuboid"] / fuzz.INDEX).read_text())
    for rec in index["metadata"]["files"].values():
        rec.pop("header_sha256", None)
    (old["cuboid"] / fuzz.INDEX).write_text(json.dumps(index))
    shutil.copytree(folders["single"], old["single"])
    f = old["single"] / "model.safetensors"
    n, header, data = fuzz.split(f.read_bytes())
    record = json.loads(header["__metadata__"]["cuboid"])
    record["version"] = 1
    del record["header_sha256"]
    header["__metadata__"]["cuboid"] = json.dumps(record)
    f.write_bytes(fuzz.join(header, data, n))
    for path in old.values():
        assert checkpoint.verify(path)["tensors"] == len(index["weight_map"])
        model = cuboid.load("gpt-debug", seed=1)
        checkpoint.load(model, path, verify=True)
        assert all(torch.equal(p, expected[name]) for name, p in model.named_parameters())
    record["version"] = 2  # a version-2 record that lost its header hash is damage
    header["__metadata__"]["cuboid"] = json.dumps(record)
    f.write_bytes(fuzz.join(header, data, n))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the 'cuboid' record .* has no header SHA-256"):
        checkpoint.load(cuboid.load("gpt-debug", seed=1), old["single"])


# ------------------------------------------------------------------ LoRA training checkpoints

N_LORA_CASES = 40
LORA_DAMAGES = ("flip", "flip", "truncate", "remove", "flip-commit", "append")


@pytest.fixture(scope="module")
def lora_pristine(tmp_path_factory):
    """A gpt-debug LoRA run's checkpoint after one optimizer step (so the optimizer state holds tensors)."""
    from cuboid.kernels import use_backend
    from cuboid.zoo import lora

    model = cuboid.load("gpt-debug", seed=1, lora="r=4,alpha=8")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    with use_backend("torch"):
        model(input_ids=torch.arange(16).reshape(2, 8)).logits.float().pow(2).mean().backward()
    opt.step()
    path = tmp_path_factory.mktemp("lora") / "checkpoint-1"
    lora.save_checkpoint(model, path, optimizer=opt, state={"step": 1})
    return path


def _send_outcome(conn, key: str, load) -> None:
    """Run ``load()`` in the child and send its outcome under ``key``: loaded, refused (a CheckpointError) or
    an error of another kind (a finding)."""
    torch.set_num_threads(1)
    try:
        load()
        out = ("loaded", "")
    except CheckpointError as e:
        out = ("refused", str(e))
    except BaseException as e:  # noqa: BLE001 - anything else is a finding
        out = ("error", f"{type(e).__name__}: {e}")
    conn.send({key: out})
    conn.close()


def _lora_child(conn, case, path, model, expected):
    """Resume the damaged LoRA checkpoint as the trainer does (verified, then read): its outcome."""
    from cuboid.zoo import lora

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _send_outcome(conn, "lora", lambda: lora.load_checkpoint(model, path, optimizer=opt))


def _damage_lora(path, rng, kind, commit, keep_commit=False):
    """One seeded damage to a copy of the folder whose commit file is ``commit`` (``keep_commit``: a removal
    spares it); the file it hit."""
    files = sorted(p.name for p in path.iterdir() if not (keep_commit and kind == "remove" and p.name == commit))
    name = commit if kind == "flip-commit" else rng.choice(files)
    file = path / name
    raw = bytearray(file.read_bytes())
    if kind in ("flip", "flip-commit"):
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        raw = raw[:rng.randrange(len(raw))]
    elif kind == "append":
        raw += b"\0"
    if kind == "remove":
        file.unlink()
    else:
        file.write_bytes(bytes(raw))
    return name


def _every_damage_refused(pristine, tmp_path, cases: int, seed: int, commit: str, key: str, model, child,
                          keep_commit: bool = False) -> Counter:
    """``cases`` seeded damages (:data:`LORA_DAMAGES` in turn) of copies of ``pristine``, each loaded by ``child``
    in a forked process: the undamaged folder loads, every damaged one is refused in one line (no crash, no
    hang). Returns how often each file was hit."""
    import random

    control = fuzz.run_case(fuzz.Case(0, key, "none"), pristine, model, None, child=child)
    assert control.status == "" and control.outcomes[key][0] == "loaded", control.outcomes
    rng = random.Random(seed)
    hit = Counter()
    for i in range(cases):
        root = tmp_path / f"case{i}"
        shutil.copytree(pristine, root)
        kind = LORA_DAMAGES[i % len(LORA_DAMAGES)]
        name = _damage_lora(root, rng, kind, commit, keep_commit)
        hit[name] += 1
        case = fuzz.run_case(fuzz.Case(i, key, kind), root, model, None, child=child)
        assert case.status == "", (kind, name, case.status, case.detail)
        outcome, message = case.outcomes[key]
        assert outcome == "refused" and "\n" not in message, (kind, name, case.outcomes)
        shutil.rmtree(root)
    return hit


def test_every_damaged_lora_checkpoint_is_refused(lora_pristine, tmp_path):
    """Seeded flips, cuts, removals and appended bytes in every file of a LoRA checkpoint (the commit record
    too): each resume is refused with a CheckpointError in a forked child, none loads, crashes or hangs."""
    from cuboid.zoo.checkpoint.format import LORA_COMMIT

    model = cuboid.load("gpt-debug", seed=1, lora="r=4,alpha=8")
    hit = _every_damage_refused(lora_pristine, tmp_path, N_LORA_CASES, 39, LORA_COMMIT, "lora", model, _lora_child)
    assert len(hit) >= 5, hit  # the damage reached most of the checkpoint's files


def _adapters_child(conn, case, path, model, expected):
    """Load the damaged adapter folder onto a fresh base as ``cuboid.load(..., lora=folder)`` does: its outcome."""
    _send_outcome(conn, "adapters", lambda: cuboid.load("gpt-debug", seed=1, lora=str(path)))


N_ADAPTER_CASES = 24


def test_every_damaged_lora_adapter_folder_is_refused(tmp_path):
    """A LoRA run's final/ (adapters and tokenizer under lora-adapters.json): seeded flips, cuts, removals and
    appended bytes in any file but the removal of the record itself (then it is a peft folder from elsewhere,
    read as data) are refused with a CheckpointError in a forked child; none loads, crashes or hangs."""
    from cuboid.zoo import lora
    from cuboid.zoo.checkpoint.format import ADAPTERS_COMMIT

    from ..front import fixtures as F

    model = cuboid.load("gpt-debug", seed=1, lora="r=4,alpha=8")
    pristine = lora.save_adapters(model, tmp_path / "final", tokenizer=F.bpe_tokenizer(tmp_path / "tok"))
    hit = _every_damage_refused(pristine, tmp_path, N_ADAPTER_CASES, 37, ADAPTERS_COMMIT, "adapters", None,
                                _adapters_child, keep_commit=True)
    assert len(hit) >= 4, hit  # the damage reached most of the folder's files
