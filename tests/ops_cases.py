"""Shared cases of the per-model op tests (``test_gpt_oss_ops``, ``test_qwen3_moe_ops``,
``test_minimax_m2_ops``): a model's CacheOps, one-pass restore and engine against the dense
reference of the op semantics on random op histories. Each test file supplies its model (a
``(model, DenseModel, CacheOps)`` triple) and its seeds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from exactness import dense_answers, mismatches, random_histories, run_requests

from akv_jax.cache.core import restore
from akv_jax.cache.ops import parse_history
from akv_jax.serving.engine import Engine

CAPACITY = 192  # slots of the CacheOps state: the longest random history fits


def random_history(rng, n_max=9, len_max=24, n_min=2, p_drop=0.25):
    """``(segments, history)``: ``n_min``..``n_max`` random segments with random drops (each
    live segment with probability ``p_drop`` at each boundary) and repos."""
    n = int(rng.integers(n_min, n_max + 1))
    lens = rng.integers(1, len_max + 1, size=n)
    segs = [rng.integers(0, 512, size=int(m)).tolist() for m in lens]
    drops, dropped = {}, set()
    for s in range(n):
        cand = [i for i in range(s + 1) if i not in dropped and rng.random() < p_drop]
        if cand:
            drops[str(s)] = cand
            dropped.update(cand)
    repos = [s for s in range(n) if rng.random() < 0.3]
    return segs, parse_history({"drop": drops, "reposition": repos}, n)


def classify(h):
    """The kinds of op pattern a history contains (what the random tests must cover)."""
    kinds = set()
    last = h.num_segments - 1
    for b, segs in h.drops.items():
        if 0 in segs:
            kinds.add("drop_first")
        if b == last:
            kinds.add("drop_last_boundary")
        if any(0 < i < b for i in segs) and any(r >= b for r in h.repos):
            kinds.add("middle_drop_then_repos")
    if h.drops and not h.repos:
        kinds.add("drop_without_repos")
    if len(h.repos) >= 2:
        kinds.add("several_repos")
    return kinds


def compare_states(state, dense, dm, T: int) -> None:
    """The first ``T`` slots of a CacheOps state equal the dense reference's: keys as the
    reference stores them rotated (with YaRN's attention factor, once), values, positions,
    the active mask and the next position."""
    k, v = state.slot_keys()
    kd = dm.rotated_keys(dense)
    for layer in range(len(kd)):
        np.testing.assert_allclose(np.asarray(k[layer, :T]), kd[layer], atol=1e-5)
        np.testing.assert_allclose(np.asarray(v[layer, :T]), dense.v[layer], atol=1e-5)
    assert np.asarray(state.positions[:T]).tolist() == dense.pos.tolist()
    assert np.asarray(state.active[:T]).tolist() == dense.active.tolist()
    assert int(state.next_pos) == dense.next_pos


def random_cache_histories(
    tiny, n: int, seed: int, kinds: Callable[[list, object], set[str]] | None = None
) -> set[str]:
    """``n`` random histories through CacheOps (incrementally) and one-pass restore, each
    compared with the dense reference (logits 1e-4, states 1e-5). Returns the kinds of
    history seen (:func:`classify`, plus ``kinds(segs, history)``)."""
    m, dm, ops = tiny
    rng = np.random.default_rng(seed)
    seen: set[str] = set()
    for _ in range(n):
        segs, h = random_history(rng, n_max=8, len_max=20)
        seen |= classify(h) | (kinds(segs, h) if kinds else set())
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


def engine_matches_dense(tiny, backend: str, count: int, seed: int, concurrent: bool = True,
                         **engine_kw) -> None:
    """``count`` random requests through the engine on ``backend`` give the dense
    reference's answers, and a flush leaves no page in use."""
    m, dm, _ = tiny
    reqs = random_histories(np.random.default_rng(seed), count, vocab=m.cfg.vocab_size)
    refs = dense_answers(dm, reqs)
    eng = Engine(m, max_total_tokens=4096, page_size=8, attention_backend=backend, **engine_kw)
    order = list(range(len(reqs)))
    got = run_requests(eng, reqs, order, concurrent)
    bad = mismatches(refs, order, got)
    assert not bad, "\n".join(bad)
    assert eng.flush_cache() and eng.cache.pool.used_pages == 0
