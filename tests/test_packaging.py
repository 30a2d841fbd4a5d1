"""Every module of the installed packages imports with the runtime dependencies alone.

``pip install .`` installs ``[project].dependencies`` and nothing else, while the test venv
also holds the dev extra; a module that imports a dev-only library (httpx once was) works here
and fails for a user. Two checks, because each misses what the other sees:

* statically, every third-party import in ``akv_jax`` and ``converters`` (at module level or
  inside a function) belongs to a distribution declared in ``[project].dependencies`` (a direct
  import of a library that is only a dependency of a dependency counts as undeclared: it may
  go away with the next release of the library in between). An import inside
  ``try: ... except ImportError`` is optional and exempt;
* dynamically, one subprocess imports every module with an import hook that hides every
  installed distribution outside the closure of the declared dependencies (their own
  requirements followed recursively, environment markers evaluated), as a venv without the dev
  extra would. It catches what static analysis cannot: import-time failures of any kind.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import pkgutil
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement  # pytest's own dependency

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("akv_jax", "converters")
IMPORT_GUARDS = {"ImportError", "ModuleNotFoundError"}


def normalize(name: str) -> str:
    """PEP 503 name normalisation (``Jinja2`` == ``jinja2``, ``ml_dtypes`` == ``ml-dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def declared() -> set[str]:
    return {normalize(Requirement(r).name) for r in project()["dependencies"]}


def module_files() -> Iterator[tuple[str, Path]]:
    """(module name, source file) for every module and package of :data:`PACKAGES`."""
    for pkg in PACKAGES:
        yield pkg, ROOT / pkg / "__init__.py"
        for info in pkgutil.walk_packages([str(ROOT / pkg)], pkg + "."):
            base = ROOT.joinpath(*info.name.split("."))
            yield info.name, base / "__init__.py" if info.ispkg else base.with_suffix(".py")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in IMPORT_GUARDS for n in names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def third_party_imports(source: str) -> Iterator[tuple[int, str]]:
    """(line, top-level module name) of every import that is not guarded by an
    ``except ImportError`` and not under ``if TYPE_CHECKING:``; relative imports left out."""

    def visit(node: ast.AST, guarded: bool) -> Iterator[tuple[int, str]]:
        if isinstance(node, ast.Import) and not guarded:
            for alias in node.names:
                yield node.lineno, alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not guarded and node.level == 0:
            yield node.lineno, node.module.split(".")[0]
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # the body never runs
                yield from visit(child, guarded)
            return
        elif isinstance(node, ast.Try):
            inner = guarded or any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                yield from visit(child, inner)
            for child in (*node.handlers, *node.orelse, *node.finalbody):
                yield from visit(child, guarded)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, guarded)

    yield from visit(ast.parse(source), False)


def test_every_import_is_a_declared_dependency():
    deps = declared()
    owners = md.packages_distributions()
    ours = set(PACKAGES)
    bad = []
    for name, path in module_files():
        for line, top in third_party_imports(path.read_text()):
            if top in sys.stdlib_module_names or top in ours:
                continue
            dists = {normalize(d) for d in owners.get(top, [])}
            if not dists:
                bad.append(f"{name}:{line}: {top} (no installed distribution provides it)")
            elif not dists & deps:
                bad.append(f"{name}:{line}: {top} (from {', '.join(sorted(dists))})")
    assert not bad, (
        "imports of libraries missing from [project].dependencies in pyproject.toml (declare "
        "them, or guard an optional import with try/except ImportError):\n  " + "\n  ".join(bad)
    )


def runtime_closure(requirements: list[str]) -> set[str]:
    """Normalised names of the distributions that ``pip install`` of ``requirements`` brings
    in, following the installed metadata (requirements not installed here are left out)."""
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    out: set[str] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = normalize(req.name)
        wanted = [(name, "")] + [(name, normalize(e)) for e in req.extras]
        for key in wanted:
            if key in seen:
                continue
            seen.add(key)
            out.add(name)
            try:
                sub = md.requires(req.name) or []
            except md.PackageNotFoundError:
                continue
            todo.extend((Requirement(s), key[1]) for s in sub)
    return out


# Runs in the subprocess: hide every distribution outside the closure, then import everything.
_IMPORT_ALL = r"""
import importlib, importlib.abc, importlib.metadata as md, json, pkgutil, re, sys, traceback

allowed = set(json.loads(sys.argv[1]))
packages = json.loads(sys.argv[2])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
owners = {top: {norm(d) for d in ds} for top, ds in md.packages_distributions().items()}
hidden = {top for top, ds in owners.items() if not ds & allowed and top not in packages}
blocked = set()


class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in hidden:
            blocked.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (not a runtime dependency)",
                                      name=name)
        return None


sys.meta_path.insert(0, Hide())
failed = {}
names = []
for pkg in packages:
    names.append(pkg)
    mod = importlib.import_module(pkg)
    names += [m.name for m in pkgutil.walk_packages(
        mod.__path__, pkg + ".", onerror=lambda n: failed.setdefault(n, "walk failed"))]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException as e:
        failed[name] = "".join(traceback.format_exception_only(e)).strip()
print(json.dumps({"imported": len(names) - len(failed), "failed": failed,
                  "blocked": sorted(blocked)}))
"""


def test_every_module_imports_with_runtime_dependencies_only(tmp_path):
    allowed = runtime_closure(project()["dependencies"])
    # Not the repository root as the working directory: the import must come from the install.
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, json.dumps(sorted(allowed)), json.dumps(PACKAGES)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["failed"], (
        "modules that do not import with the runtime dependencies alone (hidden on import: "
        f"{result['blocked']}):\n  "
        + "\n  ".join(f"{k}: {v}" for k, v in sorted(result["failed"].items()))
    )
    assert result["imported"] > 40
