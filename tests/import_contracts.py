"""An import-linter contract type of the project's own: no module imports another module's private names.

pyproject.toml names it (``contract_types``) and tests/test_imports.py runs it
with the built-in ones. import-linter's import graph records which module
imports which, not the names imported, so this contract reads each module's
source (its AST, every ``from ... import`` at any depth, lazy ones too).
"""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import List, Optional

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _source(module: str, is_package: bool) -> Optional[Path]:
    """The file of ``module``, found from its top-level package's folder (nothing is imported)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest)
    return path / "__init__.py" if is_package else path.with_suffix(".py")


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from`` import reads from, relative imports resolved against ``importer``."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


class PrivateNamesContract(Contract):
    """A module never imports an underscore-prefixed name from another module of the package.

    Broken by ``from M import _n`` (``as`` anything), anywhere in a module of
    ``containers``, where ``M`` is a module of the linted package (``M`` may
    be the importer's own package ``__init__``: a package's private names are
    not its modules' either), ``_n`` starts with one underscore (dunder names
    such as ``__version__`` are public) and ``M._n`` is not a module. A
    private *module* (``from . import _backend``) is left to the built-in
    ``private_modules`` contract, which lets a package's own modules import
    it. Third-party private names are outside this contract. An attribute
    read (``M._n`` after ``import M``) is not an import and is not checked.
    """

    type_name = "private_names"

    containers = fields.ListField(subfield=fields.StringField())

    def check(self, graph, verbose: bool) -> ContractCheck:
        found: List[dict] = []
        modules = graph.modules
        for importer in sorted(modules):
            if not any(importer == c or importer.startswith(c + ".") for c in self.containers):
                continue
            is_package = bool(graph.find_children(importer))
            path = _source(importer, is_package)
            if path is None or not path.is_file():
                path = _source(importer, not is_package)  # a package without submodules, or the reverse
            if path is None or not path.is_file():
                raise FileNotFoundError(f"private_names: no source file for {importer}")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                source = _absolute(importer, path.name == "__init__.py", node)
                if source not in modules:
                    continue
                for alias in node.names:
                    if _private(alias.name) and f"{source}.{alias.name}" not in modules:
                        found.append({"importer": importer, "source": source, "name": alias.name,
                                      "line": node.lineno})
        return ContractCheck(kept=not found, metadata={"found": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error("Private names may only be used in the module that defines them:", bold=False)
        output.new_line()
        for f in check.metadata["found"]:
            output.print_error(f"- {f['importer']} imports {f['name']} from {f['source']} (l.{f['line']})",
                               bold=False)
        output.new_line()
