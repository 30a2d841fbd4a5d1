"""Import hygiene, checked on the source (nothing here imports the modules it checks).

* No module imports another project module's underscore name: a name shared across modules
  is public (``from akv_jax.x import _helper`` hides a dependency behind a "private" name).
  Third-party private imports (``jax._src``, ``transformers``) are not the project's to fix.
* No test file imports from another ``test_*.py`` file: shared test helpers live in support
  modules (``ops_cases.py``, ``pallas_cases.py``, ``engine_cases.py``, ...), so a test file
  can be run, moved or deleted without breaking another.
* The model knows no CPU kernel: no module under ``akv_jax/model/`` imports
  ``akv_jax.kernels.cpu`` or a module in it (the forward is given its projection backend, as
  it is given its attention), and ``akv_jax/pallas/`` holds no C++ kernel (``.cc``, ``.h``)
  and no ``cpu_*`` file: those live in ``akv_jax/kernels/cpu/``.
* No module under ``akv_jax/`` or ``converters/`` is over 450 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED_DIRS = ("akv_jax", "converters", "bench", "tests", "scripts", "notebooks")
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


CPU_KERNELS = "akv_jax.kernels.cpu"


def module_name(path: Path) -> str:
    """The dotted name of a source file under the repository root."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> Iterator[tuple[ast.stmt, str]]:
    """(statement, dotted name) for everything a file imports, relative imports resolved:
    ``from a.b import c`` gives both ``a.b`` and ``a.b.c`` (``c`` may be a module)."""
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    for node in imports(path):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        yield node, base
        for alias in node.names:
            yield node, f"{base}.{alias.name}"


def cpu_kernel_imports(directory: Path) -> list[str]:
    """``file:line name`` for every import statement, in a file under ``directory``, of the
    CPU kernels' package or a module in it (once a statement)."""
    found: dict[str, str] = {}
    for path in sorted(directory.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node, name in imported_modules(path):
            if name == CPU_KERNELS or name.startswith(CPU_KERNELS + "."):
                found.setdefault(where(path, node), name)
    return [f"{at} imports {name}" for at, name in found.items()]


def test_the_model_imports_no_cpu_kernel():
    found = cpu_kernel_imports(ROOT / "akv_jax" / "model")
    assert not found, "the model imports CPU kernel modules (give it a backend instead):\n" + (
        "\n".join(found)
    )


def test_the_kernel_import_check_sees_every_form(tmp_path, monkeypatch):
    """Absolute, aliased and relative imports of the package or a module in it are all found;
    the projection interface beside it is not the CPU kernels."""
    pkg = tmp_path / "akv_jax" / "model"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text(
        "import akv_jax.kernels.cpu.matmul\n"
        "from akv_jax.kernels.cpu import ffi as f\n"
        "from akv_jax.kernels.projection import Projection\n"
        "def g():\n"
        "    from ..kernels import cpu\n"
    )
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    found = cpu_kernel_imports(pkg)
    assert [f.split(" imports ")[0] for f in found] == ["akv_jax/model/a.py:1",
                                                         "akv_jax/model/a.py:2",
                                                         "akv_jax/model/a.py:5"]


def test_pallas_holds_no_cpu_kernel_file():
    found = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "akv_jax" / "pallas").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
        and (path.suffix in (".cc", ".h") or path.name.startswith("cpu_"))
    )
    assert not found, "C++ kernels or cpu_* files under akv_jax/pallas/ (they belong in " + (
        "akv_jax/kernels/cpu/):\n" + "\n".join(found)
    )


MAX_MODULE_LINES = 450  # issue 37: a module past it holds more than one job


def test_no_library_module_over_450_lines():
    """Modules under ``akv_jax/`` and ``converters/`` stay small (bench/ and tests/ share
    helpers instead of growing)."""
    long = sorted(
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in source_files()
        if path.relative_to(ROOT).parts[0] in ("akv_jax", "converters")
        and (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert not long, "\n".join(long)
