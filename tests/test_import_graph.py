"""The packages import one way: the layering rule, stated once and checked on the source.

Layers, lowest first (a package may import only packages of a lower layer):

    akv_jax.kernels     the C++ CPU kernels and their bindings (nothing of the project)
    akv_jax.pallas      kernels and what they read: segment-batch metadata, RoPE tables and
                        rotations, jnp references, the attention / repos factory
    akv_jax.model       configs, params, forward, tokenizer, checkpoints
    akv_jax.cache       CacheState and its ops, one-pass restore, dense reference
    converters          checkpoint conversion and converter-backed loading (load_model)

``akv_jax.cache`` and ``converters`` share a layer and import neither each other. None of them
imports the applications above (``akv_jax.serving``, ``akv_jax.agent``). Every import counts,
at module level or inside a function, under ``TYPE_CHECKING`` or not: a deferred import still
ties the packages together.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = ("akv_jax", "converters")
RANK = {"akv_jax.kernels": 0, "akv_jax.pallas": 1, "akv_jax.model": 2, "akv_jax.cache": 3,
        "converters": 3}
APPLICATIONS = ("akv_jax.serving", "akv_jax.agent")


def modules() -> dict[str, Path]:
    """Dotted name -> source file of every module under akv_jax/ and converters/."""
    out = {}
    for top in TOP:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_names(
    module: str, source: str, is_package: bool = False
) -> list[tuple[int, str, bool]]:
    """(line, dotted name, maybe_symbol) of everything ``source`` imports, anywhere in the
    file. For ``from a.b import c`` both ``a.b`` and ``a.b.c`` are listed, the second with
    ``maybe_symbol`` set (``c`` is a module or a name defined in ``a.b``)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, False) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base, False))
            out += [(node.lineno, f"{base}.{alias.name}", True) for alias in node.names]
    return out


def package_of(name: str) -> str | None:
    """The package node a dotted name belongs to: ``akv_jax.<sub>`` or ``converters``;
    None for anything outside the project."""
    parts = name.split(".")
    if parts[0] == "converters":
        return "converters"
    if parts[0] == "akv_jax" and len(parts) > 1:
        return f"akv_jax.{parts[1]}"
    return None


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> where: ``file:line imports name``."""
    mods = modules()
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for mod, path in mods.items():
        src = package_of(mod) if "." in mod else None
        if src is None:
            continue
        is_pkg = path.name == "__init__.py"
        for line, name, maybe_symbol in imported_names(mod, path.read_text(), is_pkg):
            dst = package_of(name)
            if dst is None or dst == src or (maybe_symbol and name not in mods):
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {name}"
            if where not in edges[(src, dst)]:
                edges[(src, dst)].append(where)
    return dict(edges)


def describe(edge: tuple[str, str], edges: dict) -> str:
    return f"{edge[0]} -> {edge[1]} ({'; '.join(edges[edge])})"


def cycles(edges: dict) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_packages():
    edges = package_edges()
    bad = []
    for comp in cycles(edges):
        inside = [e for e in edges if e[0] in comp and e[1] in comp]
        bad.append(
            "cycle between " + ", ".join(comp) + ":\n    "
            + "\n    ".join(describe(e, edges) for e in sorted(inside))
        )
    assert not bad, "\n".join(bad)


def test_lower_layers_import_only_lower_layers():
    edges = package_edges()
    bad = [
        describe((a, b), edges)
        for (a, b) in sorted(edges)
        if a in RANK and b in RANK and RANK[b] >= RANK[a]
    ]
    rule = "kernels < pallas < model < cache, converters"
    assert not bad, f"imports against the layering ({rule}):\n  " + "\n  ".join(bad)


def test_lower_layers_do_not_import_applications():
    edges = package_edges()
    bad = [describe((a, b), edges) for (a, b) in sorted(edges) if a in RANK and b in APPLICATIONS]
    assert not bad, "a lower layer imports serving or agent:\n  " + "\n  ".join(bad)


def test_the_parser_sees_deferred_and_relative_imports():
    src = (
        "import akv_jax.cache.ops\n"
        "def f():\n"
        "    from akv_jax.serving import engine\n"
        "class C:\n"
        "    def g(self):\n"
        "        from ..pallas.metadata import bucket\n"
    )
    names = [n for _, n, _ in imported_names("akv_jax.model.x", src)]
    assert "akv_jax.cache.ops" in names
    assert "akv_jax.serving.engine" in names
    assert "akv_jax.pallas.metadata" in names
    assert package_of("akv_jax.serving.engine") == "akv_jax.serving"
    # The real graph is not empty: the model really does sit on the kernels.
    assert ("akv_jax.model", "akv_jax.pallas") in package_edges()
