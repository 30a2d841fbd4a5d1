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
from exactness import dense_answers, mismatches, random_histories, run_requests
from golden import F32_ATOL, tiny_dir, tiny_golden
from test_cache_core import classify, random_history

from akv_jax.cache.core import CacheOps, restore
from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.serving.engine import Engine
from converters.loading import load_model

CAPACITY = 192


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


def compare_states(state, dense, dm, T):
    k, v = state.slot_keys()
    kd = dm.rotated_keys(dense)
    for layer in range(len(kd)):
        np.testing.assert_allclose(np.asarray(k[layer, :T]), kd[layer], atol=1e-5)
        np.testing.assert_allclose(np.asarray(v[layer, :T]), dense.v[layer], atol=1e-5)
    assert np.asarray(state.positions[:T]).tolist() == dense.pos.tolist()
    assert np.asarray(state.active[:T]).tolist() == dense.active.tolist()
    assert int(state.next_pos) == dense.next_pos


def _random_cache_histories(tiny, n: int, seed: int):
    m, dm, ops = tiny
    rng = np.random.default_rng(seed)
    seen = set()
    for _ in range(n):
        segs, h = random_history(rng, n_max=8, len_max=20)
        seen |= classify(h)
        T = sum(map(len, segs))
        ref_logits, ref_state = dm.run(segs, h)
        inc_logits, inc_state = ops.run(m.params, ops.empty(CAPACITY), segs, h)
        one_logits, one_state = restore(m.params, m.cfg, segs, h, max_tokens=CAPACITY,
                                        block_q=16, static_sizes=True)
        np.testing.assert_allclose(np.asarray(inc_logits), ref_logits, atol=1e-4)
        np.testing.assert_allclose(np.asarray(one_logits), ref_logits, atol=1e-4)
        compare_states(inc_state, ref_state, dm, T)
        compare_states(one_state, ref_state, dm, T)
    return seen


def test_random_histories_cache_ops_and_restore(tiny):
    seen = _random_cache_histories(tiny, 3, seed=16)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos"}, seen


@pytest.mark.slow
def test_random_histories_cache_ops_and_restore_200(tiny):
    seen = _random_cache_histories(tiny, 200, seed=1600)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos"}, seen


def _engine_case(tiny, backend: str, count: int, seed: int, concurrent=True, **kw):
    m, dm, _ = tiny
    reqs = random_histories(np.random.default_rng(seed), count, vocab=m.cfg.vocab_size)
    refs = dense_answers(dm, reqs)
    eng = Engine(m, max_total_tokens=4096, page_size=8, attention_backend=backend, **kw)
    order = list(range(len(reqs)))
    got = run_requests(eng, reqs, order, concurrent)
    bad = mismatches(refs, order, got)
    assert not bad, "\n".join(bad)
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0


@pytest.mark.parametrize("backend,count", [("reference", 2), ("auto", 3), ("pallas", 1)])
def test_engine_random_histories(tiny, backend, count):
    _engine_case(tiny, backend, count, seed=160)


@pytest.mark.slow
@pytest.mark.parametrize("backend,count", [("reference", 80), ("auto", 80), ("pallas", 40)])
def test_engine_random_histories_slow(tiny, backend, count):
    _engine_case(tiny, backend, count, seed=1601)
    _engine_case(tiny, backend, count // 4, seed=1602, concurrent=False, prefill_chunk=5)
