"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    """A fresh AKV_JAX_CACHE holding the embedded default, converted GGUF -> orbax once per
    session (so the conversion path itself is under test), set for the whole session."""
    from converters.loading import default_model_dir

    root = tmp_path_factory.mktemp("akv_jax_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AKV_JAX_CACHE", str(root))
        default_model_dir(progress=False)
        yield root


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
    """Drop compiled programs after each test module: the whole suite runs in one process,
    and without this it accumulates every module's executables (GB of host memory by the
    end; a late XLA compile once died with a segfault there). Each module compiles what it
    uses anyway, so this costs nothing a module would not pay alone."""
    yield
    import jax

    jax.clear_caches()


# The longest test files (CI's --durations), longest first: pytest-xdist's --dist loadfile
# hands files to its workers in collection order, so a long file collected last ran alone at
# the end while the other worker sat idle (test_soak.py's minute did).
LONGEST_FIRST = (
    "test_bitwise.py",
    "test_exact_any_order_moe_multidevice.py",
    "test_exact_any_order_disaggregated_multidevice.py",
    "test_exact_any_order_multidevice.py",
    "test_train_multidevice.py",
    "test_bitwise_multidevice.py",
    "test_engine_exact.py",
    "test_gpt_oss_ops.py",
    "test_gpt_oss_mxfp4.py",
    "test_model_parity.py",
    "test_exact_any_order.py",
    "test_train_cli.py",
    "test_server_main.py",
    "test_qwen3_moe_ops.py",
    "test_soak.py",
    "test_cache_core.py",
    "test_notebook.py",
)


def pytest_sessionfinish(session, exitstatus):
    import sys

    support = sys.modules.get("server_support")  # only if a test module imported it
    if support is not None:
        support.stop_shared()


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep order
