"""Qwen3-MoE (softmax router, dense and MoE layers mixed, q/k norms) exact under every cache
operation (DESIGN §2.1): the naive float64 dense reference against transformers, then CacheOps
(incremental append/drop/repos), one-pass restore and the serving engine (reference, auto and
pallas attention) against the dense reference on random op histories, repositions after middle
drops included.

CI runs a few histories per path; ``-m slow`` runs 200 for the cache paths and 250 through the
engine (reference, auto and pallas backends together).
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness import dense_answers
from golden import F32_ATOL, tiny_dir, tiny_golden
from ops_cases import engine_matches_dense, random_cache_histories

from akv_jax.cache.core import CacheOps
from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from converters.loading import load_model


@pytest.fixture(scope="module")
def tiny():
    """``tiny-qwen3-moe``: (dense, MoE) x 2, 6 experts top-2 renormalised, q/k norms."""
    m = load_model("tiny-qwen3-moe")
    assert [m.cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    return m, DenseModel(m.params, m.cfg), CacheOps(m.cfg, block_q=16, page_size=16)


def test_dense_reference_matches_transformers_golden():
    m = load_model(tiny_dir("tiny_qwen3_moe"))
    g = tiny_golden("tiny_qwen3_moe")
    dm = DenseModel(m.params, m.cfg)
    prompt = g["prompt"].tolist()
    logits, _ = dm.run([prompt], parse_history(None, 1))
    assert np.abs(logits - g["logits"]).max() < F32_ATOL
    split, _ = dm.run([prompt[:100], prompt[100:101], prompt[101:]], parse_history(None, 3))
    assert np.abs(split - g["logits"]).max() < F32_ATOL
    toks, _ = dense_answers(dm, [([prompt], {"drop": {}, "reposition": []})], n=16)[0]
    assert toks == g["continuation"].tolist()


def test_random_histories_cache_ops_and_restore(tiny):
    seen = random_cache_histories(tiny, 3, seed=16)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos"}, seen


@pytest.mark.slow
def test_random_histories_cache_ops_and_restore_200(tiny):
    seen = random_cache_histories(tiny, 200, seed=1600)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos"}, seen


@pytest.mark.parametrize("backend,count", [("reference", 2), ("auto", 3), ("pallas", 1)])
def test_engine_random_histories(tiny, backend, count):
    engine_matches_dense(tiny, backend, count, seed=160)


@pytest.mark.slow
@pytest.mark.parametrize("backend,count", [("reference", 80), ("auto", 80), ("pallas", 40)])
def test_engine_random_histories_slow(tiny, backend, count):
    engine_matches_dense(tiny, backend, count, seed=1601)
    engine_matches_dense(tiny, backend, count // 4, seed=1602, concurrent=False, prefill_chunk=5)
