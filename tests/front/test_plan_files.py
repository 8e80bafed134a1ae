"""Plan files and plan sizes at the door (issue 39, case 7): one-line errors, never a traceback.

The issue's cases first (a JSON plan of ``[1,2]``, a TOML ``plan = "dp=2"``, ``--plan dp=100000``), then
a seeded fuzz of plan files (the checkpoint fuzz's :class:`tests.checkpoint.fuzz.Case` records): each
damaged file is parsed under a time limit and must end in a one-line ``ValueError`` that names the
file, or, where the damage may leave a valid plan (a flipped byte, a TOML file cut at a line end), in
that plan. No other exception, no hang.
"""
import json
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from cuboid.cli import main
from cuboid.loading.model import LOCAL_PROCESSES_ENV, check_local_processes, local_process_limit, plan_of
from cuboid.parallel import Plan

from ..checkpoint import fuzz

N_CASES = 400
PLAN = Plan(dp=2, pp=2, tp=2, microbatches=4, schedule="interleaved", stage_blocks=(1, 0, 1, 0), checkpoint="full")


def _write(tmp_path: Path, name: str, text) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("name, text, sentence", [
    ("p.json", "[1,2]", r"p\.json: a plan is a table of fields \(dp, pp, .*\), not a list$"),
    ("p.toml", 'plan = "dp=2"', r"p\.toml: 'plan' must be a \[plan\] table of fields, not a string \(a plan file "
                                r"holds plan fields \(dp, pp, .*\): a JSON object, or TOML keys at the top level or "
                                r"in a \[plan\] table, e\.g\. dp = 2\)$"),
    ("p.json", "[" * 50_000, r"p\.json: not valid JSON \(nested too deeply to read\)$"),
    ("p.toml", "x = " + "[" * 50_000, r"p\.toml: not valid TOML \(nested too deeply to read\)$"),
    ("p.json", '{"dp": 2, "tensor": 2}', r"p\.json: unknown plan field\(s\) tensor; known: "),
    ("p.json", '{"stage_blocks": 3}', r"p\.json: plan field stage_blocks takes block counts"),
    ("p.toml", "dp = 2\n[plan]\ntp = 2\n", r"p\.toml: keys dp beside the \[plan\] table"),
    ("p.json", b'{"dp": 2\xff}', r"p\.json: not UTF-8 text"),
])
def test_a_bad_plan_file_is_one_sentence(tmp_path, name, text, sentence):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError, match=sentence) as info:
        plan_of(str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_plan_files_round_trip(tmp_path):
    for name, text in (("a.json", PLAN.to_json()), ("a.toml", PLAN.to_toml()),
                       ("b.toml", "[plan]\n" + PLAN.to_toml())):
        assert plan_of(str(_write(tmp_path, name, text))) == PLAN


def test_the_command_line_says_it_in_one_line(tmp_path, capsys):
    path = _write(tmp_path, "p.toml", 'plan = "dp=2"')
    assert main(["finetune", "--plan", str(path), "--model", "gpt-debug", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cuboid finetune: error: plan file ") and "[plan] table" in err


def test_a_plan_past_the_machine_is_refused(monkeypatch):
    """dp=100000 would start 100,000 local processes: the bound (8 per GPU, or per core) says so first."""
    monkeypatch.delenv(LOCAL_PROCESSES_ENV, raising=False)
    limit = local_process_limit()
    assert limit >= 8
    check_local_processes(limit)
    with pytest.raises(ValueError, match=rf"plan dp=100000 needs 100000 processes, more than this machine's "
                                         rf"limit of {limit} .*set {LOCAL_PROCESSES_ENV}=100000 to start them"):
        check_local_processes(100000, Plan(dp=100000))
    monkeypatch.setenv(LOCAL_PROCESSES_ENV, "100000")
    check_local_processes(100000, Plan(dp=100000))
    monkeypatch.setenv(LOCAL_PROCESSES_ENV, "lots")
    with pytest.raises(ValueError, match=rf"{LOCAL_PROCESSES_ENV}='lots': give a whole number"):
        local_process_limit()


# ------------------------------------------------------------------------------------ the fuzz


def _damage(rng: random.Random, case: fuzz.Case) -> bytes:
    """A damaged plan file (JSON or TOML, by ``case.variant``) for ``case.kind``; ``case.plain`` says
    whether the damage may leave a valid plan ("right") or must be refused ("refuse")."""
    toml = case.variant == "toml"
    good = PLAN.to_toml() if toml else PLAN.to_json()
    data = PLAN.to_dict()
    field = rng.choice(sorted(data))
    if case.kind == "flip":  # a random byte changed: a parser error, or another plan, never a traceback
        raw = bytearray(good.encode())
        raw[rng.randrange(len(raw))] ^= rng.choice([1 << rng.randrange(8), rng.randrange(1, 256)])
        case.plain = "right"
        return bytes(raw)
    if case.kind == "truncate":
        cut = rng.randrange(0, len(good) - 2)
        case.plain = "right" if toml else "refuse"  # a TOML file cut at a line end is a shorter, valid plan
        return good[:cut].encode()
    if case.kind == "value":  # a field of the wrong type or out of range (never one that makes a valid plan)
        while True:
            bad = rng.choice([None, "2", -1, 0, 1.5, [], {}, "x", True, 10 ** 30, [1, "a"], {"a": 1}, "2/x"])
            try:
                Plan(**dict(data, **{field: bad}))
            except (ValueError, TypeError):
                break
            field = rng.choice(sorted(data))
        data[field] = bad
        case.detail = f"{field} = {bad!r}"
    elif case.kind == "shape":  # the right fields in the wrong container
        shaped = rng.choice(["list", "string", "number", "nested", "plan-string", "plan-list", "beside"])
        case.detail = shaped
        value = {"list": [data], "string": "dp=2", "number": 5, "nested": {"plan": {"plan": data}},
                 "plan-string": {"plan": "dp=2"}, "plan-list": {"plan": [1, 2]},
                 "beside": {"plan": data, "dp": 2}}[shaped]
        if toml and not isinstance(value, dict):  # TOML's top level is a table: these become its one key
            value = {"plan": value}
        return _encode(value, toml)
    elif case.kind == "unknown":
        data[rng.choice(["tensor", "Dp", "zero_stage", "activation_checkpointing", ""])] = 2
    elif case.kind == "deep":
        depth = rng.choice([2_000, 50_000, 200_000])
        return ("x = " + "[" * depth if toml else "[" * depth + "]" * depth).encode()
    elif case.kind == "encoding":
        raw = good.encode()
        at = rng.randrange(len(raw))
        return raw[:at] + bytes([rng.randrange(0x80, 0x100)]) + raw[at + 1:]
    return _encode(data, toml)


def _encode(value, toml: bool) -> bytes:
    return (_toml(value) if toml else json.dumps(value)).encode()


def _toml(table: dict, prefix: str = "") -> str:
    """``table`` as TOML: its plain keys, then each sub-table under its dotted header."""
    lines = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += [f"[{prefix}{json.dumps(k)}]", _toml(v, f"{prefix}{json.dumps(k)}.")]
    return "\n".join(lines)


def _toml_value(v) -> str:
    if v is None:
        return '"null"'  # TOML has no null: the string, which is no plan value either
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(list(v) if isinstance(v, tuple) else v)  # JSON strings, numbers and lists are TOML


KINDS = ["flip", "truncate", "value", "shape", "unknown", "deep", "encoding", "value", "flip", "shape"]


def _parse_bounded(case: fuzz.Case, path: Path, limit: float = 5.0) -> fuzz.Case:
    """``plan_of(path)`` under a time limit (SIGALRM: plan parsing is pure Python, so a hang is a loop the
    alarm interrupts); fills ``case.outcomes["parse"]``, or ``case.status = "hang"``."""
    def alarm(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    t0 = time.perf_counter()
    try:
        out = ("ok", plan_of(str(path)).describe())
    except TimeoutError:
        case.status, out = "hang", ("hang", "")
    except ValueError as e:
        out = ("refused", str(e))
    except BaseException as e:  # noqa: BLE001 - anything else is what the fuzz looks for
        out = ("error", f"{type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    case.outcomes, case.seconds = {"parse": out}, time.perf_counter() - t0
    return case


def test_plan_file_fuzz(tmp_path):
    t0 = time.perf_counter()
    rng = random.Random(0)
    cases = []
    for i in range(N_CASES):
        case = fuzz.Case(i, "toml" if i % 2 else "json", KINDS[(i // 2) % len(KINDS)])
        path = tmp_path / f"case{i}.{case.variant}"
        path.write_bytes(_damage(rng, case))
        cases.append(_parse_bounded(case, path))
    failures = []
    for c in cases:
        what, text = c.outcomes.get("parse", ("missing", ""))
        path = str(tmp_path / f"case{c.index}.{c.variant}")
        if c.status:
            failures.append(f"{c.describe()}: {c.status}")
        elif what == "error":
            failures.append(f"{c.describe()}: not a ValueError: {text}")
        elif what == "refused" and ("\n" in text or path not in text):
            failures.append(f"{c.describe()}: not one line naming the file: {text!r}")
        elif what == "ok" and c.plain != "right":
            failures.append(f"{c.describe()}: loaded as {text}")
    assert not failures, "\n".join(failures[:20])
    kinds = Counter((c.variant, c.kind) for c in cases)
    assert set(kinds) == {(v, k) for v in ("json", "toml") for k in KINDS}
    refused = sum(c.outcomes["parse"][0] == "refused" for c in cases)
    assert refused >= 0.8 * N_CASES, refused  # most damage is refused; flips may leave a valid plan
    assert time.perf_counter() - t0 < 30
