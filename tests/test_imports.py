"""The house rules: ``lint-imports`` with the contracts in pyproject.toml (docs/architecture.md, "Who imports whom").

import-linter (through grimp) finds a package's modules by walking its folder,
and setuptools' ``package-dir`` puts ``kernels/``, ``parallel/`` and ``zoo/``
under ``cuboid`` only when installed. So each run lints a mirror: a temporary
``cuboid/`` folder of links to the real files, with the floors linked in where
the mapping puts them. The probes add a module or two to the mirror (never to
the tree) that break one rule each, and the same contracts must then fail.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
CONFIG = tomllib.loads(PYPROJECT.read_text())


def package_dirs() -> dict:
    """cuboid's subpackages that live outside cuboid/: {"kernels": ROOT / "kernels", ...} (from package-dir)."""
    mapping = CONFIG["tool"]["setuptools"]["package-dir"]
    assert mapping["cuboid"] == "cuboid"
    out = {}
    for name, folder in mapping.items():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "cuboid" and folder != f"cuboid/{parts[1]}":
            out[parts[1]] = ROOT / folder
    for name, folder in mapping.items():  # deeper packages must sit where their parent's folder puts them
        parts = name.split(".")
        if len(parts) > 2:
            assert ROOT / folder == out[parts[1]].joinpath(*parts[2:]), f"{name} = {folder!r} is not nested"
    return out


def _link_tree(src: Path, dst: Path) -> int:
    """Real folders under ``dst`` with a link to every .py file of ``src``; returns the file count."""
    n = 0
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        here = dst / Path(dirpath).relative_to(src)
        here.mkdir(parents=True, exist_ok=True)
        for f in filenames:
            if f.endswith(".py"):
                (here / f).symlink_to(Path(dirpath) / f)
                n += 1
    return n


def mirror(tmp: Path, extra: dict | None = None) -> int:
    """The ``cuboid`` namespace as installed, under ``tmp``; ``extra`` {path in it: text} replaces or adds files."""
    n = _link_tree(ROOT / "cuboid", tmp / "cuboid")
    for sub, folder in package_dirs().items():
        n += _link_tree(folder, tmp / "cuboid" / sub)
    for rel, text in (extra or {}).items():
        path = tmp / rel
        if path.is_symlink():
            path.unlink()
        else:
            n += 1
        path.write_text(text)
    return n


def lint(tmp: Path) -> subprocess.CompletedProcess:
    """lint-imports on the mirror in ``tmp`` (its folder first on sys.path), with the project's contracts."""
    env = {**os.environ, "PYTHONPATH": str(tmp), "COLUMNS": "500"}  # one line per contract in the report
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
           str(PYPROJECT), "--no-cache"]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def verdicts(report: str) -> dict:
    """{contract id: "KEPT" | "BROKEN"} from the report's summary lines."""
    lines = dict(re.findall(r"^(.*) (KEPT|BROKEN)$", report, re.M))
    return {c["id"]: lines.get(c["name"]) for c in CONFIG["tool"]["importlinter"]["contracts"]}


def test_the_contracts_hold_without_ignored_imports(tmp_path):
    contracts = CONFIG["tool"]["importlinter"]["contracts"]
    assert {c["type"] for c in contracts} >= {"layers", "acyclic_siblings", "independence"}
    assert not [c["id"] for c in contracts if c.get("ignore_imports")], "no contract may ignore imports"
    files = mirror(tmp_path)
    out = lint(tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert set(verdicts(report).values()) == {"KEPT"}, report
    analyzed = int(re.search(r"Analyzed (\d+) files", report).group(1))
    assert analyzed == files > 60, f"the linter saw {analyzed} of the mirror's {files} files"




PROBES = {  # name: (files added to the mirror, the contract it breaks, what the report must name)
    "upward": ({"cuboid/kernels/_probe.py": "from cuboid.zoo import common  # a kernel that knows a model\n"},
               "floors", "cuboid.kernels._probe -> cuboid.zoo.common"),
    "circle": ({"cuboid/parallel/_probe_a.py": "from cuboid.parallel import _probe_b  # noqa\n",
                "cuboid/parallel/_probe_b.py": "from cuboid.parallel import _probe_a  # noqa\n"},
               "no-circles", "No cycles are allowed in cuboid.parallel"),
    "reader-writer": ({"cuboid/zoo/checkpoint/reader.py": (ROOT / "zoo/checkpoint/reader.py").read_text()
                       + "\nfrom . import writer  # noqa: E402\n"},
                      "checkpoint-read-write", "cuboid.zoo.checkpoint.reader is not allowed to import"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_regression_breaks_its_contract(tmp_path, probe):
    """Each rule can fail: an upward import, a circle inside a floor, the reader reaching the writer."""
    extra, contract, named = PROBES[probe]
    mirror(tmp_path, extra)
    out = lint(tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode != 0, report
    assert verdicts(report)[contract] == "BROKEN", report
    assert named in report, report
