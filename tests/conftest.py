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
