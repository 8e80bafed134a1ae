"""The quick tier, ``python -m pytest -q -m "not slow"`` (tests/conftest.py's SLOW rules say what it leaves out):
it still touches every package, and every rule still marks a test.

One collection of the whole suite in a subprocess (about 20 s: it imports every test module), as a contributor's
run makes it, with the conftest's report of what each SLOW pattern matched.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# where each package's tests live; top-level files for the ones without a folder (compile, imports)
PACKAGES = {
    "kernels": "tests/kernels/",
    "parallel": "tests/parallel/",
    "zoo": "tests/zoo/",
    "checkpoint": "tests/checkpoint/",
    "front": "tests/front/",
    "compile": "tests/test_compile.py::",
    "imports": "tests/test_imports.py::",
}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(the node ids the quick tier selects, {pattern: the node ids it marks slow}, pytest's output)."""
    report = tmp_path_factory.mktemp("quick_tier") / "slow.json"
    env = dict(os.environ, CUBOID_SLOW_REPORT=str(report))
    env.pop("PYTEST_ADDOPTS", None)
    # a test module another change leaves briefly unimportable costs its own tests, not this check
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--continue-on-collection-errors", "-m", "not slow", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert report.exists(), f"the collection did not reach tests/conftest.py's hook (exit {proc.returncode}):\n{out}"
    selected = [line.strip() for line in proc.stdout.splitlines() if line.startswith("tests/") and "::" in line]
    return selected, json.loads(report.read_text()), out


@pytest.mark.parametrize("package", PACKAGES)
def test_the_quick_tier_touches_every_package(quick, package):
    selected, _, out = quick
    assert any(n.startswith(PACKAGES[package]) for n in selected), (
        f"no test of {package} ({PACKAGES[package]}) is left in the quick tier: a SLOW rule in tests/conftest.py "
        f"now takes them all, or they failed to collect\n{out[-3000:]}")


def test_every_slow_pattern_marks_a_test_and_leaves_the_tier(quick):
    selected, hits, _ = quick
    stale = [pattern for pattern, ids in hits.items() if not ids]
    assert not stale, f"SLOW patterns in tests/conftest.py that match no collected test (renamed? moved?): {stale}"
    marked = {n for ids in hits.values() for n in ids}
    assert marked and not marked & set(selected), sorted(marked & set(selected))[:10]


def test_the_two_rank_plan_parity_stays_quick(quick):
    """The generated plan parity test's smallest world (every 2-rank plan, dense and MoE) is in the quick tier."""
    selected, _, _ = quick
    for test in ("tests/parallel/test_plans.py::test_every_enumerated_plan_on_2_ranks",
                 "tests/parallel/test_moe_plans.py::test_moe_plans_on_2_ranks"):
        assert test in selected
