"""The house rules: ``lint-imports`` with the contracts in pyproject.toml (docs/architecture.md, "Who imports whom").

import-linter (through grimp) finds a package's modules by walking its folder,
and setuptools' ``package-dir`` puts ``kernels/``, ``parallel/`` and ``zoo/``
under ``cuboid`` only when installed. So each run lints a mirror: a temporary
``cuboid/`` folder of links to the real files, with the floors linked in where
the mapping puts them. The probes add a module or two to the mirror (never to
the tree) that break one rule each, and the same contracts must then fail.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import multiprocessing
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
    # the root after the mirror: tests.import_contracts, the project's own contract type
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT)]), "COLUMNS": "500"}  # one line per contract
    cmd = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
           str(PYPROJECT), "--no-cache"]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def verdicts(report: str) -> dict:
    """{contract id: "KEPT" | "BROKEN"} from the report's summary lines."""
    lines = dict(re.findall(r"^(.*) (KEPT|BROKEN)$", report, re.M))
    return {c["id"]: lines.get(c["name"]) for c in CONFIG["tool"]["importlinter"]["contracts"]}


def test_the_contracts_hold_without_ignored_imports(tmp_path):
    contracts = CONFIG["tool"]["importlinter"]["contracts"]
    assert {c["type"] for c in contracts} >= {"layers", "acyclic_siblings", "independence", "protected",
                                              "private_modules", "private_names"}
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
    "root-loop": ({"cuboid/loading/planner.py": (ROOT / "cuboid/loading/planner.py").read_text()
                   + "\nimport cuboid  # noqa: E402 - cuboid.load -> cuboid.loading.planner -> cuboid\n"},
                  "no-root-imports", "cuboid.loading.planner -> cuboid (l."),
    "private-module": ({"cuboid/zoo/_probe.py": "from cuboid.kernels import _backend  # noqa\n"},
                       "private-modules", "cuboid.zoo._probe -> cuboid.kernels._backend"),
    "private-name": ({"cuboid/parallel/_probe.py": "def f():\n    from .plan import _probe_name  # noqa\n"},
                     "private-names", "cuboid.parallel._probe imports _probe_name from cuboid.parallel.plan (l.2)"),
    "private-name-of-the-package": ({"cuboid/zoo/checkpoint/_probe.py": "from . import _probe_name as x  # noqa\n"},
                                    "private-names",
                                    "cuboid.zoo.checkpoint._probe imports _probe_name from cuboid.zoo.checkpoint"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_regression_breaks_its_contract(tmp_path, probe):
    """Each rule can fail: an upward import, a circle inside a floor, the reader reaching the writer, a module
    importing the package root (the load/planner loop), a private module or a private name across modules."""
    extra, contract, named = PROBES[probe]
    mirror(tmp_path, extra)
    out = lint(tmp_path)
    report = out.stdout + out.stderr
    assert out.returncode != 0, report
    assert verdicts(report)[contract] == "BROKEN", report
    assert named in report, report


# ----------------------------------------------------------------- docs/architecture.md's import tables

DOC = ROOT / "docs" / "architecture.md"
TABLES_BEGIN = "<!-- import tables: written by tests/test_imports.py from the code; do not edit -->"
TABLES_END = "<!-- end of the import tables -->"
FLOORS = ("zoo", "parallel", "kernels")  # the root's subpackages: floors of their own, not front-door modules
GRAPH = """
import json, grimp
g = grimp.build_graph("cuboid", cache_dir=None)
print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))
"""


def import_graph(tmp: Path) -> dict:
    """{module: [modules it imports directly]} of the ``cuboid`` namespace (grimp on a mirror in ``tmp``)."""
    mirror(tmp)
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    out = subprocess.run([sys.executable, "-c", GRAPH], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _child(package: str, module: str):
    """The child of ``package`` that holds ``module`` (itself or an ancestor), or None outside the package."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1:].split(".")[0]


def _depths(deps: dict) -> dict:
    """How far each child stands above the ones that import nothing (members of a circle: after the rest)."""
    depth: dict = {}

    def visit(c, seen=()):
        if c not in depth:
            depth[c] = len(deps) if c in seen else 1 + max((visit(d, seen + (c,)) for d in deps[c]), default=-1)
        return depth[c]

    for c in deps:
        visit(c)
    return depth


def _folder(package: str) -> str:
    """Where ``package`` lives in the checkout (setuptools' package-dir): ``cuboid.zoo.gpt`` -> ``zoo/gpt/``."""
    parts = package.split(".")
    return "/".join(parts[1:] if len(parts) > 1 else parts) + "/"


def import_rows(graph: dict, package: str) -> str:
    """``package``'s members (a subpackage counted as one, with all it holds) and which members each imports.

    Rows with the same imports share a line; rows go from the members that
    import no other member up. The package root's own floors are left out.
    """
    children = {_child(package, m) for m in graph if _child(package, m)}
    if package == "cuboid":
        children -= set(FLOORS)
    packages = {c for c in children if any(m.startswith(f"{package}.{c}.") for m in graph)}
    deps = {c: set() for c in children}
    for importer, imported in graph.items():
        c = _child(package, importer)
        if c in deps:
            deps[c] |= {d for d in map(lambda m: _child(package, m), imported) if d in deps and d != c}
    label = {c: f"`{c}/`" if c in packages else f"`{c}`" for c in children}
    depth = _depths(deps)
    groups: dict = {}
    for c in sorted(children, key=lambda c: (depth[c], c)):
        groups.setdefault(frozenset(deps[c]), []).append(c)
    lines = ["| module | imports from the same package |", "| --- | --- |"]
    for used, members in groups.items():
        names = ", ".join(label[c] for c in members)
        lines.append(f"| {names} | {', '.join(label[d] for d in sorted(used, key=lambda d: (depth[d], d))) or 'nothing'} |")
    return "\n".join(lines)


def import_tables(graph: dict) -> str:
    """The tables of every package with two members or more, the front door first, then down the floors."""
    order = ["cuboid", *(f"cuboid.{f}" for f in FLOORS)]
    pkgs = {m for m in graph if any(x.startswith(m + ".") for x in graph)}
    pkgs = sorted(pkgs, key=lambda p: (next(i for i, o in enumerate(order) if p == o or p.startswith(o + ".")), p))
    tables: dict = {}  # rows -> the packages that have them (the model families share theirs)
    for p in pkgs:
        if len({_child(p, m) for m in graph if _child(p, m)}) > 1:
            tables.setdefault(import_rows(graph, p), []).append(p)
    out = [f"**{', '.join(f'`{_folder(p)}`' for p in ps)}** ({', '.join(f'`{p}`' for p in ps)})\n\n{rows}"
           for rows, ps in tables.items()]
    return "\n\n".join([TABLES_BEGIN, *out, TABLES_END])


def test_the_import_tables_in_the_architecture_page_are_the_code_s(tmp_path):
    """docs/architecture.md's "Who imports whom" tables, compared with the tables the code makes now.

    Refresh them with ``python -m tests.test_imports`` (in the repository root), which rewrites the block.
    """
    fresh = import_tables(import_graph(tmp_path))
    text = DOC.read_text()
    assert TABLES_BEGIN in text and TABLES_END in text, f"{DOC} lost the markers around its import tables"
    now = text[text.index(TABLES_BEGIN):text.index(TABLES_END) + len(TABLES_END)]
    assert now == fresh, f"{DOC}'s import tables are stale (python -m tests.test_imports rewrites them):\n{fresh}"


# ----------------------------------------------------------------- the root shadows nothing


def where(name: str):
    """Where ``import name`` would load from here (None: nowhere). Module level: a spawned child runs it."""
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None else None


def _from_root(name: str, origin) -> bool:
    """Whether ``origin`` is the repository's own top-level folder ``name``."""
    return origin is not None and Path(origin).resolve().is_relative_to(ROOT / name)


def test_the_repository_root_shadows_no_installed_package():
    """kernels/, parallel/ and zoo/ are cuboid.kernels, ...: as top-level names they must lose to installed packages.

    The root stays on sys.path (last) only so that ``tests.*`` import, here and in spawned ranks.
    """
    entries = [os.path.realpath(p or os.curdir) for p in sys.path]
    sites = [i for i, p in enumerate(entries) if os.path.basename(p) in ("site-packages", "dist-packages")]
    assert str(ROOT) in entries and sites, sys.path
    assert entries.index(str(ROOT)) > max(sites), f"the repository root comes before site-packages: {sys.path}"
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    for name in ("kernels", "parallel", "zoo"):
        if name in installed:  # Hugging Face's kernels arrives with transformers >= 5.25
            assert not _from_root(name, where(name)), f"import {name} finds {where(name)}, the repository's folder"
    assert _from_root("tests", where("tests")), "the tests package must still import (spawned ranks unpickle from it)"
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a spawned rank inherits the order
        child = pool.apply(where, ("kernels",))
        assert pool.apply(where, ("tests.parallel.launch",)) is not None
    assert child == where("kernels")


# ----------------------------------------------------------------- a user's script in the repository root

# What `python -c` or `python - < script` (sys.path[0] == '') in the repository root sees, compared with the same
# code run elsewhere: transformers' availability check for Hugging Face's kernels, and where `kernels` comes from.
ROOT_SCRIPT = """
import importlib.util, sys
import transformers
from transformers.utils import is_kernels_available
print(transformers.LlamaForCausalLM.__name__, is_kernels_available())
import kernels
print(kernels.__spec__.origin, importlib.util.find_spec("kernels").origin)
import cuboid
from cuboid import kernels as ck
print(ck.rms_norm.__module__, type(sys.modules["cuboid.kernels"]).__name__)
import cuboid.zoo
print(type(cuboid.zoo.build("gpt-debug")).__name__)
"""


def _python(args, cwd, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          **kw)


def test_transformers_one_liner_runs_in_the_repository_root():
    """kernels/__init__.py, imported as ``kernels`` (the root first on sys.path), hands over to the installed one."""
    pytest.importorskip("transformers")
    out = _python(["-c", "import transformers; transformers.LlamaForCausalLM"], ROOT)
    assert out.returncode == 0, out.stderr


def test_a_script_in_the_root_imports_transformers_and_cuboid_as_anywhere_else(tmp_path):
    pytest.importorskip("transformers")
    if "kernels" not in {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5 does not import it)")
    here = _python(["-"], ROOT, input=ROOT_SCRIPT)
    assert here.returncode == 0, here.stderr
    elsewhere = _python(["-"], tmp_path, input=ROOT_SCRIPT)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert here.stdout == elsewhere.stdout
    lines = here.stdout.splitlines()
    assert lines[0] == "LlamaForCausalLM True", here.stdout
    assert not _from_root("kernels", lines[1].split()[0]), here.stdout
    assert lines[2] == "cuboid.kernels.norm _Package", here.stdout


def test_bare_kernels_without_the_distribution_says_so_in_one_sentence():
    """``python -S``: no site-packages, so no Hugging Face kernels to hand over to."""
    out = _python(["-S", "-c", "import kernels"], ROOT)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named 'kernels' is installed:"), out.stderr
    assert "is cuboid.kernels, not Hugging Face's kernels distribution" in last, out.stderr


def test_only_kernels_has_an_installed_namesake():
    """parallel/ and zoo/ need no hand-over while no installed distribution provides a top-level module of their
    name (none does, and transformers imports neither); one that appears needs what kernels/__init__.py does."""
    owners = importlib.metadata.packages_distributions()
    for name in ("parallel", "zoo"):
        assert name not in owners, f"{owners[name]} installs a top-level {name!r}: the folder {name}/ shadows it " \
                                   "in the repository root; hand over as kernels/__init__.py does"


if __name__ == "__main__":  # python -m tests.test_imports: rewrite docs/architecture.md's import tables
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        block = import_tables(import_graph(Path(tmp)))
    text = DOC.read_text()
    DOC.write_text(text[:text.index(TABLES_BEGIN)] + block + text[text.index(TABLES_END) + len(TABLES_END):])
    print(f"wrote the import tables of {DOC}")
