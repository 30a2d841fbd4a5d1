"""Import hygiene, checked on the source (nothing here imports the modules it checks).

* No module imports another project module's underscore name: a name shared across modules
  is public (``from akv_jax.x import _helper`` hides a dependency behind a "private" name).
  Third-party private imports (``jax._src``, ``transformers``) are not the project's to fix.
* No test file imports from another ``test_*.py`` file: shared test helpers live in support
  modules (``ops_cases.py``, ``pallas_cases.py``, ``engine_cases.py``, ...), so a test file
  can be run, moved or deleted without breaking another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED_DIRS = ("akv_jax", "converters", "bench", "tests", "scripts")
# Packages imported by their dotted name from the repository root.
OWN_PACKAGES = ("akv_jax", "converters", "bench", "tests")
# Directories whose modules are imported by bare name (pytest puts tests/ on sys.path; the
# bench scripts run from bench/).
BARE_NAME_DIRS = ("tests", "bench")


def source_files() -> list[Path]:
    """Every .py file under the checked directories."""
    return sorted(
        path
        for top in CHECKED_DIRS
        if (ROOT / top).is_dir()
        for path in (ROOT / top).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def bare_modules() -> set[str]:
    """Module names importable by bare name: the files directly in tests/ and bench/."""
    return {path.stem for top in BARE_NAME_DIRS for path in (ROOT / top).glob("*.py")}


def is_own(module: str, bare: set[str]) -> bool:
    """Whether an absolute dotted module name is one of the project's own modules."""
    top = module.split(".")[0]
    return top in OWN_PACKAGES or top in bare


def is_private(name: str) -> bool:
    """A single-underscore name (``_x``), not a dunder (``__all__``)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def imports(path: Path) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in a file, at module level or nested."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def where(path: Path, node: ast.stmt) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def private_imports() -> list[str]:
    """``file:line name`` for every import of an underscore name of a project module."""
    bare = bare_modules()
    found = []
    for path in source_files():
        for node in imports(path):
            if isinstance(node, ast.ImportFrom):
                # A relative import is always the project's own.
                if node.level == 0 and not is_own(node.module or "", bare):
                    continue
                module = "." * node.level + (node.module or "")
                module_parts = (node.module or "").split(".")
                found += [
                    f"{where(path, node)} from {module} import {part}"
                    for part in module_parts
                    if is_private(part)
                ]
                found += [
                    f"{where(path, node)} from {module} import {alias.name}"
                    for alias in node.names
                    if is_private(alias.name)
                ]
            else:
                found += [
                    f"{where(path, node)} import {alias.name}"
                    for alias in node.names
                    if is_own(alias.name, bare)
                    and any(is_private(part) for part in alias.name.split("."))
                ]
    return found


def imports_of_test_files() -> list[str]:
    """``file:line name`` for every import, by a file under tests/, of a test_*.py module."""
    test_modules = {path.stem for path in (ROOT / "tests").glob("test_*.py")}

    def is_test_module(dotted: str) -> bool:
        parts = dotted.split(".")
        if parts[0] == "tests":
            parts = parts[1:]
        return len(parts) == 1 and parts[0] in test_modules

    found = []
    for path in source_files():
        if path.relative_to(ROOT).parts[0] != "tests":
            continue
        for node in imports(path):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level:  # relative: tests/ is not a package, but count it all the same
                base = node.module or ""
                names = [base] if base else [alias.name for alias in node.names]
            else:
                base = node.module or ""
                # ``from tests import test_x`` names the module in the alias.
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            found += [
                f"{where(path, node)} imports {name}" for name in names if is_test_module(name)
            ]
    return found


def test_no_private_names_imported_across_project_modules():
    found = private_imports()
    assert not found, "underscore names imported from project modules (make them public):\n" + (
        "\n".join(found)
    )


def test_tests_import_helpers_only_from_support_modules():
    found = imports_of_test_files()
    assert not found, (
        "test files import from other test files (move the helper to a support module):\n"
        + ("\n".join(found))
    )
