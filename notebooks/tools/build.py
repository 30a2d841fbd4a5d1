"""Builds each notebook from its source in this folder, executes it and writes it with its
outputs: `python notebooks/tools/build.py [NAME ...]` from anywhere (every notebook when no
NAME is given). The written file depends only on the source and on what the run prints: cell
ids follow the cell's place, and timings, kernel versions and stderr (warnings, progress
bars) are left out. tests/test_notebook.py fails when a committed notebook's cells differ
from what its source builds."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat import NotebookNode

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parents[1]
NAMES = ("cache_engineering", "training_under_ops")
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
# matplotlib's figures come back as PNG outputs; a backend set outside (MPLBACKEND=Agg) would
# show none.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


def path(name: str) -> Path:
    """Where the notebook is committed."""
    return ROOT / "notebooks" / f"{name}.ipynb"


def source(name: str) -> NotebookNode:
    """The notebook as its source in this folder builds it, without outputs."""
    spec = importlib.util.spec_from_file_location(f"notebook_source_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    nb = nbformat.v4.new_notebook(cells=module.cells(), metadata={"kernelspec": KERNELSPEC})
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i}"
    return nb


def execute(nb: NotebookNode, timeout: int) -> NotebookNode:
    """Runs every cell in order, in the repository root, in a fresh kernel (the cells'
    asserts raise: nbclient's CellExecutionError), and returns the notebook with its outputs
    (kept as `clean` keeps them)."""
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        coalesce_streams=True,  # one stdout output a cell, however the kernel flushed it
        resources={"metadata": {"path": str(ROOT)}},
    ).execute(env={**os.environ, "MPLBACKEND": INLINE_BACKEND})
    return clean(nb)


def clean(nb: NotebookNode) -> NotebookNode:
    """Keeps what a reader should see: stdout, results and figures; drops stderr and the
    metadata that changes from run to run (the kernel's language_info, cell timings)."""
    nb.metadata = {"kernelspec": KERNELSPEC}
    for cell in nb.cells:
        cell.metadata = {}
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if o.get("name") != "stderr"]
    return nb


def cell_sources(nb: NotebookNode) -> list[tuple[str, str]]:
    """Each cell's type and source, in order: what a committed notebook must share with its
    source for it not to be stale."""
    return [(cell.cell_type, cell.source) for cell in nb.cells]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"of {', '.join(NAMES)} (default: all)"
    )
    parser.add_argument("--timeout", type=int, default=7200, help="seconds a cell may run")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - set(NAMES)):
        parser.error(f"no notebook named {', '.join(unknown)} (known: {', '.join(NAMES)})")
    for name in args.names or NAMES:
        nb = execute(source(name), args.timeout)
        nbformat.validate(nb)
        nbformat.write(nb, path(name))
        print(f"wrote {path(name).relative_to(ROOT)} ({path(name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
