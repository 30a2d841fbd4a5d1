"""The notebooks are committed with their outputs, built by `notebooks/tools/build.py` from
their sources there: a committed notebook whose cells differ from what its source builds is
stale (run the command the failure names).

The research notebook runs top to bottom (its cells assert their own results); its last
cell starts a tiny server (LocalServer) and measures prefill work from its answers. It runs on
`tiny` as written, and on `tiny-gpt-oss` with its first cell's `MODEL` switched (slow: the
MoE model's step shapes compile for the server too). The training notebook runs reduced in
tests/test_train_cli.py."""

import copy
import importlib.util
from pathlib import Path

import nbformat
import pytest

BUILD = Path(__file__).resolve().parents[1] / "notebooks" / "tools" / "build.py"
MODEL_LINE = 'MODEL = "tiny"\n'
# what each committed notebook's outputs show: the lines its readers are pointed at
SHOWN = {
    "cache_engineering": [
        "F saw: A0 C1 E2 F3",
        "max |logit diff|",
        "the prefill work; summed TTFT",
    ],
    "training_under_ops": [
        "repos threshold",
        "before: eval loss with ops",
        "after:  eval loss with ops",
        "saved docs/training_under_ops.png",
    ],
}
MAX_BYTES = 150_000  # text and a small figure or two


def load_build():
    """notebooks/tools/build.py as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("notebooks_build", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = load_build()


def text(nb) -> str:
    return "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def figures(nb) -> int:
    return sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
    )


@pytest.mark.parametrize("name", build.NAMES)
def test_committed_notebook_is_its_source_built_and_run(name):
    committed = nbformat.read(build.path(name), as_version=4)
    assert build.cell_sources(committed) == build.cell_sources(build.source(name)), (
        f"{build.path(name).name} is stale: python notebooks/tools/build.py {name}"
    )
    # the outputs of one run, top to bottom, without an error
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    for shown in SHOWN[name]:
        assert shown in text(committed)
    assert figures(committed) == 1
    # nothing that changes from run to run but the outputs, and small
    assert committed == build.clean(copy.deepcopy(committed))
    assert [c.id for c in committed.cells] == [c.id for c in build.source(name).cells]
    assert build.path(name).stat().st_size < MAX_BYTES


@pytest.mark.parametrize("model", ["tiny", pytest.param("tiny-gpt-oss", marks=pytest.mark.slow)])
def test_cache_engineering_notebook_executes(model):
    nb = nbformat.read(build.path("cache_engineering"), as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert first.source.count(MODEL_LINE) == 1  # the model choice the notebook documents
    first.source = first.source.replace(MODEL_LINE, f'MODEL = "{model}"\n')
    build.execute(nb, timeout=600)
    for shown in SHOWN["cache_engineering"]:
        assert shown in text(nb)
    assert figures(nb) == 1
