"""Packing trajectories into fixed-size examples: layout, targets, budgets (host only, no
model: the losses through packs are tests/test_train_loss.py)."""

from __future__ import annotations

import numpy as np
import pytest

from akv_jax.cache.ops import parse_history
from akv_jax.cache.timeline import timeline
from akv_jax.train.example import TrainTrajectory
from akv_jax.train.pack import PackShape, first_fit, fits, pack, stack, usage

SHAPE = PackShape(
    max_tokens=64, page_size=4, block_q=4, max_segments=8, max_trajectories=3, max_versions=3
)


def traj(lens, cache=None, start=0, masks=None):
    segs = [list(range(start + 10 * s, start + 10 * s + n)) for s, n in enumerate(lens)]
    h = parse_history(cache, len(lens))
    masks = masks or [np.ones(n, bool) for n in lens]
    return TrainTrajectory(segs, h, masks)


def test_targets_follow_the_convention():
    a = traj([3, 2], masks=[np.array([1, 1, 0], bool), np.array([1, 0], bool)])
    b = traj([2], start=100)
    ex = pack([a, b], SHAPE)
    assert ex.tokens[:7].tolist() == [0, 1, 2, 10, 11, 100, 101]
    assert ex.row_trajectory[:8].tolist() == [0, 0, 0, 0, 0, 1, 1, -1]
    # row j predicts token j + 1 of its own trajectory, weighted by that token's mask
    assert ex.targets[:7].tolist() == [1, 2, 10, 11, 0, 101, 0]
    assert ex.weights[:7].tolist() == [1, 0, 1, 0, 0, 1, 0]
    assert not ex.weights[7:].any()


def test_layout_keeps_trajectories_apart():
    a = traj([5, 3, 4], {"drop": {"1": [0]}, "reposition": [1]})
    b = traj([6, 2], {"reposition": [0, 1]}, start=200)
    c = traj([7])
    ex = pack([a, b, c], SHAPE)
    T = SHAPE.max_tokens
    # trajectory i owns pages [base_i, base_i + its usage): every page its segments view and
    # every slot its versions write lies there (the version after a last-boundary repos is
    # written but viewed by no segment)
    owner_segs = [0, 0, 0, 1, 1, 2]
    bases = np.cumsum([0] + [usage(t, SHAPE.page_size).pages for t in (a, b, c)])
    for s, o in enumerate(owner_segs):
        pages = ex.page_table[s, : -(-int(ex.kv_len[s]) // SHAPE.page_size)]
        assert ((pages >= bases[o]) & (pages < bases[o + 1])).all(), s
    assert not ex.kv_len[len(owner_segs) :].any()
    sentinel = SHAPE.num_pages * SHAPE.page_size
    for i in range(3):
        written = ex.write_slots[:, ex.row_trajectory == i]
        pages = written[written < sentinel] // SHAPE.page_size
        assert ((pages >= bases[i]) & (pages < bases[i + 1])).all(), i
    assert (ex.write_slots[:, ex.row_trajectory < 0] == sentinel).all()
    # each trajectory's positions are its own timeline's, from 0
    for i, t in enumerate((a, b, c)):
        tl = timeline([len(s) for s in t.segments], t.history)
        assert ex.q_positions[ex.row_trajectory == i].tolist() == tl.append_pos.tolist()
    # query blocks never straddle segments and cover every real row once
    covered = np.zeros(T, int)
    for s, q0, n in zip(ex.block_seg, ex.block_q_start, ex.block_q_len, strict=True):
        if s >= 0:
            covered[q0 : q0 + n] += 1
    assert covered.tolist() == (ex.row_trajectory >= 0).astype(int).tolist()


def test_budgets_and_first_fit():
    big = traj([20, 20])  # 40 tokens
    small = traj([10])
    many_versions = traj([2, 2, 2, 2], {"reposition": [0, 1, 2]})  # 4 versions > 3
    assert usage(big, 4).tokens == 40 and usage(big, 4).pages == 10
    assert fits([big, small], SHAPE) and not fits([big, big], SHAPE)
    assert first_fit([big, big, small, small, small], SHAPE) == [[0, 2, 3], [1, 4]]
    with pytest.raises(ValueError, match="max_versions: 4 > 3"):
        first_fit([small, many_versions], SHAPE)
    with pytest.raises(ValueError, match="max_tokens: 80 > 64"):
        pack([big, big], SHAPE)
    with pytest.raises(ValueError, match="max_trajectories: 4 > 3"):
        pack([small] * 4, SHAPE)
    with pytest.raises(ValueError, match=r"segments\[1\] is empty"):
        pack([TrainTrajectory([[1], []], parse_history(None, 2), [np.ones(1), np.ones(0)])], SHAPE)
    with pytest.raises(ValueError, match="PackShape.max_tokens=10 must be a multiple"):
        PackShape(max_tokens=10, block_q=4)


def test_shapes_are_static_and_stack():
    a = pack([traj([3])], SHAPE)
    b = pack([traj([20, 9], {"drop": {"1": [0]}, "reposition": [0]}), traj([5])], SHAPE)
    for x, y in zip(a.to_dict().values(), b.to_dict().values(), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
    batch = stack([a, b])
    assert batch.tokens.shape == (2, SHAPE.max_tokens)
    assert batch.write_slots.shape == (2, SHAPE.max_versions, SHAPE.max_tokens)
    assert type(a).from_dict(a.to_dict()) is not None
