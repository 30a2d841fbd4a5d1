"""GPT-OSS (sinks, sliding windows, YaRN, biases, MoE) exact under every cache operation
(DESIGN §2.1): the naive float64 dense reference against transformers, then CacheOps
(incremental append/drop/repos), one-pass restore and the serving engine (reference, auto
and pallas attention) against the dense reference on random op histories whose prompts are
longer than the window, with drops inside and outside it and repositions after middle drops.

CI runs a few dozen histories; ``-m slow`` runs 200 for the cache paths and 60 through the
engine.
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
    """``tiny-gpt-oss``: window 8, (sliding, full) x 2, 6 experts top-2, YaRN factor 32."""
    m = load_model("tiny-gpt-oss")
    assert m.cfg.sliding_window == 8 and m.cfg.rope.attention_scaling() > 1.3
    return m, DenseModel(m.params, m.cfg), CacheOps(m.cfg, block_q=16, page_size=16)


def test_dense_reference_matches_transformers_golden():
    m = load_model(tiny_dir("tiny_gpt_oss"))
    g = tiny_golden("tiny_gpt_oss")
    dm = DenseModel(m.params, m.cfg)
    prompt = g["prompt"].tolist()
    assert len(prompt) > 10 * m.cfg.sliding_window
    logits, _ = dm.run([prompt], parse_history(None, 1))
    assert np.abs(logits - g["logits"]).max() < F32_ATOL  # measured 1.1e-6
    # Segments without ops are the same causal prompt.
    split, _ = dm.run([prompt[:100], prompt[100:101], prompt[101:]], parse_history(None, 3))
    assert np.abs(split - g["logits"]).max() < F32_ATOL
    # Greedy continuation of the dense reference = transformers'.
    toks, _ = dense_answers(dm, [([prompt], {"drop": {}, "reposition": []})], n=16)[0]
    assert toks == g["continuation"].tolist()


def test_window_counts_the_view(tiny):
    """A drop inside the next segment's window changes what it computes (the window reaches
    further back), and CacheOps agrees with the oracle with and without a repos."""
    m, dm, ops = tiny
    segs = [list(range(1, 13)), list(range(20, 24)), list(range(30, 36))]
    base, _ = dm.run(segs, parse_history(None, 3))
    dropped, _ = dm.run(segs, parse_history({"drop": {"1": [1]}}, 3))
    assert np.abs(base[-6:] - dropped[-6:]).max() > 1e-3
    for h in (parse_history({"drop": {"1": [1]}}, 3),
              parse_history({"drop": {"1": [0]}, "reposition": [1]}, 3)):
        ref, _ = dm.run(segs, h)
        got, _ = ops.run(m.params, ops.empty(CAPACITY), segs, h)
        np.testing.assert_allclose(np.asarray(got), ref, atol=1e-4)


def compare_states(state, dense, dm, T):
    k, v = state.slot_keys()
    kd = dm.rotated_keys(dense)  # stored with YaRN's attention factor, once
    for layer in range(len(kd)):
        np.testing.assert_allclose(np.asarray(k[layer, :T]), kd[layer], atol=1e-5)
        np.testing.assert_allclose(np.asarray(v[layer, :T]), dense.v[layer], atol=1e-5)
    assert np.asarray(state.positions[:T]).tolist() == dense.pos.tolist()
    assert np.asarray(state.active[:T]).tolist() == dense.active.tolist()
    assert int(state.next_pos) == dense.next_pos


def _window_kinds(segs, h, window):
    """Which drops fall inside / outside the window of the next query at drop time."""
    kinds = set()
    lens = [len(s) for s in segs]
    for b, dropped in h.drops.items():
        end = sum(lens[: b + 1])
        for i in dropped:
            end_i = sum(lens[: i + 1])
            kinds.add("drop_in_window" if end - end_i < window else "drop_outside_window")
    return kinds


def _random_cache_histories(tiny, n: int, seed: int):
    m, dm, ops = tiny
    rng = np.random.default_rng(seed)
    seen = set()
    for _ in range(n):
        segs, h = random_history(rng, n_max=8, len_max=20)
        seen |= classify(h) | _window_kinds(segs, h, m.cfg.sliding_window)
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
    seen = _random_cache_histories(tiny, 12, seed=14)
    assert {"drop_in_window", "drop_outside_window", "middle_drop_then_repos"} <= seen, seen


@pytest.mark.slow
def test_random_histories_cache_ops_and_restore_200(tiny):
    seen = _random_cache_histories(tiny, 200, seed=1400)
    assert seen >= {"drop_first", "drop_last_boundary", "middle_drop_then_repos",
                    "drop_without_repos", "several_repos", "drop_in_window",
                    "drop_outside_window"}, seen


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


@pytest.mark.parametrize("backend,count", [("reference", 6), ("auto", 6), ("pallas", 2)])
def test_engine_random_histories(tiny, backend, count):
    _engine_case(tiny, backend, count, seed=140)


@pytest.mark.slow
@pytest.mark.parametrize("backend,count", [("reference", 24), ("auto", 24), ("pallas", 12)])
def test_engine_random_histories_slow(tiny, backend, count):
    _engine_case(tiny, backend, count, seed=1401)
    _engine_case(tiny, backend, count // 2, seed=1402, concurrent=False, prefill_chunk=5)
