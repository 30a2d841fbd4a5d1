"""MiniMax-M2 (partial rotary, q/k norm over all heads, sigmoid-routed MoE) exact under every
cache operation (DESIGN §2.1): the naive float64 dense reference against transformers, then
CacheOps (incremental append/drop/repos), one-pass restore and the serving engine (reference,
auto and pallas attention) against the dense reference on random op histories, repositions
after middle drops included. Stored keys are compared too: after a repos only their rotary
dims moved (the q/k norm makes keys O(1), so a wrong rotation shows at 1e-5).

CI runs a few histories; ``-m slow`` runs 200 for the cache paths and 60 through the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness import dense_answers
from golden import F32_ATOL, tiny_dir, tiny_golden
from ops_cases import CAPACITY, compare_states, engine_matches_dense, random_cache_histories

from akv_jax.cache.core import CacheOps
from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from converters.loading import load_model


@pytest.fixture(scope="module")
def tiny():
    """``tiny-minimax-m2``: 8 of 16 head dims rotary, 6 experts top-2, sigmoid router."""
    m = load_model("tiny-minimax-m2")
    assert m.cfg.rotary_dim == 8 and m.cfg.head_dim == 16 and m.cfg.sigmoid_router
    return m, DenseModel(m.params, m.cfg), CacheOps(m.cfg, block_q=16, page_size=16)


def test_dense_reference_matches_transformers_golden():
    m = load_model(tiny_dir("tiny_minimax_m2"))
    g = tiny_golden("tiny_minimax_m2")
    dm = DenseModel(m.params, m.cfg)
    prompt = g["prompt"].tolist()
    logits, _ = dm.run([prompt], parse_history(None, 1))
    assert np.abs(logits - g["logits"]).max() < F32_ATOL  # measured 1.6e-6
    toks, _ = dense_answers(dm, [([prompt], {"drop": {}, "reposition": []})], n=16)[0]
    assert toks == g["continuation"].tolist()


def test_repos_moves_only_the_rotary_dims(tiny):
    """After a drop and a repos, stored keys equal the dense reference's raw keys rotated at
    their new positions on the rotary dims, and equal the raw keys on the others."""
    m, dm, ops = tiny
    segs = [list(range(1, 13)), list(range(20, 24)), list(range(30, 36))]
    h = parse_history({"drop": {"1": [0]}, "reposition": [1]}, 3)
    ref_logits, ref_state = dm.run(segs, h)
    got, state = ops.run(m.params, ops.empty(CAPACITY), segs, h)
    np.testing.assert_allclose(np.asarray(got), ref_logits, atol=1e-4)
    compare_states(state, ref_state, dm, sum(map(len, segs)))
    assert ref_state.pos.tolist()[12:16] == [0, 1, 2, 3]  # moved from 12..15
    k, _ = state.slot_keys()
    r = m.cfg.rope_dim
    for layer in range(m.cfg.num_layers):
        np.testing.assert_allclose(np.asarray(k[layer, :22, :, r:]),
                                   ref_state.k_raw[layer][:, :, r:], atol=1e-6)


def test_random_histories_cache_ops_and_restore(tiny):
    seen = random_cache_histories(tiny, 4, seed=16)
    assert {"middle_drop_then_repos", "several_repos", "drop_first"} <= seen, seen


@pytest.mark.slow
def test_random_histories_cache_ops_and_restore_200(tiny):
    seen = random_cache_histories(tiny, 200, seed=1600)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos"}, seen


@pytest.mark.parametrize("backend,count", [("reference", 2), ("auto", 3), ("pallas", 1)])
def test_engine_random_histories(tiny, backend, count):
    engine_matches_dense(tiny, backend, count, seed=160)


@pytest.mark.slow
@pytest.mark.parametrize("backend,count", [("reference", 24), ("auto", 24), ("pallas", 12)])
def test_engine_random_histories_slow(tiny, backend, count):
    engine_matches_dense(tiny, backend, count, seed=1601)
    engine_matches_dense(tiny, backend, count // 2, seed=1602, concurrent=False, prefill_chunk=5)
