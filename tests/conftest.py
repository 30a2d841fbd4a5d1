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
