"""The whole-array :func:`timeline` against the per-segment walk it replaced."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from akv_jax.cache.ops import OpHistory, add_random_ops, parse_history
from akv_jax.cache.timeline import Timeline, timeline


def walk_timeline(seg_lens, history: OpHistory, start_pos: int = 0) -> Timeline:
    """The previous per-segment walk of ``timeline``, kept verbatim as the reference: it
    states DESIGN.md §2 (append, drops, repos at each boundary) literally, one segment at a
    time, including what it leaves in unreached or inactive entries."""
    n = len(seg_lens)
    if history.num_segments != n:
        raise ValueError(f"history is over {history.num_segments} segments, request has {n}")
    lens = np.asarray(seg_lens, np.int64)
    start = np.concatenate([[0], np.cumsum(lens)])
    T = int(start[-1])
    token_seg = np.repeat(np.arange(n), lens)
    num_versions = len(history.repos) + 1
    version_pos = np.zeros((num_versions, T), np.int64)
    version_has = np.zeros((num_versions, T), bool)
    pos = np.zeros(T, np.int64)
    active = np.zeros(T, bool)
    append_pos = np.zeros(T, np.int64)
    seg_epoch = np.zeros(n, np.int64)
    next_pos, epoch = start_pos, 0
    for s in range(n):
        a, b = start[s], start[s + 1]
        seg_epoch[s] = epoch
        pos[a:b] = next_pos + np.arange(b - a)
        append_pos[a:b] = pos[a:b]
        active[a:b] = True
        next_pos += b - a
        for i in history.drops_at(s):
            active[start[i] : start[i + 1]] = False
        if history.repos_at(s):
            version_pos[epoch, :b] = pos[:b]
            version_has[epoch, :b] = True
            r = int(active[:b].sum())
            pos[:b][active[:b]] = np.arange(r)
            next_pos = r
            epoch += 1
    version_pos[epoch] = pos
    version_has[epoch] = True
    return Timeline(
        seg_lens=lens,
        seg_start=start,
        token_seg=token_seg,
        append_pos=append_pos,
        seg_epoch=seg_epoch,
        drop_boundary=history.drop_boundary(),
        version_pos=version_pos,
        version_has=version_has,
        final_pos=pos.copy(),
        final_active=active.copy(),
        next_pos=int(next_pos),
    )


def assert_same(seg_lens, history: OpHistory, start_pos: int = 0) -> None:
    got = timeline(seg_lens, history, start_pos)
    want = walk_timeline(seg_lens, history, start_pos)
    ctx = f"lens={list(seg_lens)} history={history} start_pos={start_pos}"
    for f in dataclasses.fields(Timeline):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray), (f.name, ctx)
            assert g.dtype == w.dtype, (f.name, g.dtype, w.dtype, ctx)
            np.testing.assert_array_equal(g, w, err_msg=f"{f.name}: {ctx}")
        else:
            assert type(g) is type(w) and g == w, (f.name, g, w, ctx)


def random_history(rng, n: int, p_drop: float, p_repos: float) -> OpHistory:
    cache: dict = {"drop": {}, "reposition": []}
    dropped: set[int] = set()
    for b in range(n):
        add_random_ops(rng, cache, b, dropped, p_drop, p_repos)
    return parse_history(cache, n)


def test_matches_walk_on_random_histories():
    rng = np.random.default_rng(20240611)
    probs = [0.0, 0.05, 0.2, 0.5, 0.9, 1.0]
    seen_repos = seen_drops = 0
    for _ in range(300):
        n = int(rng.integers(1, 31))
        lens = rng.integers(1, 41, size=n).tolist()
        h = random_history(rng, n, float(rng.choice(probs)), float(rng.choice(probs)))
        seen_repos += bool(h.repos)
        seen_drops += bool(h.drops)
        start_pos = int(rng.choice([0, 1, int(rng.integers(2, 5000))]))
        assert_same(lens, h, start_pos)
    assert seen_repos > 50 and seen_drops > 50  # the generator really exercised both ops


def test_empty_histories():
    for lens in ([], [7], [3, 1, 4, 1, 5]):
        for start_pos in (0, 9):
            assert_same(lens, OpHistory.empty(len(lens)), start_pos)


def test_repos_at_first_and_last_boundary():
    lens = [4, 2, 5, 3, 6]
    n = len(lens)
    for cache in (
        {"reposition": [0]},
        {"reposition": [n - 1]},
        {"reposition": [0, n - 1]},
        {"drop": {"0": [0]}, "reposition": [0]},  # everything dropped, then compacted
        {"drop": {str(n - 1): [0, 2, n - 1]}, "reposition": [0, n - 1]},
        {"drop": {"1": [0, 1], "3": [3]}, "reposition": list(range(n))},
    ):
        for start_pos in (0, 11):
            assert_same(lens, parse_history(cache, n), start_pos)


def test_hand_built_histories():
    """Histories built without parse_history: unsorted, duplicate and out-of-range repos
    (extra version rows stay zero) and drops listed before their segment is appended."""
    lens = [3, 1, 2, 4]
    for h in (
        OpHistory(4, {}, (3, 1)),
        OpHistory(4, {2: (0,)}, (2, 2)),
        OpHistory(4, {1: (0,)}, (1, 9)),
        OpHistory(4, {0: (2,), 3: (2,)}, (1,)),
        OpHistory(4, {0: (2,)}, (2,)),
        OpHistory(4, {1: (1,), 2: (1,)}, (0, 2)),
    ):
        assert_same(lens, h, 5)


def test_zero_length_segments():
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        lens = rng.integers(0, 4, size=n).tolist()
        assert_same(lens, random_history(rng, n, 0.3, 0.4), int(rng.integers(0, 20)))


def test_segment_count_mismatch():
    with pytest.raises(ValueError, match="segments"):
        timeline([1, 2], OpHistory.empty(3))
