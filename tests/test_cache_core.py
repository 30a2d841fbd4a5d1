"""Incremental ops, one-pass restore and the naive dense reference agree.

The dense reference (akv_jax.cache.dense_reference) is numpy float64 with explicit masks:
an oracle that shares no attention, paging or RoPE-table code with the JAX paths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ops_cases import classify, random_history

from akv_jax.cache.core import CacheOps, restore, run_history
from akv_jax.cache.dense_reference import DenseModel
from akv_jax.cache.ops import parse_history
from akv_jax.model.params import init_params
from akv_jax.model.presets import tiny_config
from akv_jax.model.rope import make_rope_table
from akv_jax.pallas.dispatch import make_attention_fn
from akv_jax.pallas.rotary import apply_rope, rerotate

CAPACITY = 192
N_HISTORIES = 200


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("qwen3")
    params = init_params(cfg, jax.random.key(7))
    return cfg, params, DenseModel(params, cfg), CacheOps(cfg, block_q=16, page_size=16)


def compare_states(state, dense, dm, T):
    k, v = state.slot_keys()
    kd = dense.rotated_keys(dm.inv_freq)
    for layer in range(len(kd)):
        np.testing.assert_allclose(np.asarray(k[layer, :T]), kd[layer], atol=1e-5)
        np.testing.assert_allclose(np.asarray(v[layer, :T]), dense.v[layer], atol=1e-5)
    assert np.asarray(state.positions[:T]).tolist() == dense.pos.tolist()
    assert np.asarray(state.active[:T]).tolist() == dense.active.tolist()
    assert not np.asarray(state.active[T:]).any()
    assert int(state.next_pos) == dense.next_pos
    assert int(state.length) == T


def test_random_histories_agree(model):
    cfg, params, dm, ops = model
    rng = np.random.default_rng(2026)
    seen = set()
    for _ in range(N_HISTORIES):
        segs, h = random_history(rng)
        seen |= classify(h)
        T = sum(map(len, segs))
        ref_logits, ref_state = dm.run(segs, h)
        inc_logits, inc_state = ops.run(params, ops.empty(CAPACITY), segs, h)
        one_logits, one_state = restore(
            params, cfg, segs, h, max_tokens=CAPACITY, block_q=16, static_sizes=True
        )
        np.testing.assert_allclose(np.asarray(inc_logits), ref_logits, atol=1e-4)
        np.testing.assert_allclose(np.asarray(one_logits), ref_logits, atol=1e-4)
        compare_states(inc_state, ref_state, dm, T)
        compare_states(one_state, ref_state, dm, T)
        n_ops = int(inc_state.num_ops)
        assert n_ops == int(one_state.num_ops)
        np.testing.assert_array_equal(
            np.asarray(inc_state.ops[:n_ops]), np.asarray(one_state.ops[:n_ops])
        )
    assert seen >= {
        "drop_first",
        "drop_last_boundary",
        "middle_drop_then_repos",
        "drop_without_repos",
        "several_repos",
    }, seen


def test_whole_history_under_one_jit(model):
    cfg, params, dm, ops = model
    segs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    h = parse_history({"drop": {"2": [1], "3": [0]}, "reposition": [2, 4]}, 5)
    padded = [ops.pad_segment(s) for s in segs]
    fn = jax.jit(
        functools.partial(
            run_history,
            history=h,
            cfg=cfg,
            rope=ops.rope,
            attention=make_attention_fn("reference", block_q=16, sm_scale=cfg.head_dim**-0.5),
            block_q=16,
        )
    )
    logits, state = fn(params, ops.empty(CAPACITY), [p for p, _ in padded], [n for _, n in padded])
    ref_logits, ref_state = dm.run(segs, h)
    got = np.concatenate([np.asarray(lg[:n]) for lg, (_, n) in zip(logits, padded, strict=True)])
    np.testing.assert_allclose(got, ref_logits, atol=1e-4)
    compare_states(state, ref_state, dm, sum(map(len, segs)))


def test_figure10_state(model):
    cfg, params, dm, ops = model
    segs = [[11], [12], [13], [14], [15], [16]]  # A B C D E F
    h = parse_history({"drop": {"2": [1], "3": [3]}, "reposition": [2, 4]}, 6)
    _, st = ops.run(params, ops.empty(CAPACITY), segs, h)
    assert np.asarray(st.positions[:6]).tolist() == [0, 1, 1, 2, 2, 3]
    assert np.asarray(st.active[:6]).tolist() == [True, False, True, False, True, True]


def test_figure5_three_different_states(model):
    """A,B,C then drop A; A,B, drop A, then C; B,C from scratch: three different C states."""
    cfg, params, dm, ops = model
    A, B, C = [3, 4, 5, 6], [7, 8, 9], [10, 11, 12]
    paths = [
        ([A, B, C], parse_history({"drop": {"2": [0]}}, 3)),
        ([A, B, C], parse_history({"drop": {"1": [0]}}, 3)),
        ([B, C], parse_history(None, 2)),
    ]
    c_states = []
    for segs, h in paths:
        _, st = ops.run(params, ops.empty(CAPACITY), segs, h)
        k, v = st.slot_keys()
        T = sum(map(len, segs))
        c_states.append((np.asarray(k[:, T - 3 : T]), np.asarray(v[:, T - 3 : T])))
    for i in range(3):
        for j in range(i + 1, 3):
            dk = np.abs(c_states[i][0] - c_states[j][0]).max()
            dv = np.abs(c_states[i][1] - c_states[j][1]).max()
            assert max(dk, dv) > 1e-3, (i, j, dk, dv)


def test_repos_rotation_composes_up_to_32k():
    cfg = tiny_config()
    table = make_rope_table(cfg.rope, cfg.head_dim, 32768 + 1)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((512, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
    p = jnp.asarray(rng.integers(0, 32769, 512), jnp.int32)
    q = jnp.asarray(rng.integers(0, 32769, 512), jnp.int32)
    got = rerotate(apply_rope(k, p, table), p, q, table)
    np.testing.assert_allclose(np.asarray(got), np.asarray(apply_rope(k, q, table)), atol=1e-5)
    # delta 0 is the identity
    same = rerotate(apply_rope(k, p, table), p, p, table)
    np.testing.assert_allclose(np.asarray(same), np.asarray(apply_rope(k, p, table)), atol=1e-6)


def test_repos_of_contiguous_run_is_noop(model):
    """Drop the first segment then repos: the rest shift as one block, logits barely move."""
    cfg, params, dm, ops = model
    segs = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14]]
    with_repos = parse_history({"drop": {"1": [0]}, "reposition": [1]}, 4)
    without = parse_history({"drop": {"1": [0]}}, 4)
    la, sa = ops.run(params, ops.empty(CAPACITY), segs, with_repos)
    lb, sb = ops.run(params, ops.empty(CAPACITY), segs, without)
    assert int(sa.next_pos) != int(sb.next_pos)  # positions really changed
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=1e-5)


def test_repos_after_middle_drop_matters(model):
    """The counterpart: a gap in the middle makes repos change what later tokens compute."""
    cfg, params, dm, ops = model
    segs = [[1, 2, 3, 4, 5], [6, 7, 8, 20, 21, 22, 23], [9, 10, 11, 12], [13, 14]]
    la, _ = ops.run(
        params, ops.empty(CAPACITY), segs, parse_history({"drop": {"2": [1]}, "reposition": [2]}, 4)
    )
    lb, _ = ops.run(params, ops.empty(CAPACITY), segs, parse_history({"drop": {"2": [1]}}, 4))
    assert np.abs(np.asarray(la[-2:]) - np.asarray(lb[-2:])).max() > 1e-4
