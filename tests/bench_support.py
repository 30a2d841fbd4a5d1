"""Bench scripts (bench/X.py) imported by tests, as ``python bench/X.py`` would see them.

bench/ is not put on ``sys.path``: its module names (decode, train, common, ...) would shadow
what libraries import. Each script is loaded from its file instead, after the bench modules it
imports by bare name (``from common import ...``), loaded the same way.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_imports(path: Path) -> list[str]:
    """The bench modules a bench file imports at its top level, by bare name."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [n for n in names if (BENCH / f"{n}.py").is_file()]


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py as module NAME (loaded once)."""
    if name in sys.modules:
        return sys.modules[name]
    path = BENCH / f"{name}.py"
    for dep in bench_imports(path):
        bench_module(dep)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up
    spec.loader.exec_module(module)
    return module
